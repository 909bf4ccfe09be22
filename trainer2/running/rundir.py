"""A run directory, <checkpoint_dir>/<run_name>/: its exclusive lock, the files that mark it as a run's,
fresh run names, and the removal of temporary checkpoint directories that killed saves left behind."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Callable

from trainer2.io.safeio import NOFOLLOW, not_regular, open_regular, write_replace
from trainer2.monitor.telemetry import CONFIG_FILE, TELEMETRY_FILE
from trainer2.running.checkpoint import META_FILE, STEP_RE, TMP_PREFIX, list_checkpoints

try:
    import fcntl
except ImportError:  # not POSIX (Windows): runs are not locked there
    fcntl = None

LOCK_FILE = ".lock"
SUMMARY_FILE = "summary.json"
OWNER_FILE = ".run"  # {"run_id": ...}: which run the directory's files belong to, written before any of them
RUN_FILES = (TELEMETRY_FILE, CONFIG_FILE, SUMMARY_FILE, OWNER_FILE)  # with the step_<N>/ checkpoints, what a run writes
MARKS = (OWNER_FILE, TELEMETRY_FILE)  # with a step_<N>/ and a run's lock, names only a run gives a directory of its own
ORPHAN_RE = re.compile(re.escape(TMP_PREFIX) + r"(?:old-)?step_\d{8,}-(\d+)")  # checkpoint.save's temporary names


class RunDirError(ValueError):
    """A run directory that cannot be used: another process holds it, or it holds another run's files."""


def write_error(path: Path, e: Exception, note: str = "") -> OSError:
    """An OSError naming `path` and the cause of a failed write (the safetensors writer wraps the OS error in its
    own type, whose text holds the errno), with an optional note on what is still intact."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None and (
        m := re.search(r"(?:code: |os error )(\d+)", str(e))
    ):  # "(os error 28)", "Os { code: 28, .. }"
        code = int(m.group(1))
    cause = os.strerror(code) if code else str(e)
    return OSError(code or errno.EIO, cause + (f"; {note}" if note else ""), str(path))


def run_files(run_dir: Path) -> list[str]:
    """Names in run_dir that a run wrote (checkpoints, telemetry, config, summary), sorted; [] for a new directory."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name in RUN_FILES or STEP_RE.fullmatch(p.name))


def run_marks(path: Path) -> list[str]:
    """Names in directory `path` that mark it as a run's own: its owner file or telemetry, a step_<N> checkpoint, a
    run's lock, or its config and summary together (either alone is too common a name); [] for any other directory."""
    try:
        names = {p.name for p in path.iterdir()}
    except OSError:  # not a directory, or one this user cannot list (then no run of theirs is in it)
        return []
    found = {n for n in names if n in MARKS or STEP_RE.fullmatch(n)}
    if {CONFIG_FILE, SUMMARY_FILE} <= names:
        found |= {CONFIG_FILE, SUMMARY_FILE}
    if LOCK_FILE in names and run_lock(path / LOCK_FILE):
        found.add(LOCK_FILE)
    return sorted(found)


def run_lock(path: Path) -> bool:
    """Whether lock file `path` is a run's (RunLock's record of its holder), not another tool's `.lock` (pytest's)."""
    try:
        with open_regular(path) as f:
            holder = json.loads(f.read(4096).decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(holder, dict) and {"pid", "host", "since"} <= holder.keys()


def check_location(run_dir: Path) -> None:
    """Refuse, before anything is made, a run directory that is a file or lies inside another run (in a checkpoint
    step_<N>, a save's temporary directory, or a directory holding a run's files), whose pruning or clean-up would
    delete it; or one that holds another run's directory (which would then lie inside this one)."""
    if os.path.lexists(run_dir) and not run_dir.is_dir():
        raise RunDirError(
            f"run directory {run_dir} is a file, not a directory; pick another --run_name (in Python: another "
            "run_dir), or move the file"
        )
    parent = run_dir.absolute().parent
    for above in [parent, *parent.parents]:
        if os.path.lexists(above) and not above.is_dir():
            raise RunDirError(
                f"{above} is not a directory, so run directory {run_dir} cannot be made under it; pick another "
                "--checkpoint_dir (in Python: another run_dir), or move the file"
            )
    real = parent.resolve()  # through links: a run reached by a link to another run's checkpoint is inside it too
    for above in [real, *real.parents]:
        run = above.parent
        if STEP_RE.fullmatch(above.name):
            why = f"checkpoint {above} of run {run}, which that run deletes when it prunes old checkpoints"
        elif ORPHAN_RE.fullmatch(above.name):
            why = f"{above}, a checkpoint save's temporary directory, which run {run} deletes when it starts"
        elif marks := run_marks(above):
            run, why = above, f"the directory of run {above} (it holds {', '.join(marks[:4])}), which is that run's own"
        else:
            continue
        raise RunDirError(
            f"run directory {run_dir} lies inside {why}; pick a --checkpoint_dir outside {run} (in Python: a run_dir "
            "outside it)"
        )
    for inner in sorted(run_dir.iterdir()) if run_dir.is_dir() else ():
        marks = [] if inner.is_symlink() else run_marks(inner)
        if marks:
            raise RunDirError(
                f"run directory {run_dir} holds the directory of another run, {inner} (it holds "
                f"{', '.join(marks[:4])}), which would then lie inside this run; move {inner} out, or pick another "
                "--run_name or --checkpoint_dir (in Python: another run_dir), one that holds no run"
            )


def owner(run_dir: Path) -> str | None:
    """The run id recorded in run_dir/.run; None when there is none (a new directory, or a run of older trainer2)."""
    try:
        with open_regular(run_dir / OWNER_FILE) as f:
            rid = json.loads(f.read().decode("utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return rid if isinstance(rid, str) else None


def claim(run_dir: Path, run_id: str) -> None:
    """Record run_id as the owner of run_dir's files (before the run writes any of them)."""
    if owner(run_dir) != run_id:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_replace(run_dir / OWNER_FILE, (json.dumps({"run_id": run_id}) + "\n").encode())


def fresh_name(checkpoint_dir: Path, prefix: str) -> str:
    """`<prefix>-<N>` with N one more than the largest taken under checkpoint_dir (1 for the first). Under torchrun,
    a directory whose lock this job's rank 0 already holds is not taken: every rank must arrive at the same name."""
    pattern = re.compile(re.escape(prefix) + r"-(\d+)")
    found = (
        (p, m)
        for p in (checkpoint_dir.iterdir() if checkpoint_dir.is_dir() else ())
        if (m := pattern.fullmatch(p.name))
    )
    taken = [int(m.group(1)) for p, m in found if not ours(p)]
    return f"{prefix}-{max(taken, default=0) + 1}"


def ours(run_dir: Path) -> bool:
    """Whether run_dir's lock records this torchrun job (TORCHELASTIC_RUN_ID, unique with --standalone)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job is None:
        return False
    try:
        with open_regular(run_dir / LOCK_FILE) as f:
            return json.loads(f.read().decode("utf-8")).get("job") == job
    except (OSError, ValueError, AttributeError):
        return False


def newest_run(checkpoint_dir: Path) -> Path | None:
    """The run directory under checkpoint_dir whose newest checkpoint was written last; None when none has one."""
    newest: tuple[int, Path] | None = None
    for run in (p for p in checkpoint_dir.iterdir() if p.is_dir()) if checkpoint_dir.is_dir() else ():
        found = list_checkpoints(run)
        meta = found[-1] / META_FILE if found else None
        if meta is not None and meta.is_file() and (newest is None or meta.stat().st_mtime_ns > newest[0]):
            newest = (meta.stat().st_mtime_ns, run)
    return None if newest is None else newest[1]


class RunLock:
    """An exclusive lock on a run directory (flock on <run_dir>/.lock, which records the holder's pid and host).

    The kernel releases a flock when its process dies, so the lock of a killed run is never stale. A start that
    fails leaves neither the lock file it made nor a run directory it created empty. A run directory that is a
    symbolic link is refused."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.path = run_dir, run_dir / LOCK_FILE
        self.fd: int | None = None
        self.created = self.made = False

    def __enter__(self) -> "RunLock":
        if self.run_dir.is_symlink():  # its files would land wherever the link points, outside checkpoint_dir
            raise RunDirError(
                f"run directory {self.run_dir} is a symbolic link (to {os.readlink(self.run_dir)}); a run writes only "
                "into a directory of its own: remove the link, or pass --checkpoint_dir to write elsewhere"
            )
        self.created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if fcntl is None:
            return self
        while self.fd is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)  # again: a releasing holder may have just removed it
            made = not os.path.lexists(self.path)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o644)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                raise RunDirError(
                    f"{self.path} is a symbolic link; a run locks only a file it made itself: remove the link"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 512).decode("utf-8", "replace")
                os.close(fd)
                raise RunDirError(
                    f"run directory {self.run_dir} is in use by another run ({describe_holder(holder)}); "
                    "wait for it to end, or pass another --run_name"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the file was removed by a holder releasing an empty directory: lock the new one
                os.close(fd)
                continue
            self.fd, self.made = fd, made
            holder = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "job": os.environ.get("TORCHELASTIC_RUN_ID"),
            }
            try:
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps(holder).encode() + b"\n")
            except OSError as e:  # a full disk: a new lock file needs a block of its own
                self.__exit__(OSError)
                raise OSError(e.errno, e.strerror, str(self.path)) from None
        return self

    def __exit__(self, failed: type[BaseException] | None = None, *exc: object) -> None:
        """Release the lock. A lock file this start made goes again when the start failed (a refusal, an error), and
        so does a run directory it created and left empty; a run that ran keeps its lock file, as a killed one does."""
        empty = self.created and self.run_dir.is_dir() and {p.name for p in self.run_dir.iterdir()} <= {LOCK_FILE}
        if self.fd is not None:
            if self.made and (failed is not None or empty):
                self.path.unlink(missing_ok=True)  # while still held: a waiting opener sees another inode and retries
            os.close(self.fd)  # releases the flock
            self.fd = None
        if empty:
            try:
                self.run_dir.rmdir()
            except OSError:
                pass


def refuse_planted(run_dir: Path) -> None:
    """Refuse a run directory holding a symbolic link, a FIFO, a socket or a device: a run makes none of them, and its
    checkpoints, telemetry or summary would be written wherever a link points, or wait forever on a FIFO. Leftover
    temporary names are exempt: they are removed, never opened."""
    for p in sorted(run_dir.iterdir()) if run_dir.is_dir() else ():
        if p.name.startswith(TMP_PREFIX) or (p.name.startswith(".") and p.name.endswith(".tmp")):
            continue
        if p.is_symlink():
            raise RunDirError(
                f"{p} is a symbolic link (to {os.readlink(p)}); a run writes only files it made itself: remove the link"
            )
        kind = not_regular(p.stat().st_mode)
        if kind not in (None, "a directory"):
            raise RunDirError(f"{p} is {kind}, not a file a run writes; remove it")


def describe_holder(text: str) -> str:
    """'pid N on host H since T' from a lock file's contents, or what little can be said."""
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on host {h['host']}, since {h['since']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        return "a process that has not yet written its pid"


def lock_holder(run_dir: Path) -> str | None:
    """'pid N on host H, since T' of the process holding run_dir's lock (a run going on), else None: no lock file, a
    lock nobody holds, or no flock here. Probed with a shared lock, taken and dropped at once, which only a holder's
    exclusive one refuses."""
    if fcntl is None:
        return None
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | NOFOLLOW)
    except OSError:  # none, a link, unreadable: no run of this user holds it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return describe_holder(os.read(fd, 512).decode("utf-8", "replace"))
    finally:
        os.close(fd)  # releases the probe's lock, if it got one
    return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (another user's counts as alive). A zombie, one that has
    exited but whose parent has not yet collected it (a sweep worker killed under the worker that started it), is
    gone; where there is no /proc to tell, a process that answers counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])  # the state, after the command's name


def remove_orphans(run_dir: Path, log: Callable[[str], None]) -> int:
    """Remove the temporary checkpoint directories of saves whose process is gone (killed mid-save); returns
    the bytes freed. Call it holding the run's lock: then no live save of this run can be among them."""
    freed, removed = 0, []
    for p in sorted(run_dir.iterdir()) if run_dir.is_dir() else ():
        m = ORPHAN_RE.fullmatch(p.name)
        pid = int(m.group(1)) if m else None
        if pid is None or p.is_symlink() or not p.is_dir() or (pid_alive(pid) and pid != os.getpid()):
            continue
        freed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    if removed:
        log(
            f"removed {len(removed)} temporary checkpoint director{'y' if len(removed) == 1 else 'ies'} left by killed "
            f"saves in {run_dir} ({freed / 2**20:.1f} MiB): {', '.join(removed)}"
        )
    return freed

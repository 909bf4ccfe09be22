"""Fault injection on real `python main.py` runs: preemption (SIGTERM, SIGINT, SIGUSR1, SIGUSR2), kills, a terminal
that goes away, a full disk, concurrent runs, resuming into another run, a symlinked run directory, a checkpoint with
non-finite parameters, divergence.

    python -m benchmarks.faults [--windows 2000] [--interrupts 8] [--kills 9] [--seed 0] [--out DIR]

Each scenario that ends in a finished run is checked against one uninterrupted run of the same config: the
final checkpoint's tensors must be bitwise equal and telemetry.jsonl must hold the same rows (wall-clock
figures aside), each window once. Prints one line per scenario and a JSON summary (faults injected and
survived, windows redone, checkpoints and bytes lost). The full-disk scenario mounts a small tmpfs, so it runs only
as root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer2.monitor.telemetry import TELEMETRY_FILE, read_telemetry, trim
from trainer2.running import checkpoint as ck

REPO = Path(__file__).resolve().parent.parent
CLOCK = ("wall_seconds", "windows_per_second")


class Runs:
    """`python main.py` processes of one config under one checkpoint directory."""

    def __init__(self, root: Path, windows: int) -> None:
        self.root, self.n = root, 0
        self.base = [
            "--preset",
            "dev",
            "--max_windows",
            str(windows),
            "--log_every_windows",
            "25",
            "--eval_every_windows",
            "0",
            "--eval_batches",
            "4",
        ]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}

    def start(self, *argv: str, ckdir: Path | None = None) -> subprocess.Popen:
        self.n += 1
        log = self.root / f"proc{self.n}"
        return subprocess.Popen(
            [sys.executable, "main.py", *argv, "--checkpoint_dir", str(ckdir or self.root / "ck")],
            cwd=REPO,
            env=self.env,
            stdout=open(f"{log}.out", "w"),
            stderr=open(f"{log}.err", "w"),
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )

    def output(self, stream: str) -> str:
        """The last process's "out" or "err"."""
        return Path(f"{self.root}/proc{self.n}.{stream}").read_text()


def rows(run_dir: Path) -> int:
    path = run_dir / TELEMETRY_FILE
    return len(read_telemetry(path)) if path.is_file() else 0


def wait(cond, proc: subprocess.Popen, timeout: float = 600.0) -> bool:
    """Poll until cond() holds (True) or the process ends (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise TimeoutError("the run made no progress")


def same_run(ref: Path, run: Path, windows: int) -> tuple[bool, int]:
    """(bitwise-equal final tensors and telemetry rows, telemetry bytes of the reference missing from the run)."""
    name = ck.step_name(windows)
    ta, tb = load_file(str(ref / name / ck.TENSORS_FILE)), load_file(str(run / name / ck.TENSORS_FILE))
    tensors = sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in CLOCK} for r in rs]  # noqa: E731
    ra, rb = strip(read_telemetry(ref / TELEMETRY_FILE)), strip(read_telemetry(run / TELEMETRY_FILE))
    lost = sum(len(json.dumps(r)) + 1 for r in ra if r not in rb)
    return tensors and ra == rb and (run / TELEMETRY_FILE).read_bytes().endswith(b"\n"), lost


def resume_line(err: str) -> list[str] | None:
    found = [line for line in err.splitlines() if "resume with:" in line]
    return found[0].split("resume with: ", 1)[1].split()[2:] if len(found) == 1 else None


def summary_command(run_dir: Path) -> list[str] | None:
    """The resume command a stopped run wrote into its summary.json (for when its terminal is gone), after `python
    main.py`."""
    try:
        command = json.loads((run_dir / "summary.json").read_text()).get("resume_command")
    except (OSError, ValueError):
        return None
    return shlex.split(command)[2:] if isinstance(command, str) else None


def preemption(runs: Runs, ref: Path, windows: int, count: int, rng: random.Random) -> dict:
    """SIGTERM / SIGINT / SIGUSR1 / SIGUSR2 in turn at random moments, each followed by the resume command the run
    wrote into summary.json (it must equal the printed one), until the run ends."""
    injected = survived = 0
    argv = [*runs.base, "--run_name", "pre"]
    run_dir = runs.root / "ck" / "pre"
    while True:
        before = rows(run_dir)
        proc = runs.start(*argv)
        sig = None
        if injected < count and wait(lambda: rows(run_dir) > before, proc):
            time.sleep(rng.uniform(0.0, 1.0))
            sig = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)[injected % 4]
            proc.send_signal(sig)
            injected += 1
        rc = proc.wait()
        err = runs.output("err")
        finished = (run_dir / ck.step_name(windows)).is_dir()  # a signal after the last save finds nothing left to do
        command = summary_command(run_dir) if rc != 0 else None
        printed = command is not None and command == resume_line(err)
        if sig is not None and "Traceback" not in err and (finished or (rc == 128 + sig and printed)):
            survived += 1
        if finished:
            break
        argv = command or ["--resume", "latest", "--run_name", "pre"]
    equal, lost = same_run(ref, run_dir, windows)
    return {
        "injected": injected,
        "survived": survived if equal else 0,
        "bitwise_equal": equal,
        "telemetry_bytes_lost": lost,
    }


def kills(runs: Runs, ref: Path, windows: int, count: int, rng: random.Random) -> dict:
    """With a checkpoint every 50 windows, in turn: SIGKILL at a random moment, two SIGTERMs 0.2 s apart (stop at
    once), and SIGKILL in the middle of a save (as soon as its temporary directory appears)."""
    injected, redone, freed, torn, orphans = 0, 0, 0.0, 0, 0
    run_dir = runs.root / "ck" / "kill"
    argv = [*runs.base, "--run_name", "kill", "--save_every_windows", "50"]
    while True:
        before = rows(run_dir)
        proc = runs.start(*argv)
        if injected < count and wait(lambda: rows(run_dir) > before, proc):
            time.sleep(rng.uniform(0.0, 1.5))
            if injected % 3 == 1:
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
            elif injected % 3 == 2:
                saving = lambda: any(p.name.startswith(".tmp-step") and any(p.iterdir()) for p in run_dir.iterdir())  # noqa: E731
                while proc.poll() is None and not saving():
                    time.sleep(0.0005)
                proc.kill()
            else:
                proc.kill()
            injected += 1
        rc = proc.wait()
        out = runs.output("out")
        for n, mib in re.findall(r"removed (\d+) temporary checkpoint director.* \(([\d.]+) MiB\)", out):
            orphans, freed = orphans + int(n), freed + float(mib)
        if rc == 0:
            break
        for path in ck.list_checkpoints(run_dir):  # every complete checkpoint must load
            try:
                ck.load_tensors(path, ck.read_meta(path))
            except ck.CheckpointError:
                torn += 1
        last = ck.list_checkpoints(run_dir)
        logged = read_telemetry(run_dir / TELEMETRY_FILE)[-1]["window"] if rows(run_dir) else 0
        redone += max(0, logged - (ck.step_of(last[-1]) if last else 0))
        argv = ["--resume", "latest", "--run_name", run_dir.name]
        if not last:  # killed before its first checkpoint: nothing to resume; a new run starts over
            run_dir = runs.root / "ck" / f"kill{injected}"
            argv = [*runs.base, "--run_name", run_dir.name, "--save_every_windows", "50"]
    equal, lost = same_run(ref, run_dir, windows)
    return {
        "injected": injected,
        "survived": injected if equal and not torn else 0,
        "bitwise_equal": equal,
        "torn_checkpoints": torn,
        "windows_redone_past_last_checkpoint": redone,
        "orphans_removed": orphans,
        "orphans_removed_mib": round(freed, 1),
        "telemetry_bytes_lost": lost,
    }


def full_disk(runs: Runs, ref: Path, windows: int) -> dict:
    """The checkpoint directory on a tmpfs too small for the run: the save fails, then (after resizing) a write fails
    on a filled disk (the resumed run's first: its lock file, since a run that fails removes the one it made; a
    telemetry append where a lock file is left); each time the run is resumed on more space."""
    if os.geteuid() != 0:
        return {"skipped": "needs root to mount a tmpfs"}
    mnt = runs.root / "tmpfs"
    mnt.mkdir()
    size = sum(f.stat().st_size for f in (ref / ck.step_name(windows)).iterdir())
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(2.5 * size) + 65536}", "tmpfs", str(mnt)], check=True)
    events = []
    try:
        argv = [*runs.base, "--run_name", "full", "--save_every_windows", str(windows // 3), "--keep_last", "2"]
        run_dir = mnt / "full"
        proc = runs.start(*argv, ckdir=mnt)
        rc = proc.wait()
        err = runs.output("err")
        intact = all(ck.load_tensors(p, ck.read_meta(p)) is not None for p in ck.list_checkpoints(run_dir))
        events.append(
            {
                "fault": "save on a full disk",
                "exit": rc,
                "message": (err.strip().splitlines() or [""])[-1],
                "traceback": "Traceback" in err,
                "earlier_checkpoints_intact": intact,
                "temporary_dirs_left": len([p for p in run_dir.iterdir() if p.name.startswith(".tmp")]),
            }
        )
        subprocess.run(["mount", "-o", f"remount,size={int(4.5 * size) + 65536}", str(mnt)], check=True)
        # Cut the rows the failed run logged past its checkpoint now (the resumed run would, freeing their pages),
        # then fill the disk to less than a page: the resumed run's appends soon cross into a page it cannot get.
        trim(run_dir / TELEMETRY_FILE, ck.step_of(ck.find_latest(run_dir)))
        (mnt / "filler").write_bytes(b"\0" * max(0, shutil.disk_usage(mnt).free - 2048))
        proc = runs.start("--resume", "latest", "--run_name", "full", ckdir=mnt)
        rc = proc.wait()
        err = runs.output("err")
        torn = not (run_dir / TELEMETRY_FILE).read_bytes().endswith(b"\n")
        events.append(
            {
                "fault": "write on a filled disk",
                "exit": rc,
                "message": (err.strip().splitlines() or [""])[-1],
                "traceback": "Traceback" in err,
                "telemetry_line_torn": torn,
                "rows_readable": rows(run_dir),
            }
        )
        (mnt / "filler").unlink()
        proc = runs.start("--resume", "latest", "--run_name", "full", ckdir=mnt)
        rc = proc.wait()
        equal, lost = same_run(ref, run_dir, windows) if rc == 0 else (False, -1)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    ok = all(e["exit"] == 74 and not e["traceback"] for e in events) and equal
    return {
        "injected": len(events),
        "survived": len(events) if ok else 0,
        "events": events,
        "bitwise_equal": equal,
        "telemetry_bytes_lost": lost,
    }


def contention(runs: Runs) -> dict:
    """Two more runs on a run directory while its run is going (a fresh one, a resume): both refused, naming the
    holder; the first run goes on unharmed (stopped by SIGTERM, it saves, and its telemetry is in order)."""
    proc = runs.start(*runs.base, "--run_name", "busy", "--save_every_windows", "50", "--max_windows", str(10**9))
    run_dir = runs.root / "ck" / "busy"
    wait(lambda: ck.list_checkpoints(run_dir), proc)
    refused = 0
    for argv in ([*runs.base, "--run_name", "busy"], ["--resume", "latest", "--run_name", "busy"]):
        other = subprocess.run(
            [sys.executable, "main.py", *argv, "--checkpoint_dir", str(runs.root / "ck")],
            cwd=REPO,
            env=runs.env,
            capture_output=True,
            text=True,
        )
        refused += other.returncode == 2 and f"pid {proc.pid}" in other.stderr
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait()
    windows = [r["window"] for r in read_telemetry(run_dir / TELEMETRY_FILE)]
    unharmed = rc == 143 and windows == sorted(set(windows)) and ck.step_of(ck.find_latest(run_dir)) >= windows[-1]
    return {"injected": 2, "survived": refused if unharmed else 0, "holder_unharmed": unharmed}


def foreign_resume(runs: Runs, ref: Path, windows: int) -> dict:
    """Resume the reference's checkpoint into another existing run: refused, that run's files unchanged."""
    victim = runs.root / "ck" / "pre"
    before = {p: p.read_bytes() for p in victim.rglob("*") if p.is_file() and p.name != ".lock"}
    other = subprocess.run(
        [
            sys.executable,
            "main.py",
            "--resume",
            str(ref / ck.step_name(windows)),
            "--run_name",
            "pre",
            "--keep_last",
            "1",
            "--checkpoint_dir",
            str(runs.root / "ck"),
        ],
        cwd=REPO,
        env=runs.env,
        capture_output=True,
        text=True,
    )
    after = {p: p.read_bytes() for p in victim.rglob("*") if p.is_file() and p.name != ".lock"}
    ok = other.returncode == 2 and after == before
    return {
        "injected": 1,
        "survived": int(ok),
        "bytes_lost": sum(len(v) for k, v in before.items() if after.get(k) != v),
    }


def terminal_lost(runs: Runs, ref: Path, windows: int) -> dict:
    """The run's terminal goes away: stdout and stderr on one pipe whose reader leaves after the first line (`2>&1 |
    head -1`, an SSH connection that drops), and stderr on /dev/full with stdout closed. Each run must finish: exit
    0, every checkpoint, summary.json, bitwise equal to the reference."""
    env = {k: v for k, v in runs.env.items() if k != "TQDM_DISABLE"}  # the progress bar writes to stderr
    results = []
    for how in ("one pipe closed after the first line", "stderr on /dev/full, stdout closed"):
        run_dir = runs.root / "ck" / f"lost{len(results)}"
        cmd = [sys.executable, "main.py", *runs.base, "--run_name", run_dir.name, "--save_every_windows", "50"]
        cmd += ["--checkpoint_dir", str(runs.root / "ck")]
        if how.startswith("one pipe"):
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            proc.stdout.readline()
            proc.stdout.close()
        else:
            with open("/dev/full", "w") as full:
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=full, preexec_fn=lambda: os.close(1))
        rc = proc.wait()
        saved = [ck.step_of(p) for p in ck.list_checkpoints(run_dir)]
        expected = sorted({*range(50, windows + 1, 50), windows})[-3:]  # keep_last 3
        equal = rc == 0 and (run_dir / "summary.json").is_file() and same_run(ref, run_dir, windows)[0]
        results.append({"fault": how, "exit": rc, "checkpoints_lost": len(set(expected) - set(saved)), "ok": equal})
    return {
        "injected": len(results),
        "survived": sum(r["ok"] and not r["checkpoints_lost"] for r in results),
        "checkpoints_lost": sum(r["checkpoints_lost"] for r in results),
        "events": results,
    }


def linked_run_dir(runs: Runs) -> dict:
    """A run directory that is a symlink to a directory elsewhere: refused (exit 2, one line naming it), nothing
    written where it points."""
    elsewhere = runs.root / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, runs.root / "ck" / "linked")
    proc = runs.start(*runs.base, "--run_name", "linked")
    rc = proc.wait()
    err = runs.output("err").strip().splitlines()
    ok = rc == 2 and len(err) == 1 and "is a symbolic link" in err[0] and not any(elsewhere.iterdir())
    return {"injected": 1, "survived": int(ok), "exit": rc, "message": err[-1] if err else ""}


def nonfinite_checkpoint(runs: Runs, ref: Path, windows: int) -> dict:
    """A run's newest checkpoint holds a NaN parameter and a matching sha256 (a corrupt disk or a bad copy): resuming
    it is refused (exit 2) naming the tensor and the run's last finite checkpoint, evaluating it too; that checkpoint,
    resumed into a new run, finishes bitwise equal to the reference."""
    from safetensors.torch import save_file

    quarter = windows // 4
    argv = [*runs.base, "--run_name", "nf", "--save_every_windows", str(quarter), "--keep_last", "4"]
    assert runs.start(*argv).wait() == 0, runs.output("err")
    run_dir = runs.root / "ck" / "nf"
    last, good = run_dir / ck.step_name(windows), run_dir / ck.step_name(windows - quarter)
    tensors = load_file(str(last / ck.TENSORS_FILE))
    tensors["param.W_1"].view(-1)[0] = float("nan")
    save_file(tensors, str(last / ck.TENSORS_FILE))
    meta = json.loads((last / ck.META_FILE).read_text())
    meta["tensors"].update(bytes=(last / ck.TENSORS_FILE).stat().st_size, sha256=ck._sha256(last / ck.TENSORS_FILE))
    (last / ck.META_FILE).write_text(json.dumps(meta))
    refused = []
    ckdir = ["--checkpoint_dir", str(runs.root / "ck")]
    for argv in (["--resume", "latest", "--run_name", "nf", *ckdir], ["evaluate", "--checkpoint", str(last)]):
        out = subprocess.run([sys.executable, "main.py", *argv], cwd=REPO, env=runs.env, capture_output=True, text=True)
        err = out.stderr.strip().splitlines()
        refused.append(out.returncode == 2 and len(err) == 1 and "param.W_1" in err[0] and str(good) in err[0])
    rc = runs.start("--resume", str(good), "--run_name", "nf2").wait()
    branch = runs.root / "ck" / "nf2" / ck.step_name(windows)
    ta, tb = load_file(str(ref / ck.step_name(windows) / ck.TENSORS_FILE)), load_file(str(branch / ck.TENSORS_FILE))
    equal = rc == 0 and sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    return {"injected": 2, "survived": sum(refused) if equal else 0, "refused": refused, "branch_bitwise_equal": equal}


def divergence(runs: Runs) -> dict:
    """A learning rule that blows up (momentum, lr 1, weight decay 10): exit 3, summary.json says so in strict JSON."""
    proc = runs.start(
        *runs.base, "--run_name", "blowup", "--update_rule", "momentum", "--eta_update", "1", "--weight_decay", "10"
    )
    rc = proc.wait()
    summary = json.loads((runs.root / "ck" / "blowup" / "summary.json").read_text(), parse_constant=lambda c: None)
    ok = rc == 3 and summary["diverged"] is True
    return {
        "injected": 1,
        "survived": int(ok),
        "exit": rc,
        "stopped_at_window": summary["windows"],
        "error": summary.get("error"),
    }


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=2000)
    p.add_argument("--interrupts", type=int, default=8)
    p.add_argument("--kills", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", type=Path, default=None, help="Where the runs go (default: a temporary directory, removed after)."
    )
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="trainer2-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    runs = Runs(root, args.windows)
    ref_proc = runs.start(*runs.base, "--run_name", "reference")
    assert ref_proc.wait() == 0, "the reference run failed"
    ref = root / "ck" / "reference"
    results = {
        "preemption (SIGTERM, SIGINT, SIGUSR1, SIGUSR2)": preemption(runs, ref, args.windows, args.interrupts, rng),
        "kill -9 / double SIGTERM": kills(runs, ref, args.windows, args.kills, rng),
        "full disk": full_disk(runs, ref, args.windows),
        "second run on a busy directory": contention(runs),
        "resume into another run": foreign_resume(runs, ref, args.windows),
        "terminal lost (stdout, stderr)": terminal_lost(runs, ref, args.windows),
        "symlinked run directory": linked_run_dir(runs),
        "checkpoint with non-finite parameters": nonfinite_checkpoint(runs, ref, args.windows),
        "divergence": divergence(runs),
    }
    for name, r in results.items():
        print(
            f"{name}: {r.get('survived', '-')} of {r.get('injected', '-')} survived"
            + (f" ({r['skipped']})" if "skipped" in r else "")
        )
    total = sum(r.get("injected", 0) for r in results.values()), sum(r.get("survived", 0) for r in results.values())
    lost = sum(r.get("checkpoints_lost", 0) for r in results.values())
    print(
        json.dumps(
            {"faults_injected": total[0], "faults_survived": total[1], "checkpoints_lost": lost, "scenarios": results},
            indent=1,
        )
    )
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if total[0] == total[1] else 1


if __name__ == "__main__":
    sys.exit(main())

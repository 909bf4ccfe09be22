"""Bad inputs and faults a new user runs into, each on a real `python main.py` process in a sandbox: sizes that cannot
fit (conv layers too), data and config files that are no files, lying or bomb archives and pickles, planted symlinks
and FIFOs, a symlinked run directory, foreign run directories, corrupt and non-finite checkpoints, bad torchrun
environments, stop signals (SIGUSR1 / SIGUSR2 too), a terminal that goes away (stdout, stderr, both), a diverging run.

    python -m benchmarks.bad_inputs [--timeout 90] [--only SUBSTRING] [--out DIR]

Counts, over all cases: tracebacks (a "Traceback" on stderr), hangs (no exit within --timeout), files changed
outside run directories (every file of the sandbox outside <ck>/<run>/ is hashed before and after each case; the
planted symlinks point at such files), exits other than the expected one, failed after-checks (a checkpoint and a
summary after a signal, a message naming the cause, a refused size within 30 s and 1.5 GiB of peak memory, no lock
left by a refused start ...), lost checkpoints (a run that should have saved and did not) and non-standard JSON (NaN,
Infinity) in any .json or .jsonl file a case wrote. Each child runs under an 8 GiB address-space limit, so a missed size
check fails fast instead of swapping. Prints one line per case (exit, peak memory) and a JSON summary; exits 1 when any
count is not 0.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
LIMIT_AS = 8 * 2**30
REFUSAL_SECONDS, REFUSAL_MIB = 30.0, 1536  # a size is refused within these (the acceptance)
TINY = {
    "hidden_sizes": [8],
    "coord_dim_n": 4,
    "rotor_k": 3,
    "context_len": 3,
    "embed_dim": 3,
    "batch_size": 8,
    "free_steps": 4,
    "nudge_steps": 2,
    "log_every_windows": 5,
    "eval_every_windows": 0,
    "eval_batches": 2,
    "max_windows": 10,
}


@dataclass
class Case:
    """One input: the arguments (after main.py), what to set up first, the exit it should end with."""

    name: str
    argv: list[str]
    expect: set[int]
    setup: Callable[[Path], None] = lambda root: None
    env: dict[str, str] = field(default_factory=dict)
    # "sighup" / "sigquit" / "sigusr1" / "sigusr2": send that signal once the run has logged; "closed_stdout": no
    # reader; "stderr_full": stderr on /dev/full; "closed_streams": stdout and stderr closed before the start;
    # "pipe_closed": stdout and stderr on one pipe whose reader leaves after the first line
    drive: str = ""
    check: Callable[[Path], str] = lambda root: ""  # "" or what is wrong afterwards
    says: str = ""  # what the last line of stderr must hold
    size: bool = False  # a size refusal: within REFUSAL_SECONDS and REFUSAL_MIB
    saves: str = ""  # the run that must end with a checkpoint and a summary.json


def npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def write_npz(path: Path, members: dict[str, bytes], compress: bool = False) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)


def npy(a: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, a, allow_pickle=True)
    return out.getvalue()


def sandbox(root: Path) -> None:
    """The files every case may use: a small text, a preset, files outside any run that must never change."""
    (root / "data").mkdir(parents=True)
    words = ["the cat sat on the mat. ", "a dog ran in the fog. ", "we see the sea. "]
    (root / "data" / "small.txt").write_text("".join(words[i % 3] for i in range(300)))
    (root / "tiny.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in TINY.items()))
    (root / "victim.txt").write_text("precious: a file of the user's, outside every run\n")
    (root / "ck").mkdir()
    y = np.arange(64) % 3
    write_npz(root / "data" / "lying.npz", {"x.npy": npy_header((10**12, 4)) + b"\0" * 1024, "y.npy": npy(y)})
    write_npz(root / "data" / "short.npz", {"x.npy": npy_header((64, 4)) + b"\0" * 100, "y.npy": npy(y)})
    write_npz(root / "data" / "objects.npz", {"x.npy": npy(np.array([[1, "a"]] * 64, dtype=object)), "y.npy": npy(y)})
    with zipfile.ZipFile(root / "data" / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as z:  # 4 GiB of zeros in ~4 MB
        with z.open("x.npy", "w", force_zip64=True) as f:
            rows = 4 * 2**30 // 16
            f.write(npy_header((rows, 4)))
            chunk = b"\0" * 2**26
            for _ in range(rows * 16 // len(chunk)):
                f.write(chunk)
        with z.open("y.npy", "w", force_zip64=True) as f:  # labels that agree with x: only its size gives it away
            f.write(npy_header((rows,), "|i1"))
            for _ in range(rows // len(chunk)):
                f.write(chunk)
    (root / "data" / "zeros.txt").write_bytes(b"\0" * 2**24)
    (root / "data" / "binary.txt").write_bytes(bytes(range(256)) * 4096)
    os.mkfifo(root / "data" / "fifo.txt")
    os.mkfifo(root / "fifo.yaml")
    os.symlink("loop.txt", root / "data" / "loop.txt")
    (root / "dup.yaml").write_text("eta_update: 0.001\nbatch_size: 8\neta_update: 0.01\n")
    (root / "alias.yaml").write_text("a: &x [1, 2]\nb: [*x, *x, *x]\n")
    (root / "not_a_dir").write_text("a file where a directory is expected\n")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "notes.txt").write_text("a directory of the user's, outside every run\n")
    rng = np.random.default_rng(0)
    np.savez(root / "data" / "img8.npz", x=rng.random((600, 8, 8), dtype=np.float32), y=rng.integers(0, 10, 600))
    for name, spec in {
        "conv65536": "{channels: 65536}",
        "conv1e6": "{channels: 1000000}",
        "kernel1e20": "{channels: 4, kernel: 99999999999999999999}",
        "kernel2e20": "{channels: 4, kernel: 1048575}",
    }.items():
        (root / f"{name}.yaml").write_text(f"layers:\n  - conv: {spec}\n")
    (root / "data" / "cifar_bomb").mkdir()  # a BINBYTES8 opcode declaring 2^60 bytes
    (root / "data" / "cifar_bomb" / "data_batch_1").write_bytes(b"\x80\x04\x8e" + (2**60).to_bytes(8, "little") + b"xx")
    (root / "data" / "cifar_fifo").mkdir()
    os.mkfifo(root / "data" / "cifar_fifo" / "data_batch_1")


def tiny(*extra: str, run: str = "r") -> list[str]:
    return ["--preset", "tiny.yaml", "--data", "data/small.txt", "--checkpoint_dir", "ck", "--run_name", run, *extra]


def trained(run: str, windows: int = 10) -> Callable[[Path], None]:
    """Set-up: a finished tiny run `run` with its checkpoint step_<windows>."""

    def setup(root: Path) -> None:
        if not (root / "ck" / run).exists():
            subprocess.run(
                [sys.executable, str(REPO / "main.py"), *tiny("--max_windows", str(windows), run=run)],
                cwd=root,
                env=child_env({}),
                capture_output=True,
                check=True,
            )

    return setup


def edited(run: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """Set-up: a trained run whose checkpoint's meta.json is edited by `edit`."""

    def setup(root: Path) -> None:
        trained(run)(root)
        meta_path = root / "ck" / run / "step_00000010" / "meta.json"
        meta = json.loads(meta_path.read_text())
        edit(meta)
        meta_path.write_text(json.dumps(meta))

    return setup


def zero_rng(run: str) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        import torch  # noqa: F401 (safetensors.torch needs it)
        from safetensors.torch import load_file, save_file

        trained(run)(root)
        step = root / "ck" / run / "step_00000010"
        tensors = load_file(str(step / "tensors.safetensors"))
        tensors["rng.cpu"] = tensors["rng.cpu"] * 0
        save_file(tensors, str(step / "tensors.safetensors"))
        meta = json.loads((step / "meta.json").read_text())
        data = (step / "tensors.safetensors").read_bytes()
        meta["tensors"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        (step / "meta.json").write_text(json.dumps(meta))

    return setup


def planted(run: str, name: str, target: str = "victim.txt") -> Callable[[Path], None]:
    """Set-up: a run directory holding a symlink `name` to the victim file (or another target of the sandbox)."""

    def setup(root: Path) -> None:
        (root / "ck" / run).mkdir(parents=True, exist_ok=True)
        os.symlink(root / target, root / "ck" / run / name)

    return setup


def fifo_in(run: str, name: str) -> Callable[[Path], None]:
    """Set-up: a trained run whose file `name` (relative to its directory) is replaced by a FIFO."""

    def setup(root: Path) -> None:
        trained(run)(root)
        (root / "ck" / run / name).unlink()
        os.mkfifo(root / "ck" / run / name)

    return setup


def poisoned(run: str, value: float) -> Callable[[Path], None]:
    """Set-up: a run with checkpoints at windows 5 and 10 whose last holds `value` in param.W_1, its sidecar's size and
    sha256 made to match (a corrupt file, not a truncated one)."""

    def setup(root: Path) -> None:
        import torch  # noqa: F401 (safetensors.torch needs it)
        from safetensors.torch import load_file, save_file

        if (root / "ck" / run).exists():
            return
        subprocess.run(
            [sys.executable, str(REPO / "main.py"), *tiny("--save_every_windows", "5", run=run)],
            cwd=root,
            env=child_env({}),
            capture_output=True,
            check=True,
        )
        step = root / "ck" / run / "step_00000010"
        tensors = load_file(str(step / "tensors.safetensors"))
        tensors["param.W_1"].view(-1)[0] = value
        save_file(tensors, str(step / "tensors.safetensors"))
        meta = json.loads((step / "meta.json").read_text())
        data = (step / "tensors.safetensors").read_bytes()
        meta["tensors"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        (step / "meta.json").write_text(json.dumps(meta))

    return setup


def no_lock(run: str) -> Callable[[Path], str]:
    return lambda root: "a .lock was left behind" if os.path.lexists(root / "ck" / run / ".lock") else ""


def foreign(root: Path) -> None:
    """A checkpoint copied into a directory holding another run's files."""
    trained("src")(root)
    d = root / "ck" / "busy"
    d.mkdir()
    for name, text in {
        "config.yaml": "seed: 5\n",
        "summary.json": "{}\n",
        "telemetry.jsonl": '{"window": 9}\n',
    }.items():
        (d / name).write_text(text)
    shutil.copytree(root / "ck" / "src" / "step_00000010", d / "step_00000010")


def hostile_checkpoint(root: Path) -> None:
    """A finished run whose checkpoint's config was edited to name a module in the working directory that leaves a
    file behind when imported: a file handed over is data, so nothing may import it without --trust_code."""
    trained("hc")(root)
    (root / "evil_mod.py").write_text(
        "from pathlib import Path\nPath(__file__).with_name('imported.txt').write_text('imported')\n\nclass Thing:\n"
        "    pass\n"
    )
    meta = root / "ck" / "hc" / "step_00000010" / "meta.json"
    saved = json.loads(meta.read_text())
    saved["config"]["rule"] = "evil_mod.Thing"
    meta.write_text(json.dumps(saved))


def not_imported(root: Path) -> str:
    return "the checkpoint's module was imported" if (root / "imported.txt").exists() else ""


def nested(root: Path) -> None:
    """A finished run with a directory of the user's in it named like a checkpoint (no sidecar: not the run's own).
    A second run inside it is refused (its pruning would delete that run), so none is made here."""
    trained("outer")(root)
    (root / "ck" / "outer" / "step_00000001").mkdir()
    (root / "ck" / "outer" / "step_00000001" / "notes.txt").write_text("the user's\n")


def odd_telemetry(root: Path) -> None:
    d = root / "ck" / "odd"
    d.mkdir(parents=True)
    rows = [
        {"window": "x", "train_loss": 1.0},
        {"window": 1, "train_loss": True},
        {"window": 2, "train_loss": 1e308},
        {"window": 3, "train_loss": [1]},
        {"window": None},
        {"window": 4, "lr": {"a": 1}},
    ]
    (d / "telemetry.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"window": 5, "train_loss": NaN}\n'
    )


def intact(*paths: str) -> Callable[[Path], str]:
    def check(root: Path) -> str:
        missing = [p for p in paths if not (root / p).exists()]
        return f"removed: {missing}" if missing else ""

    return check


def saved_at_signal(run: str) -> Callable[[Path], str]:
    def check(root: Path) -> str:
        summary = root / "ck" / run / "summary.json"
        if not summary.is_file() or not json.loads(summary.read_text()).get("interrupted"):
            return "no summary.json naming the signal"
        if "--resume latest" not in json.loads(summary.read_text()).get("resume_command", ""):
            return "no resume_command in summary.json"
        return "" if any((root / "ck" / run).glob("step_*")) else "no checkpoint saved"

    return check


def summary_written(run: str) -> Callable[[Path], str]:
    return lambda root: "" if (root / "ck" / run / "summary.json").is_file() else "no summary.json"


def cases() -> list[Case]:
    big = [
        ("batch_size", "1000000"),
        ("hidden_sizes", "1000000"),
        ("memory_capacity", "1000000000"),
        ("embed_dim", "10000000"),
        ("rotor_k", "1000000000"),
        ("coord_dim_n", "1000000"),
        ("free_steps", "100000000000"),
        ("nudge_steps", "1000000000"),
        ("max_epochs", "1e308"),
        ("max_windows", "1000000000000000000"),
        ("context_len", "1000000000"),
        ("warmup_steps", "1000000000"),
    ]
    out = [
        Case(
            f"--{k} {v}",
            ["--preset", "dev", "--max_windows", "3", f"--{k}", v, "--checkpoint_dir", "ck", "--run_name", "big"],
            {2},
            size=True,
        )
        for k, v in big
    ]
    out.append(
        Case(
            "--hidden_sizes 100000 100000",
            ["--preset", "dev", "--hidden_sizes", "100000", "100000", "--checkpoint_dir", "ck"],
            {2},
            size=True,
        )
    )
    for name, says in {
        "conv65536": "layers: the run would need about",  # 65536 x 8 x 8 units a row
        "conv1e6": "layers: the run would need about",
        "kernel1e20": "kernel must be an integer in 1..1048576",
        "kernel2e20": "layers: the run would need about",
    }.items():
        out.append(
            Case(
                f"conv layers on 8x8 images: {name}.yaml",
                ["--config", f"{name}.yaml", "--data", "data/img8.npz", "--checkpoint_dir", "ck", "--run_name", "big"],
                {2},
                says=says,
                size=True,
            )
        )
    for name in (
        "fifo.txt",
        "zeros.txt",
        "binary.txt",
        "lying.npz",
        "short.npz",
        "objects.npz",
        "bomb.npz",
        "loop.txt",
        "missing.txt",
    ):
        out.append(Case(f"--data data/{name}", tiny("--data", f"data/{name}", run="d"), {2}))
    out += [
        Case("--data /dev/zero", tiny("--data", "/dev/zero", run="d"), {2}),
        Case("--data /dev/null", tiny("--data", "/dev/null", run="d"), {2}),
        Case("--data data (a directory)", tiny("--data", "data", run="d"), {2}),
        Case("--data ''", tiny("--data", "", run="d"), {2}, says="data (from command line): empty"),
        Case(
            "--data: a CIFAR batch declaring 2^60 bytes",
            tiny("--data", "data/cifar_bomb", run="d"),
            {2},
            says="data/cifar_bomb/data_batch_1: cannot read as a CIFAR-10 python batch",
        ),
        Case(
            "--data: a CIFAR batch that is a FIFO",
            tiny("--data", "data/cifar_fifo", run="d"),
            {2},
            says="data/cifar_fifo/data_batch_1: cannot read as a CIFAR-10 python batch (is not a regular file",
        ),
        Case("--config fifo.yaml", ["--config", "fifo.yaml", "--checkpoint_dir", "ck"], {2}),
        Case("--config /dev/zero", ["--config", "/dev/zero", "--checkpoint_dir", "ck"], {2}),
        Case("--config dup.yaml (duplicate keys)", ["--config", "dup.yaml", "--checkpoint_dir", "ck"], {2}),
        Case("--config alias.yaml", ["--config", "alias.yaml", "--checkpoint_dir", "ck"], {2}),
        Case("--preset ''", ["--preset", "", "--checkpoint_dir", "ck"], {2}),
        Case("--resume ''", ["--resume", "", "--checkpoint_dir", "ck"], {2}),
        Case("--config ''", ["--config", "", "--checkpoint_dir", "ck"], {2}),
        Case("--run_name step_00000001", tiny(run="step_00000001"), {2}),
        Case("--run_name .lock", tiny(run=".lock"), {2}),
        Case("--run_name ../x", tiny(run="../x"), {2}),
        Case("--checkpoint_dir ''", [*tiny(run="e"), "--checkpoint_dir", ""], {2}),
        Case("--checkpoint_dir (a file)", [*tiny(run="e"), "--checkpoint_dir", "not_a_dir"], {2}),
        Case("planted .lock symlink", tiny(run="l1"), {2}, setup=planted("l1", ".lock")),
        Case("planted .summary.json.tmp symlink", tiny(run="l2"), {0}, setup=planted("l2", ".summary.json.tmp")),
        Case("planted .config.yaml.tmp symlink", tiny(run="l3"), {0}, setup=planted("l3", ".config.yaml.tmp")),
        Case("planted telemetry.jsonl symlink", tiny(run="l4"), {2}, setup=planted("l4", "telemetry.jsonl")),
        Case(
            "planted .tmp-step symlink",
            tiny("--save_every_windows", "5", run="l5"),
            {0},
            setup=planted("l5", f".tmp-step_00000005-{os.getpid()}"),
        ),
        Case(
            "resume into a directory of another run",
            ["--resume", "ck/busy/step_00000010", "--max_windows", "12"],
            {2},
            setup=foreign,
        ),
        Case(
            "pruning beside a nested run",
            [
                "--resume",
                "latest",
                "--checkpoint_dir",
                "ck",
                "--run_name",
                "outer",
                "--max_windows",
                "20",
                "--save_every_windows",
                "2",
                "--keep_last",
                "1",
            ],
            {0},
            setup=nested,
            check=intact("ck/outer/step_00000001/notes.txt"),
        ),
        Case(
            "evaluate a checkpoint naming code",
            ["evaluate", "--checkpoint", "ck/hc/step_00000010"],
            {2},
            setup=hostile_checkpoint,
            check=not_imported,
            says="--trust_code",
        ),
        Case(
            "resume a checkpoint naming code",
            ["--resume", "ck/hc/step_00000010", "--max_windows", "12"],
            {2},
            setup=hostile_checkpoint,
            check=not_imported,
            says="--trust_code",
        ),
        Case(
            "a run inside another run",
            tiny("--max_windows", "5", "--checkpoint_dir", "ck/outer", run="inner"),
            {2},
            setup=trained("outer"),
        ),
        Case(
            "a run inside another run's checkpoint",
            tiny("--max_windows", "5", "--checkpoint_dir", "ck/outer/step_00000010", run="inner"),
            {2},
            setup=trained("outer"),
        ),
        Case(
            "a moved data file",
            ["--resume", "ck/mv/step_00000010", "--max_windows", "12", "--data", "data/moved.txt"],
            {0},
            setup=lambda root: (
                trained("mv")(root),
                shutil.copy(root / "data" / "small.txt", root / "data" / "moved.txt"),
            ),
        ),
    ]
    bad_meta = {
        "counters.window 'x'": lambda m: m["counters"].update(window="x"),
        "counters.window 1e300": lambda m: m["counters"].update(window=10**300),
        "counters.window -5": lambda m: m["counters"].update(window=-5),
        "counters.global_batch 'x'": lambda m: m["counters"].update(global_batch="x"),
        "counters.wall_seconds inf": lambda m: m["counters"].update(wall_seconds=1e400),
        "history of strings": lambda m: m.update(history=["a", 1]),
        "versions 'x'": lambda m: m.update(versions="x"),
        "config.hidden_sizes 'x'": lambda m: m["config"].update(hidden_sizes="x"),
        "data.vocab 5": lambda m: m["data"].update(vocab=5),
    }
    for i, (name, edit) in enumerate(bad_meta.items()):
        out.append(
            Case(
                f"meta.json {name}",
                ["--resume", "latest", "--checkpoint_dir", "ck", "--run_name", f"m{i}", "--max_windows", "12"],
                {2},
                setup=edited(f"m{i}", edit),
            )
        )
    out += [
        Case(
            "rng.cpu of zeros",
            ["--resume", "latest", "--checkpoint_dir", "ck", "--run_name", "rng", "--max_windows", "12"],
            {2},
            setup=zero_rng("rng"),
        ),
        Case("RANK=x", tiny(run="t"), {2}, env={"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}),
        Case(
            "torchrun variables without MASTER_ADDR",
            tiny(run="t"),
            {2},
            env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"},
        ),
        Case(  # no row holds a number a plot can take: refused, naming the file, rather than empty plots written
            "plot on odd telemetry", ["plot", "ck/odd"], {2}, setup=odd_telemetry, says="no metric to plot"
        ),
        Case(
            "sample at temperature 1e-320",
            ["sample", "--checkpoint", "ck/smp/step_00000010", "--temperature", "1e-320", "--length", "5"],
            {0},
            setup=trained("smp"),
        ),
        Case(
            "evaluate a checkpoint whose data moved away",
            ["evaluate", "--checkpoint", "ck/gone/step_00000010"],
            {2},
            setup=lambda root: (
                trained("gone")(root),
                (root / "ck" / "gone" / "step_00000010" / "meta.json").write_text(
                    (root / "ck" / "gone" / "step_00000010" / "meta.json")
                    .read_text()
                    .replace("data/small.txt", "data/nowhere.txt")
                ),
            ),
        ),
        Case(
            "SIGHUP during a run",
            tiny("--max_windows", "1000000000", run="hup"),
            {128 + signal.SIGHUP},
            drive="sighup",
            check=saved_at_signal("hup"),
            saves="hup",
        ),
        Case(
            "SIGQUIT during a run",
            tiny("--max_windows", "1000000000", run="quit"),
            {128 + signal.SIGQUIT},
            drive="sigquit",
            check=saved_at_signal("quit"),
            saves="quit",
        ),
        *(
            Case(
                f"{sig} during a run (a scheduler's warning of preemption)",
                tiny("--max_windows", "1000000000", run=sig.lower()),
                {128 + getattr(signal, sig)},
                drive=sig.lower(),
                check=saved_at_signal(sig.lower()),
                saves=sig.lower(),
            )
            for sig in ("SIGUSR1", "SIGUSR2")
        ),
        Case(
            "stdout closed (| head)",
            tiny("--max_windows", "20", run="pipe"),
            {0},
            drive="closed_stdout",
            check=summary_written("pipe"),
            saves="pipe",
        ),
        Case("stderr on /dev/full", tiny("--max_windows", "20", run="full"), {0}, drive="stderr_full", saves="full"),
        Case(
            "stdout and stderr closed from the start (>&- 2>&-)",
            tiny("--max_windows", "20", run="closed"),
            {0},
            drive="closed_streams",
            saves="closed",
        ),
        Case(
            "stdout and stderr on one pipe whose reader leaves (2>&1 | head -1)",
            tiny("--max_windows", "300", "--save_every_windows", "100", run="head"),
            {0},
            drive="pipe_closed",
            check=lambda root: "" if (root / "ck" / "head" / "step_00000300").is_dir() else "no final checkpoint",
            saves="head",
        ),
        Case(
            "a run directory that is a symlink to a directory outside",
            tiny(run="sl"),
            {2},
            setup=lambda root: os.symlink(root / "elsewhere", root / "ck" / "sl"),
            says="run directory ck/sl is a symbolic link",
        ),
        Case(
            "planted config.yaml symlink",
            tiny(run="l6"),
            {2},
            setup=planted("l6", "config.yaml"),
            says="config.yaml is a symbolic link",
        ),
        Case(
            "planted step_00000005 symlink to a directory outside",
            tiny("--save_every_windows", "5", run="l7"),
            {2},
            setup=planted("l7", "step_00000005", "elsewhere"),
            says="step_00000005 is a symbolic link",
        ),
        Case(
            "resume with a FIFO as telemetry.jsonl",
            ["--resume", "latest", "--checkpoint_dir", "ck", "--run_name", "ft", "--max_windows", "12"],
            {2},
            setup=fifo_in("ft", "telemetry.jsonl"),
            says="telemetry.jsonl is a FIFO",
        ),
        Case(
            "resume with a FIFO as .run",
            ["--resume", "latest", "--checkpoint_dir", "ck", "--run_name", "fr", "--max_windows", "12"],
            {2},
            setup=fifo_in("fr", ".run"),
            says=".run is a FIFO",
        ),
        Case(
            "plot a run whose telemetry.jsonl is a FIFO",
            ["plot", "ck/fp"],
            {2},
            setup=fifo_in("fp", "telemetry.jsonl"),
            says="ck/fp/telemetry.jsonl: is not a regular file (a FIFO)",
        ),
        Case(
            "evaluate a checkpoint whose meta.json is a FIFO",
            ["evaluate", "--checkpoint", "ck/fm/step_00000010"],
            {2},
            setup=fifo_in("fm", "step_00000010/meta.json"),
            says="meta.json: is not a regular file (a FIFO)",
        ),
        Case(
            "evaluate --checkpoint on a directory that does not exist",
            ["evaluate", "--checkpoint", "ck/nowhere/step_00000010"],
            {2},
            says="no such directory",
        ),
        Case(
            "resume latest: NaN in the newest checkpoint's parameters",
            ["--resume", "latest", "--checkpoint_dir", "ck", "--run_name", "nan", "--max_windows", "12"],
            {2},
            setup=poisoned("nan", float("nan")),
            says="last checkpoint with finite tensors is ck/nan/step_00000005",
        ),
        Case(
            "evaluate: NaN parameters",
            ["evaluate", "--checkpoint", "ck/nan/step_00000010"],
            {2},
            setup=poisoned("nan", float("nan")),
            says="tensor 'param.W_1' holds 1 non-finite value(s)",
        ),
        Case(
            "sample: infinite parameters",
            ["sample", "--checkpoint", "ck/inf/step_00000010", "--length", "5"],
            {2},
            setup=poisoned("inf", float("inf")),
            says="tensor 'param.W_1' holds 1 non-finite value(s)",
        ),
        Case(
            "a refused start leaves no .lock (a fresh run over a copied run's files)",
            tiny(run="lk"),
            {2},
            setup=lambda root: (trained("lk")(root), (root / "ck" / "lk" / ".lock").unlink()),
            check=no_lock("lk"),
        ),
        Case(
            "diverging: momentum 0.99 at lr 1",
            [
                "--preset",
                "dev",
                "--max_windows",
                "2000",
                "--log_every_windows",
                "10",
                "--eta_update",
                "1.0",
                "--update_rule",
                "momentum",
                "--momentum",
                "0.99",
                "--checkpoint_dir",
                "ck",
                "--run_name",
                "div",
                "--save_every_windows",
                "100",
            ],
            {3},
            check=lambda root: (
                ""
                if json.loads((root / "ck" / "div" / "summary.json").read_text())["diverged"]
                else "diverged is not true"
            ),
        ),
    ]
    return out


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return {**env, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(REPO), **extra}


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))
    # As from a terminal: a benchmark started under nohup or as a background job ignores these, and its children
    # would inherit that (trainer2 leaves an ignored signal ignored), so the signal cases would never stop.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def outside_runs(root: Path) -> dict[str, str]:
    """sha256 of every file of the sandbox that is not inside a run directory (ck/<run>/...) nor a FIFO (the token
    cache lives under $XDG_CACHE_HOME, outside the sandbox: nothing may appear beside a data file)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] == "ck" and len(rel.parts) > 2:
            continue
        if p.is_symlink() or not p.is_file():
            continue
        out[str(rel)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def json_files(root: Path) -> dict[Path, str]:
    """sha256 of every .json and .jsonl file under ck/ (not links)."""
    found = list(root.glob("ck/**/*.json")) + list(root.glob("ck/**/*.jsonl"))
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in found if p.is_file() and not p.is_symlink()}


def nonstandard_json(root: Path, paths: list[Path]) -> list[str]:
    """Those of `paths` that hold NaN or Infinity (which strict readers refuse)."""
    bad = []
    for p in paths:
        text = p.read_text(errors="replace")
        for line in text.splitlines() if p.suffix == ".jsonl" else [text]:
            try:
                json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
            except ValueError:
                bad.append(str(p.relative_to(root)))
                break
    return bad


def wait_child(proc: subprocess.Popen, timeout: float) -> tuple[int, bool, int]:
    """(exit status, hung, peak resident KiB) of a child; os.wait4 reports the child's own resource usage."""
    end = time.monotonic() + timeout
    hung = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > end:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            hung = True
            break
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, hung, usage.ru_maxrss


def start_child(case: Case, root: Path, err) -> subprocess.Popen:
    """The case's process, its stdout and stderr as its `drive` says (stderr to `err` unless it is the fault)."""
    env = child_env(case.env)
    cmd = [sys.executable, str(REPO / "main.py"), *case.argv]
    if case.drive in ("stderr_full", "closed_streams", "pipe_closed"):
        env.pop("TQDM_DISABLE")  # the progress bar writes to stderr
    if case.drive == "stderr_full":
        with open("/dev/full", "w") as full:
            return subprocess.Popen(cmd, cwd=root, env=env, stdout=err, stderr=full, preexec_fn=limit_memory)
    if case.drive == "closed_streams":

        def closed() -> None:
            limit_memory()
            os.close(1)
            os.close(2)

        return subprocess.Popen(cmd, cwd=root, env=env, preexec_fn=closed)
    if case.drive == "pipe_closed":
        proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=limit_memory
        )
        proc.stdout.readline()
        proc.stdout.close()
        return proc
    stdout = subprocess.PIPE if case.drive == "closed_stdout" else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=stdout, stderr=err, preexec_fn=limit_memory)
    if case.drive == "closed_stdout":
        proc.stdout.close()
    return proc


def run_case(case: Case, root: Path, timeout: float) -> dict:
    case.setup(root)
    before, json_before = outside_runs(root), json_files(root)
    err_path = root / "stderr.txt"
    with open(err_path, "w") as err:
        began = time.monotonic()
        proc = start_child(case, root, err)
        if case.drive.startswith("sig"):
            run = root / "ck" / case.argv[case.argv.index("--run_name") + 1] / "telemetry.jsonl"
            end = time.monotonic() + timeout
            while time.monotonic() < end and proc.poll() is None and not (run.is_file() and run.stat().st_size):
                time.sleep(0.05)
            proc.send_signal(getattr(signal, case.drive.upper()))
        rc, hung, peak_kib = wait_child(proc, timeout)
        seconds = time.monotonic() - began
    text = err_path.read_text(errors="replace")
    err_path.unlink()
    after, json_after = outside_runs(root), json_files(root)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    written = [p for p, h in json_after.items() if json_before.get(p) != h]  # by the run, not planted by a set-up
    last = (text.strip().splitlines() or [""])[-1][:300]
    problems = [] if hung else [case.check(root)]
    if case.says and case.says not in last:
        problems.append(f"the message does not say {case.says!r}")
    if case.size and (seconds > REFUSAL_SECONDS or peak_kib > REFUSAL_MIB * 1024):
        problems.append(f"refused after {seconds:.0f} s at {peak_kib // 1024} MiB")
    run = root / "ck" / case.saves
    lost = bool(case.saves) and not (any(run.glob("step_*")) and (run / "summary.json").is_file())
    return {
        "case": case.name,
        "exit": rc,
        "expected": sorted(case.expect),
        "hang": hung,
        "traceback": "Traceback" in text,
        "changed_outside_runs": changed,
        "unexpected_exit": rc not in case.expect and not hung,
        "problem": "; ".join(p for p in problems if p),
        "lost_checkpoint": lost,
        "nonstandard_json": nonstandard_json(root, written),
        "peak_mib": peak_kib // 1024,
        "message": last[:160],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=90.0, help="Seconds before a case counts as a hang.")
    p.add_argument("--only", default="", help="Run only the cases whose name contains this.")
    p.add_argument(
        "--out", type=Path, default=None, help="Sandbox directory (default: a temporary one, removed after)."
    )
    args = p.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="trainer2-inputs-"))
    os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="trainer2-cache-"))  # not the real home's cache
    root.mkdir(parents=True, exist_ok=True)
    sandbox(root)
    results = []
    for case in cases():
        if args.only not in case.name:
            continue
        r = run_case(case, root, args.timeout)
        results.append(r)
        flags = [k for k in ("hang", "traceback", "unexpected_exit") if r[k]] + (
            ["changed"] if r["changed_outside_runs"] else []
        )
        flags += [r["problem"]] if r["problem"] else []
        flags += [f"non-standard JSON in {r['nonstandard_json']}"] if r["nonstandard_json"] else []
        flags += ["lost checkpoint"] if r["lost_checkpoint"] else []
        print(
            f"{'FAIL' if flags else 'ok  '} {r['case']}: exit {r['exit']}, {r['peak_mib']} MiB {' '.join(flags)} | "
            f"{r['message']}",
            flush=True,
        )
    bad_json = [p for r in results for p in r["nonstandard_json"]]
    counts = {
        "cases": len(results),
        "tracebacks": sum(r["traceback"] for r in results),
        "hangs": sum(r["hang"] for r in results),
        "files_changed_outside_runs": sum(len(r["changed_outside_runs"]) for r in results),
        "unexpected_exits": sum(r["unexpected_exit"] for r in results),
        "failed_checks": sum(bool(r["problem"]) for r in results),
        "lost_checkpoints": sum(r["lost_checkpoint"] for r in results),
        "nonstandard_json_files": len(bad_json),
    }
    print(json.dumps({**counts, "nonstandard_json": bad_json}, indent=1))
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(v == 0 for k, v in counts.items() if k != "cases") else 1


if __name__ == "__main__":
    sys.exit(main())

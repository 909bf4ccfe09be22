"""Data-parallel training under torchrun (gloo, CPU): real processes, compared with one process.

N processes at batch b must follow one process at batch N x b up to the order of floating-point sums;
a checkpoint saved on 2 processes resumes on 1; a dead or hung rank ends the job with a message.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer2.cli import main
from trainer2.learning.params import ParamTable
from trainer2.learning.step import GradReducer
from trainer2.running.distributed import Distributed, DistributedError, init_distributed, rank_label
from trainer2.train_config import ConfigError, TrainConfig

ROOT = Path(__file__).resolve().parent.parent
WINDOWS = 20
# Tiny and fast: most of each run is starting Python and torch. Heavy-ball momentum, not Adam: Adam's first
# steps are sign-like, so it turns the rounding noise of a near-zero gradient (the rotor angles start at 0)
# into steps of size lr, and per-tensor comparisons of two equally valid runs would measure that noise.
TINY = dict(
    hidden_sizes=[16],
    coord_dim_n=4,
    rotor_k=3,
    context_len=3,
    embed_dim=3,
    free_steps=4,
    nudge_steps=2,
    update_rule="momentum",
    max_windows=WINDOWS,
    log_every_windows=5,
    eval_every_windows=0,
    device="cpu",
)
TOL = {"float32": 1e-5, "float64": 1e-10}
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds a rank's process through /proc")


def argv(**kw) -> list[str]:
    out = []
    for k, v in kw.items():
        out += [f"--{k}", *(str(x) for x in (v if isinstance(v, list) else [v]))]
    return out


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def launch(nproc: int, args: list[str], **popen) -> subprocess.Popen:
    """`torchrun --nproc_per_node N --standalone main.py ARGS` (--standalone: a free port of its own)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--standalone",
        "main.py",
        *args,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def torchrun(nproc: int, args: list[str]) -> str:
    proc = launch(nproc, args, env=env())
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    return out


def single(args: list[str]) -> str:
    proc = subprocess.run(
        [sys.executable, "main.py", *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def params(step_dir: Path) -> dict[str, torch.Tensor]:
    return {
        k: v.double() for k, v in load_file(str(step_dir / "tensors.safetensors")).items() if k.startswith("param.")
    }


def assert_close_params(a: Path, b: Path, tol: float) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    rel = {k: float((pa[k] - pb[k]).norm() / pb[k].norm().clamp(min=1e-30)) for k in pa}
    assert max(rel.values()) <= tol, f"relative differences above {tol}: {rel}"


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module", params=["float32", "float64"])
def pair(request, tmp_path_factory) -> tuple[Path, Path, str, str]:
    """(2-process run at batch 32, 1-process run at batch 64, dtype, torchrun's output); both save at windows 10 and
    20."""
    ck, data = tmp_path_factory.mktemp("ck"), tmp_path_factory.mktemp("data") / "small.txt"
    words = ["the cat sat on the mat. ", "a dog ran in the fog. ", "we see the sea. "]
    data.write_text("".join(words[i % 3] for i in range(300)), encoding="utf-8")
    common = {**TINY, "data": data, "checkpoint_dir": ck, "dtype": request.param, "save_every_windows": 10}
    out = torchrun(2, argv(**common, batch_size=32, run_name="two"))
    single(argv(**common, batch_size=64, run_name="one"))
    return ck / "two", ck / "one", request.param, out


def test_two_processes_at_32_follow_one_process_at_64(pair):
    two, one, dtype, out = pair
    moved = params(two / "step_00000010")["param.W_1"] - params(two / "step_00000020")["param.W_1"]
    assert moved.norm() > 1e-3 * params(two / "step_00000020")["param.W_1"].norm()  # training moved them
    assert_close_params(two / "step_00000020", one / "step_00000020", TOL[dtype])
    assert summary(two)["heldout_loss"] == pytest.approx(summary(one)["heldout_loss"], rel=TOL[dtype])
    assert summary(two)["examples_seen"] == summary(one)["examples_seen"] == 64 * WINDOWS
    # The logged training metrics are every rank's, not rank 0's half of the batch.
    rows2, rows1 = ([json.loads(x) for x in (d / "telemetry.jsonl").read_text().splitlines()] for d in (two, one))
    assert [r["window"] for r in rows2] == [r["window"] for r in rows1] == [5, 10, 15, 20]
    for r2, r1 in zip(rows2, rows1):
        assert r2["examples"] == r1["examples"]
        for k in ("train_loss", "train_acc", "lior_mean", "update_norm_energy"):
            assert r2[k] == pytest.approx(r1[k], rel=1e-4), k
    # Rank 0 alone prints and writes.
    assert out.count("config:\n") == 1 and out.count("done:") == 1 and out.count("checkpoint:") == 2


def test_saved_on_two_processes_resumes_on_one(pair, capsys):
    two, _, dtype, _ = pair
    ck = two.parent
    meta = json.loads((two / "step_00000010" / "meta.json").read_text())
    assert meta["counters"]["global_batch"] == 64 and meta["counters"]["world_size"] == 2
    # The per-process batch must change with the world size (the global batch is what is fixed) ...
    assert main(["--resume", str(two / "step_00000010"), "--run_name", "bad", "--checkpoint_dir", str(ck)]) == 2
    err = capsys.readouterr().err
    assert "global batch of 64 (batch_size 32 x 2 process(es)); this run's is 32 (batch_size 32 x 1)" in err
    assert "pass --batch_size 64" in err and not (ck / "bad").exists()
    # ... and then the run continues as the 2-process run did.
    single(
        [
            "--resume",
            str(two / "step_00000010"),
            "--run_name",
            "resumed",
            "--batch_size",
            "64",
            "--checkpoint_dir",
            str(ck),
        ]
    )
    assert_close_params(ck / "resumed" / "step_00000020", two / "step_00000020", TOL[dtype])
    assert summary(ck / "resumed")["heldout_loss"] == pytest.approx(summary(two)["heldout_loss"], rel=TOL[dtype])


def rank_pid(marker: str, rank: int, deadline: float) -> int:
    """The pid of the worker of rank `rank` of the job whose environment carries `marker`."""
    while time.monotonic() < deadline:
        for p in Path("/proc").iterdir():
            try:
                environ = (p / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            if marker.encode() in environ and f"RANK={rank}".encode() in environ:
                return int(p.name)
        time.sleep(0.05)
    raise AssertionError(f"no worker of rank {rank} found")


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def start_long_run(tmp_path: Path, small_text: Path, timeout_s: float) -> tuple[subprocess.Popen, str, Path]:
    """A 2-process run that would go on for hours, once its rank 0 has logged twice."""
    marker = f"TRAINER2_TEST_JOB={uuid.uuid4().hex}"
    common = {
        **TINY,
        "data": small_text,
        "checkpoint_dir": tmp_path,
        "max_windows": 10**7,
        "dist_timeout_seconds": timeout_s,
    }
    proc = launch(2, argv(**common, batch_size=8, run_name="long"), env=env(**dict([marker.split("=")])))
    telemetry, deadline = tmp_path / "long" / "telemetry.jsonl", time.monotonic() + 120
    while not (telemetry.exists() and telemetry.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "the run logged nothing"
        time.sleep(0.05)
    return proc, marker, telemetry


@linux_only
def test_a_killed_rank_ends_the_job_naming_it(tmp_path, small_text):
    timeout_s = 30.0
    proc, marker, _ = start_long_run(tmp_path, small_text, timeout_s)
    try:
        os.kill(rank_pid(marker, 1, time.monotonic() + 30), signal.SIGKILL)
        t0 = time.monotonic()
        # The agent ends the job when it sees the dead rank, rank 0 at the latest after its collective timeout; a
        # loaded machine (both cores busy) can add tens of seconds to the teardown, so the bound has headroom: what
        # this checks is that no rank is left waiting for ever.
        out, _ = proc.communicate(timeout=3 * timeout_s)  # raises if any rank were left waiting
        assert time.monotonic() - t0 < 3 * timeout_s
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9", out), out[-3000:]


@linux_only
def test_a_hung_rank_times_out_with_a_message(tmp_path, small_text):
    timeout_s = 5.0
    proc, marker, _ = start_long_run(tmp_path, small_text, timeout_s)
    hung, rank0 = (rank_pid(marker, r, time.monotonic() + 30) for r in (1, 0))
    # If rank 0 never gave up, reading its output would block for ever: end the whole job after a while.
    watchdog = threading.Timer(120, lambda: [kill(p) for p in (rank0, hung, proc.pid)])
    watchdog.start()
    try:
        os.kill(hung, signal.SIGSTOP)
        lines, t0 = [], time.monotonic()
        for line in proc.stdout:  # rank 0 gives up after the timeout instead of waiting for ever
            lines.append(line)
            if "trainer2: error" in line:
                break
        waited = time.monotonic() - t0
        # the gradient all-reduce, or the metric exchange when rank 1 stopped at a log interval
        assert re.search(r"trainer2: error: rank 0: the .* failed \(.*Timed out", lines[-1]), "".join(lines)[-3000:]
        assert "5 s timeout" in lines[-1] and waited < timeout_s + 60
    finally:
        watchdog.cancel()
        kill(hung)  # torchrun would wait 30 s for a stopped process to take its SIGTERM
        proc.communicate(timeout=120)
    assert proc.returncode != 0


# --- the parts, in one process or two spawned ones ---


def test_environment_is_read_and_checked():
    assert Distributed.from_env({}) == Distributed()
    assert not Distributed().launched and Distributed().is_main
    d = Distributed.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 30.0)
    assert (d.rank, d.world_size, d.local_rank, d.launched, d.is_main) == (1, 2, 1, True, False)
    for bad in (
        {"RANK": "0"},
        {"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
        {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
    ):
        with pytest.raises(ConfigError, match="environment"):
            Distributed.from_env(bad)
    assert rank_label({"RANK": "3"}) == " (rank 3)" and rank_label({}) == ""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only: no GPU is needed
    assert d.place(cuda, "auto") == torch.device("cuda", 1) and d.place(cpu, "cpu") == cpu
    assert Distributed().place(cuda, "cuda") == cuda
    assert Distributed(0, 1, 0, True).place(torch.device("cuda:1"), "cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match="names one GPU"):
        d.place(torch.device("cuda:0"), "cuda:0")
    assert init_distributed(TrainConfig(), env={}) == Distributed()  # a plain `python main.py`: no process group
    assert not torch.distributed.is_initialized()


def test_the_memory_bank_is_refused_on_several_processes():
    from trainer2.running.trainer import Trainer

    with pytest.raises(ConfigError, match="memory_capacity"):
        Trainer(TrainConfig(memory_capacity=64, batch_size=8), log=lambda m: None, dist=Distributed(1, 2, 1, True, 5.0))


def _worker(rank: int, world: int, init: str, results: str) -> None:
    """Two ranks: a NaN on rank 1 only must make both ranks drop the update; then a parameter that differs
    on rank 1 must stop both, naming rank 1; metric sums add up."""
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    d = Distributed(rank, world, rank, True, 30.0)
    from tiny import tiny_config, tiny_machine

    from trainer2.learning.update import Updater, flat_update

    cfg = tiny_config()
    m = tiny_machine(cfg)
    table = ParamTable.build(m, cfg.eta_scales, cfg.weight_decay)
    up = Updater(m, cfg, table)
    reducer = GradReducer(up.grad, d)
    grads = {n: torch.full_like(t, float(rank + 1)) for n, t in zip(table.names, table.tensors)}
    up.gather(grads)
    reducer()
    mean_ok = all(torch.equal(g, torch.full_like(g, 1.5)) for g in table.views(up.grad).values())
    views_are_flat = up.grad.data_ptr() == reducer.flat.data_ptr()
    if rank == 1:
        grads["W_1"][0, 0] = float("nan")
    up.gather(grads)
    reducer()
    before = [t.clone() for t in table.tensors]
    flat_update(table.flat, up.grad, up.state, table.mult, table.decay_flat, cfg, up.step)
    dropped = float(up.state.dropped) == 1.0 and all(torch.equal(a, b) for a, b in zip(before, table.tensors))
    sums = torch.tensor([1.0, 10.0 * (rank + 1)], dtype=torch.float64)
    d.check_in(sums, table.tensors, everywhere=False)
    sums_ok = sums.tolist() == ([2.0, 30.0] if rank == 0 else [0.0, 0.0])
    if rank == 1:
        table.tensors[0].add_(1e-12)
    try:
        d.check_in(sums, table.tensors, everywhere=True)
        mismatch = "not raised"
    except DistributedError as e:
        mismatch = str(e)
    torch.distributed.destroy_process_group()
    Path(results, f"{rank}.json").write_text(
        json.dumps(
            dict(mean_ok=mean_ok, views_are_flat=views_are_flat, dropped=dropped, sums_ok=sums_ok, mismatch=mismatch)
        )
    )


def test_one_all_reduce_averages_drops_together_and_checksums_catch_divergence(tmp_path):
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(2, init, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"{rank}.json").read_text())
        assert r["mean_ok"] and r["views_are_flat"], r
        assert r["dropped"], f"rank {rank} applied an update although rank 1's gradient was NaN"
        assert r["sums_ok"], r
        assert f"rank {rank}: parameters differ between ranks: rank(s) [1] disagree with rank 0" in r["mismatch"], r


@linux_only
@pytest.mark.parametrize("to, sig", [("torchrun", "SIGTERM"), ("rank 1", "SIGTERM"), ("rank 1", "SIGUSR1")])
def test_sigterm_stops_every_rank_at_the_same_window_and_rank_0_saves(tmp_path, small_text, to, sig):
    proc, marker, telemetry = start_long_run(tmp_path, small_text, 60.0)
    # torchrun passes a scheduler's SIGTERM on to every worker; a signal to one rank alone must stop them all too
    # (SLURM's --signal=USR1@90 signals every process of a job step itself)
    os.kill(proc.pid if to == "torchrun" else rank_pid(marker, 1, time.monotonic() + 30), getattr(signal, sig))
    out, _ = proc.communicate(timeout=120)
    run = tmp_path / "long"
    saved = sorted(p.name for p in run.glob("step_*"))
    assert len(saved) == 1, out[-3000:]
    stopped = int(saved[0].removeprefix("step_"))
    assert stopped % TINY["log_every_windows"] == 0  # the ranks met there and agreed to stop
    assert summary(run)["interrupted"] == sig and summary(run)["windows"] == stopped
    assert json.loads(telemetry.read_text().splitlines()[-1])["window"] == stopped
    assert f"trainer2: stopped by {sig} after window {stopped}; resume with: torchrun [the same options] main.py" in out
    assert str(ROOT / "trainer2") not in out, out[-3000:]  # no worker traceback (torchrun prints its own report)
    assert len(load_file(str(run / saved[0] / "tensors.safetensors"))) > 0


def test_an_unnamed_run_on_two_processes_gets_one_fresh_name(tmp_path, small_text):
    torchrun(2, argv(**{**TINY, "max_windows": 5}, data=small_text, checkpoint_dir=tmp_path / "ck", batch_size=8))
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["run-1"]  # one run directory: rank 0 alone makes it
    assert summary(tmp_path / "ck" / "run-1")["windows"] == 5

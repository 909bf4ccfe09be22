"""EP / exact over many seeds: one ratio scatters by a few percent (each pair of runs is its own trajectory), so a
claim about 1 % needs the mean of many pairs and its standard error.

    python -m benchmarks.quality_seeds --seeds 0-15 --jobs 2 --out runs/quality_conv -- \\
        --preset conv --data mnist5000.npz --heldout_fraction 0.2 --examples 64000 --cpu_threads 1 --skip ff

Runs `benchmarks.quality` once per seed (`--jobs` at a time, each its own process, log, JSON and checkpoint folder
under `--out`; a seed whose JSON is there already is not run again, so a stopped sweep resumes, and the folder keeps
the flags it was started with, so a resumed sweep runs the same ones), then prints each seed's ratio and cosine, and
the ratios' mean, standard deviation, standard error and mean +- 2 standard errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import quality
from trainer2.train_config import ConfigError

PER_SEED = ("--seed", "--json", "--checkpoint_dir")  # quality's flags this sets for each seed


MAX_SEEDS = 10_000  # a sweep is tens of runs; far more is a typo, and its list alone could exhaust the memory


def parse_seeds(text: str) -> list[int]:
    """'0-3,7' -> [0, 1, 2, 3, 7]; each seed once, in the order given; at most MAX_SEEDS of them."""
    seeds: list[int] = []
    count = 0
    for part in text.split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise argparse.ArgumentTypeError(
                f"seeds are written like 0-15 or 0,3,5-7 (low-high, low <= high), got {text!r}"
            )
        count += int(hi or lo) - int(lo) + 1  # counted before the range is made
        if count > MAX_SEEDS:
            raise argparse.ArgumentTypeError(
                f"at most {MAX_SEEDS} seeds per sweep, got {text!r}; give a smaller range such as 0-15"
            )
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return list(dict.fromkeys(seeds))


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return int(text)


def run_seeds(seeds: list[int], jobs: int, out: Path, flags: list[str]) -> list[int]:
    """Runs benchmarks.quality for each seed without a JSON under `out`, `jobs` at a time; returns the failed seeds.
    Stopped (Ctrl-C, SIGTERM), it hands the runs a Ctrl-C and waits for them to end."""
    root = str(Path(__file__).resolve().parents[1])  # `benchmarks` importable from any working folder
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": path}
    todo = [s for s in seeds if not (out / f"quality-s{s}.json").exists()]
    running: dict[int, subprocess.Popen] = {}
    failed: list[int] = []
    try:
        while todo or running:
            while todo and len(running) < jobs:
                s = todo.pop(0)
                cmd = [sys.executable, "-m", "benchmarks.quality", *flags, "--seed", str(s)]
                cmd += ["--json", str(out / f"quality-s{s}.json"), "--checkpoint_dir", str(out / f"checkpoints-s{s}")]
                with open(out / f"quality-s{s}.log", "w") as log:
                    running[s] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                print(f"seed {s}: started", flush=True)
            time.sleep(1.0)
            for s, proc in list(running.items()):
                if proc.poll() is not None:
                    del running[s]
                    status = (
                        "done" if proc.returncode == 0 else f"failed (exit {proc.returncode}; {out}/quality-s{s}.log)"
                    )
                    print(f"seed {s}: {status}", flush=True)
                    failed += [s] if proc.returncode else []
    finally:
        for proc in running.values():  # stopped: each run ends with a line in its log, and no JSON
            proc.send_signal(signal.SIGINT)
        for proc in running.values():
            proc.wait()
    return failed


def stop(signum: int, frame: object) -> None:
    """SIGTERM's handler: stop the sweep as Ctrl-C does."""
    raise KeyboardInterrupt


def check_flags(out: Path, flags: list[str]) -> None:
    """The folder's sweep is one set of flags: the first call writes them to sweep.json, a later one must match."""
    kept = out / "sweep.json"
    if not kept.exists():
        kept.write_text(json.dumps({"flags": flags}, indent=2) + "\n")
    elif (before := json.loads(kept.read_text())["flags"]) != flags:
        raise ConfigError(f"{out} holds a sweep with the flags {' '.join(before)}; use another --out for new flags")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seeds", type=parse_seeds, required=True, help="seeds, as 0-15 or 0,3,5-7")
    p.add_argument("--jobs", type=positive, default=1, help="runs side by side (each takes --cpu_threads threads)")
    p.add_argument("--out", type=Path, required=True, help="folder of each seed's log, JSON and checkpoints")
    p.add_argument("--report_only", action="store_true", help="run nothing; summarize the JSONs there")
    p.add_argument("quality_flags", nargs=argparse.REMAINDER, help="after --: benchmarks.quality's options and flags")
    args = p.parse_args(argv)
    flags = args.quality_flags[1:] if args.quality_flags[:1] == ["--"] else args.quality_flags
    if any(f.split("=")[0] in PER_SEED for f in flags):
        p.error(f"{', '.join(PER_SEED)} are set per seed; leave them out of the quality flags")
    if args.out.exists() and not args.out.is_dir():
        print(
            f"quality_seeds: error: --out {args.out} is a file; --out must be a folder (a new one, or a sweep's to "
            "resume)",
            file=sys.stderr,
        )
        return 2
    failed: list[int] = []
    if not args.report_only:
        try:
            options, _ = quality.parse(flags)  # a bad flag is refused here, once, not in every seed's log
            if "exact" in options.skip:
                raise ConfigError("--skip exact leaves no EP / exact ratio to summarize")
            args.out.mkdir(parents=True, exist_ok=True)
            check_flags(args.out, flags)
        except ConfigError as e:
            print(f"quality_seeds: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # --out under a file, or a folder this user may not write
            print(f"quality_seeds: error: --out {args.out}: cannot make the folder ({e.strerror})", file=sys.stderr)
            return 2
        except SystemExit as e:  # the flags' parser has said which flag, as the trainer's command line does
            return int(e.code or 2)
        signal.signal(signal.SIGTERM, stop)  # as Ctrl-C: the runs are stopped and waited for
        try:
            failed = run_seeds(args.seeds, args.jobs, args.out, flags)
        except KeyboardInterrupt:
            print(f"stopped; the same command runs again each seed without a JSON under {args.out}", file=sys.stderr)
            return 130

    rows, missing = [], []
    for s in args.seeds:
        path = args.out / f"quality-s{s}.json"
        res = json.loads(path.read_text()) if path.exists() else {}
        if "ratio" in res:
            rows.append((s, res["ep"], res["exact"], res["ratio"], res["cosine"]["all"]))
        else:
            missing.append(s)
    if missing:
        print(f"seeds without a ratio (not run, or failed): {missing}", file=sys.stderr)
    if not rows:
        return 1
    metric = "heldout_bpc" if "heldout_bpc" in rows[0][1] else "heldout_loss"
    print(f"\n{'seed':>4} {'EP ' + metric:>20} {'exact ' + metric:>23} {'ratio':>7} {'cosine':>7}")
    for s, ep, exact, ratio, cos in rows:
        print(f"{s:4d} {ep[metric]:20.4f} {exact[metric]:23.4f} {ratio:7.4f} {cos:7.4f}")
    st = summarize([r[3] for r in rows])
    lo, hi = st["mean"] - 2 * st["se"], st["mean"] + 2 * st["se"]
    print(
        f"\n{st['n']} seeds: EP / exact mean {st['mean']:.4f}, sd {st['sd']:.4f}, standard error {st['se']:.4f}; "
        f"mean +- 2 se [{lo:.4f}, {hi:.4f}]"
    )
    return 1 if failed else 0


def summarize(ratios: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation and standard error of the ratios (sd and se 0 for one ratio)."""
    n = len(ratios)
    mean = sum(ratios) / n
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (n - 1)) if n > 1 else 0.0
    return {"n": n, "mean": mean, "sd": sd, "se": sd / math.sqrt(n)}


if __name__ == "__main__":
    raise SystemExit(main())

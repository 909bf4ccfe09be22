"""Corpus size against memory and start time: a run's peak memory, its second start and the first tokenization.

    python -m benchmarks.corpus_memory [--sizes_mb 100 1000] [--windows 20] [--off] [--dir DIR]

Writes corpora of the given sizes itself (the built-in pydoc text repeated, with a counter per copy so no two
copies are the same), then for the built-in corpus and each file trains `python main.py --preset dev --data FILE
--max_windows N` in a subprocess (OMP_NUM_THREADS=1, no evaluation but the final one with --eval_batches 1) and
samples /proc/<pid>/status every 20 ms. Per run it prints the wall time, peak anonymous memory (RssAnon: the
process's own memory; the token cache's file-backed pages are shared and evictable, so they are apart) and peak
resident memory with file pages (VmHWM). For each file: the first start (tokenization; MB/s from the cache's
creation timed in this process beforehand), the second start (the cache mapped), and with --off the same run with
--token_cache off (tokenized into memory at every start, as before issue 26).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainer2.data import token_cache as tc
from trainer2.data.text import builtin_text as _builtin_text

HERE = Path(__file__).resolve().parent.parent


def write_corpus(path: Path, size_mb: int) -> None:
    """A UTF-8 corpus of about size_mb MB: the built-in text, repeated with a numbered line before each copy."""
    text = _builtin_text()
    target, written, k = size_mb * 10**6, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            piece = f"\n--- copy {k} ---\n" + text
            f.write(piece)
            written += len(piece.encode("utf-8"))
            k += 1


def status_kib(pid: int, key: str) -> int:
    """A field of /proc/<pid>/status in KiB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def run(label: str, flags: list[str], tmp: Path) -> tuple[float, float, float]:
    """(wall s, peak RssAnon MiB, peak VmHWM MiB) of one training process; prints them."""
    cmd = [
        sys.executable,
        str(HERE / "main.py"),
        "--preset",
        "dev",
        *flags,
        "--eval_every_windows",
        "0",
        "--eval_batches",
        "1",
        "--checkpoint_dir",
        str(tmp / "ck"),
        "--run_name",
        f"r{time.monotonic_ns()}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    anon = hwm = 0
    while proc.poll() is None:
        anon = max(anon, status_kib(proc.pid, "RssAnon"))
        hwm = max(hwm, status_kib(proc.pid, "VmHWM"))
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{label} failed:\n{proc.stderr.read()[-2000:]}")
    print(
        f"{label:<44} wall {wall:7.2f} s   peak anon {anon / 1024:7.1f} MiB   peak RSS incl. file pages "
        f"{hwm / 1024:7.1f} MiB",
        flush=True,
    )
    return wall, anon / 1024, hwm / 1024


def tokenize_rounds(tmp: Path, sizes_mb: list[int], rounds: int) -> int:
    """Time making the token cache `rounds` times per corpus size, in this process; print best and median MB/s."""
    for mb in sizes_mb:
        f = tmp / f"corpus_{mb}mb.txt"
        write_corpus(f, mb)
        rates = []
        for _ in range(rounds):
            tc.cache_path(f, "auto").unlink(missing_ok=True)
            t0 = time.perf_counter()
            tc.open_cache(f, "auto", 8, 0.1)
            rates.append(f.stat().st_size / 1e6 / (time.perf_counter() - t0))
        rates.sort()
        print(
            f"{mb} MB: first tokenization {rates[-1]:.1f} MB/s best, {rates[len(rates) // 2]:.1f} median "
            f"of {rounds} rounds"
        )
        f.unlink()
        tc.cache_path(f, "auto").unlink(missing_ok=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes_mb", type=int, nargs="+", default=[100])
    p.add_argument("--windows", type=int, default=20, help="training windows per run")
    p.add_argument("--off", action="store_true", help="also run each file with --token_cache off (as before)")
    p.add_argument("--dir", type=Path, help="where to write the corpora (default: a temporary directory)")
    p.add_argument(
        "--tokenize_rounds",
        type=int,
        default=0,
        help="only time the first tokenization this many times per size (best and median MB/s)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="corpus_", dir=args.dir) as tmp_name:
        tmp = Path(tmp_name)
        if args.tokenize_rounds:
            return tokenize_rounds(tmp, args.sizes_mb, args.tokenize_rounds)
        w = ["--max_windows", str(args.windows), "--log_every_windows", str(args.windows)]
        base = run("built-in corpus", w, tmp)
        for mb in args.sizes_mb:
            f = tmp / f"corpus_{mb}mb.txt"
            write_corpus(f, mb)
            size = f.stat().st_size
            t0 = time.perf_counter()
            tc.open_cache(f, "auto", 8, 0.1)
            took = time.perf_counter() - t0
            print(
                f"{mb} MB corpus ({size / 1e6:.1f} MB): first tokenization into the cache {took:.2f} s = "
                f"{size / 1e6 / took:.1f} MB/s (cache {tc.cache_path(f, 'auto').stat().st_size / 1e6:.1f} MB)"
            )
            tc.cache_path(f, "auto").unlink()
            first = run(f"{mb} MB, first start (tokenizes)", [*w, "--data", str(f)], tmp)
            second = run(f"{mb} MB, second start (maps the cache)", [*w, "--data", str(f)], tmp)
            print(
                f"  second start - built-in: {second[0] - base[0]:+.2f} s; peak anon - built-in: "
                f"{second[1] - base[1]:+.1f} MiB (first start {first[1] - base[1]:+.1f} MiB)"
            )
            if args.off:
                off = run(f"{mb} MB, --token_cache off", [*w, "--data", str(f), "--token_cache", "off"], tmp)
                print(f"  off - built-in: {off[0] - base[0]:+.2f} s, peak anon {off[1] - base[1]:+.1f} MiB")
            f.unlink()
            tc.cache_path(f, "auto").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

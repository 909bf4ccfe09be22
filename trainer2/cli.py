"""Command line: `trainer2 [train] [--preset NAME] [--config FILE] [--FIELD VALUE ...]`.

Every TrainConfig field is a flag of the same name (trainer2.flags); subcommands evaluate, sample, plot, bench and
sweep.
Exit status: 0 done; 2 refused (a bad flag, config, data file or checkpoint; a run directory in use or holding
another run; sizes that cannot fit); 3 the run diverged; 74 a file could not be written (disk full, read-only, a
planted symlink); 129 / 130 / 131 / 143 / 138 / 140 stopped by SIGHUP / SIGINT / SIGQUIT / SIGTERM / SIGUSR1 /
SIGUSR2 after saving a checkpoint (the last line printed and summary.json's resume_command say how to resume).
"""

from __future__ import annotations

import argparse
import signal
import sys
import warnings
from typing import Any, Callable

import torch

from trainer2.data.dataset import DataError
from trainer2.flags import (
    add_config_flags,
    add_trust_flag,
    config_layers,
    none_or,
    user_modules_from_cwd,
)
from trainer2.io import strictjson
from trainer2.io.console import guarded_streams, say
from trainer2.io.parser import Parser
from trainer2.monitor.plot import cmd_plot
from trainer2.presets import preset_names, preset_path
from trainer2.running.checkpoint import CheckpointError, read_meta
from trainer2.running.distributed import DistributedError, init_distributed, rank_label
from trainer2.running.health import Diverged
from trainer2.running.model import WEIGHTS, WEIGHTS_HELP
from trainer2.running.resume import (
    add_checkpoint_flags,
    checkpoint_from,
    fresh_layers,
    resume_command,
    resume_config,
    resume_layers,
    resume_target,
)
from trainer2.running.rundir import RunDirError
from trainer2.running.signals import exit_code
from trainer2.running.summary import done_line
from trainer2.section import ConfigError
from trainer2.train_config import annotated_yaml, build_config, config_origins

EXIT_REFUSED, EXIT_DIVERGED, EXIT_IOERR = 2, 3, 74  # 74: EX_IOERR of sysexits.h
# What each command does, for the top of --help (tests/test_cli_help.py checks it names every command in COMMANDS).
COMMAND_HELP = {
    "train": "(default) train a machine with Equilibrium Propagation (no autograd); its flags follow",
    "evaluate": "print a checkpoint's held-out metrics as JSON",
    "sample": "generate text from a checkpoint",
    "plot": "write PNG curves of a run from its telemetry.jsonl",
    "bench": "time the batch step: eager, CUDA graph, torch.compile and the Triton kernels",
    "sweep": "search config fields with Optuna, one run per trial (the sweep extra)",
}


def train_parser() -> argparse.ArgumentParser:
    commands = "\n".join(f"  {name:<9} {text}" for name, text in COMMAND_HELP.items())
    p = Parser(
        prog="trainer2",
        usage="trainer2 [COMMAND] [--preset NAME] [--config FILE] [--FIELD VALUE ...]",  # not all ~80 flags
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keep the command list's lines
        commands=COMMAND_HELP,
        description=f"commands (trainer2 COMMAND --help for each):\n{commands}\n\n"
        "Every config field is a flag of the same name, grouped below by the config's sections.",
        epilog="Layers, lowest first: field defaults < --preset < --config < flags.",
    )
    p.add_argument(
        "--preset", help=f"Preset name ({', '.join(preset_names())}; shipped in the package) or a YAML path."
    )
    p.add_argument("--config", help="YAML file of config fields, applied over the preset.")
    p.add_argument(
        "--resume",
        metavar="latest|PATH",
        help="Continue from a run's newest checkpoint ('latest': of --run_name, "
        "or of the run saved most recently) or a step_<N>/ directory, in its own run unless --run_name says "
        "otherwise; its config is the lowest layer, and model/data fields must match it.",
    )
    p.add_argument(
        "--print_config",
        action="store_true",
        help="Print the resolved config as YAML, each non-default "
        "value commented with the layer it came from, and exit without loading data or touching checkpoints.",
    )
    add_trust_flag(p)
    add_config_flags(p)
    return p


def print_config(args: argparse.Namespace) -> int:
    """--print_config: the resolved YAML with the layer of each non-default value; reads no data, writes nothing."""
    layers = config_layers(args)
    if args.resume:  # what the resumed run would use: the checkpoint's config is the lowest layer
        run_dir = resume_target(args.resume, layers)
        cfg, path = resume_config(args.resume, layers, run_dir, args.trust_code)
        layers = resume_layers(path, read_meta(path), layers, run_dir)
    else:
        layers = fresh_layers(layers, preset_path(args.preset).stem if args.preset else "run", args.trust_code)
        cfg = build_config(layers, args.trust_code)
    print(annotated_yaml(cfg, config_origins(layers)), end="")
    return 0


def cmd_train(argv: list[str]) -> int:
    args = train_parser().parse_args(argv)
    if args.resume == "":
        raise ConfigError(
            "--resume: empty; expected 'latest' or a step_<N>/ checkpoint directory (drop --resume to start afresh)"
        )
    user_modules_from_cwd(args)
    if args.print_config:
        return print_config(args)
    from trainer2.running.run import train

    layers = config_layers(args)
    path = None
    if args.resume:
        cfg, path = resume_config(args.resume, layers, resume_target(args.resume, layers), args.trust_code)
    else:
        prefix = preset_path(args.preset).stem if args.preset else "run"
        cfg = build_config(fresh_layers(layers, prefix, args.trust_code), args.trust_code)
    dist = init_distributed(cfg)  # under torchrun: this process's rank and its process group
    try:
        run = train(cfg, resume=path, log=say if dist.is_main else quiet, dist=dist, resume_hint=resume_command(cfg))
    except Diverged as e:
        print(f"trainer2: error{rank_label()}: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    finally:
        dist.close()
    if not dist.is_main:
        return 0
    summary = run.summary
    if summary["interrupted"]:
        print(
            f"trainer2: stopped by {summary['interrupted']} after window {summary['windows']}; resume with: "
            f"{summary['resume_command']}",
            file=sys.stderr,
        )
        return exit_code(signal.Signals[summary["interrupted"]])
    say(done_line(summary))
    return 0


def quiet(msg: str) -> None:
    """The log of ranks other than 0: they print nothing."""
    del msg


def cmd_bench(argv: list[str]) -> int:
    from trainer2.running.bench import main as bench_main

    return bench_main(argv)


def cmd_sweep(argv: list[str]) -> int:
    from trainer2.running.sweep_cli import cmd_sweep as run

    return run(argv)


def cmd_sample(argv: list[str]) -> int:
    from trainer2.running.sampling import cmd_sample as run

    return run(argv)


def cmd_evaluate(argv: list[str]) -> int:
    p = Parser(prog="trainer2 evaluate", description="Print the held-out metrics of a checkpoint as JSON.")
    add_checkpoint_flags(p)
    p.add_argument("--device", default=argparse.SUPPRESS, help="Device to evaluate on (default: the checkpoint's).")
    p.add_argument(
        "--eval_batches",
        type=none_or(int),
        default=argparse.SUPPRESS,
        metavar="N",
        help="Held-out batches of 512 to score; none = all (default: the checkpoint's).",
    )
    p.add_argument("--weights", choices=WEIGHTS, default="auto", help=WEIGHTS_HELP)
    p.add_argument(
        "--data",
        default=argparse.SUPPRESS,
        metavar="PATH",
        help="The run's data where it is now (moved, or trained from Python and saved to a file); its contents must "
        "match the checkpoint's (default: the checkpoint's --data).",
    )
    add_trust_flag(p)
    parsed = p.parse_args(argv)
    user_modules_from_cwd(parsed)
    path = checkpoint_from(parsed)
    args = {k: v for k, v in vars(parsed).items() if k not in ("checkpoint", "run_name", "checkpoint_dir")}
    from trainer2.running.model import load

    model = load(path, **args)
    try:  # no file names the data of a run trained from Python: say how to score it, not that the corpus differs
        model.refuse_data_from_memory()
    except DataError:
        raise DataError(
            f"{path}: its run was trained on data given in memory (from Python), which no file names; evaluate it "
            f"from Python, trainer2.load({str(path)!r}).evaluate(trainer2.from_arrays(...)), or save that data with "
            "numpy.savez(FILE.npz, x=x, y=y) and pass --data FILE.npz"
        ) from None
    print(f"loaded {path} (window {model.window}, {model.weights} weights)", file=sys.stderr)
    validation = model.evaluate(split="validation") if model.cfg.validation_fraction else {}
    out = {"checkpoint": str(path), "window": model.window, "weights": model.weights, **model.evaluate(), **validation}
    print(strictjson.dumps(out, indent=2))
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": cmd_train,
    "evaluate": cmd_evaluate,
    "plot": cmd_plot,
    "sample": cmd_sample,
    "bench": cmd_bench,
    "sweep": cmd_sweep,
}


def show_note(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """How the command line shows a warning (such as a renamed config key): `trainer2: note: ...` on stderr."""
    print(f"trainer2: note: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run a command; output that goes away (a closed terminal, a broken pipe) is dropped, never fatal."""
    with guarded_streams():
        return run_command(list(sys.argv[1:] if argv is None else argv))


def run_command(argv: list[str]) -> int:
    """The command's exit status; a user's mistake is one line on stderr, never a traceback."""
    command = COMMANDS.get(argv[0]) if argv else None
    run = command or cmd_train
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("once", FutureWarning)  # a config built twice (print_config, resume) notes once
            warnings.showwarning = show_note  # a renamed flag or key: one line, not a source location
            return run(argv[1:] if command else argv)
    except (ConfigError, DataError, CheckpointError, RunDirError) as e:
        print(f"trainer2: error{rank_label()}: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except DistributedError as e:  # a failed or timed-out collective, or ranks that diverged; names the rank(s)
        print(f"trainer2: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # disk full, read-only, quota: the file and the cause, no traceback
        print(
            f"trainer2: error: {e.filename}: {e.strerror}" if e.filename else f"trainer2: error: {e}", file=sys.stderr
        )
        return EXIT_IOERR
    except (MemoryError, RuntimeError) as e:  # an allocation trainer2.running.sizes' estimate did not foresee
        if (
            isinstance(e, RuntimeError)
            and not isinstance(e, torch.OutOfMemoryError)
            and "can't allocate memory" not in str(e)
        ):
            raise
        print(
            f"trainer2: error: out of memory ({' '.join(str(e).split())[:300] or 'MemoryError'}); lower batch_size, "
            "layers, memory_capacity or the data's size",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which stops gracefully): nothing half-written
        print("trainer2: interrupted", file=sys.stderr)
        return exit_code(signal.SIGINT)


if __name__ == "__main__":  # python -m trainer2.cli
    sys.exit(main())

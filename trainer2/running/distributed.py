"""Data-parallel training over torch.distributed, started by torchrun: one process per device, one all-reduce per step.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them (a plain `python main.py`) the run is one process
and no process group is made. --batch_size is per process: every rank draws the same global batch of
batch_size x world_size from the shared seed and takes slice `rank` of it, so N processes at batch b follow
one process at batch N x b, up to the order of floating-point sums.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from trainer2.running.parts import resolve_device
from trainer2.train_config import ConfigError, TrainConfig

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class DistributedError(RuntimeError):
    """A collective that failed or timed out, or ranks whose parameters differ; the message names the rank(s)."""


@dataclass(frozen=True)
class Distributed:
    """Where this process stands in the job. `launched`: started by torchrun, so a process group exists
    (even at world size 1); a plain `python main.py` is Distributed() = one process, no group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False
    timeout_s: float = 0.0

    @property
    def is_main(self) -> bool:
        """Rank 0 prints, shows the bar and writes telemetry, config, checkpoints and the summary."""
        return self.rank == 0

    @staticmethod
    def from_env(env: Mapping[str, str], timeout_s: float = 0.0) -> "Distributed":
        """Read torchrun's RANK, WORLD_SIZE and LOCAL_RANK; none set = one process. Bad values are a ConfigError."""
        given = [k for k in ENV if k in env]
        if not given:
            return Distributed()
        if len(given) < len(ENV):
            raise ConfigError(
                f"environment: {', '.join(given)} set but not {', '.join(k for k in ENV if k not in env)}; "
                "start multi-process runs with torchrun, which sets all three"
            )
        try:
            rank, world, local = (int(env[k]) for k in ENV)
        except ValueError:
            raise ConfigError(
                f"environment: RANK, WORLD_SIZE and LOCAL_RANK must be integers, got "
                f"{env['RANK']!r}, {env['WORLD_SIZE']!r}, {env['LOCAL_RANK']!r}"
            ) from None
        if not (world >= 1 and 0 <= rank < world and local >= 0):
            raise ConfigError(f"environment: RANK {rank} / WORLD_SIZE {world} / LOCAL_RANK {local} are inconsistent")
        return Distributed(rank, world, local, True, timeout_s)

    def place(self, dev: torch.device, name: str) -> torch.device:
        """The device this process trains on, from the resolved --device `name`: CUDA -> cuda:LOCAL_RANK when launched
        (a named GPU is kept for one process, and refused for several, which cannot share it)."""
        if not self.launched or dev.type != "cuda" or (dev.index is not None and self.world_size == 1):
            return dev
        if dev.index is not None:
            raise ConfigError(
                f"device: {name!r} names one GPU, but under torchrun each process uses its own "
                f"(cuda:LOCAL_RANK); pass --device cuda or auto"
            )
        return torch.device("cuda", self.local_rank)

    # --- collectives (no-ops for one process without a group) ---

    def _failed(self, what: str, e: BaseException) -> DistributedError:
        text = " ".join(str(e).split())[:400]
        return DistributedError(
            f"rank {self.rank}: {what} failed ({type(e).__name__}: {text}); another process died, "
            f"hung past the {self.timeout_s:g} s timeout (--dist_timeout_seconds) or was stopped, "
            "and torchrun's report names it"
        )

    def all_reduce_sum(self, t: Tensor, what: str) -> None:
        """Sum `t` over the ranks in place."""
        if not self.launched:
            return
        try:
            dist.all_reduce(t)
        except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
            raise self._failed(what, e) from None

    def gather(self, row: Tensor, what: str) -> Tensor:
        """(world_size, n): every rank's 1-D `row`, in rank order."""
        if not self.launched:
            return row[None]
        out = [torch.empty_like(row) for _ in range(self.world_size)]
        try:
            dist.all_gather(out, row)
        except RuntimeError as e:
            raise self._failed(what, e) from None
        return torch.stack(out)

    def check_in(self, sums: Tensor, params: Sequence[Tensor], everywhere: bool) -> None:
        """At a log interval or a save: add up every rank's metric sums and compare parameter checksums, in one
        all_gather. everywhere: every rank ends up holding the total (to read it); otherwise rank 0 holds it and
        the others hold zeros (for a checkpoint, which rank 0 writes). Ranks whose parameters differ from rank
        0's raise DistributedError, on every rank, naming them."""
        if not self.launched:
            return
        row = torch.cat([sums.to(torch.float64), param_checksum(params).reshape(1).to(sums.device)])
        rows = self.gather(row, "the metric and checksum exchange").cpu()
        sums.copy_(rows[:, :-1].sum(0).to(sums.device, sums.dtype))  # the same sum in the same order on every rank
        if not everywhere and not self.is_main:
            sums.zero_()
        checks = rows[:, -1]
        same = torch.isclose(checks, checks[0], rtol=0.0, atol=0.0, equal_nan=True)  # bitwise, NaN equal to NaN
        bad, checks = [r for r, ok in enumerate(same.tolist()) if not ok], checks.tolist()
        if bad:
            raise DistributedError(
                f"rank {self.rank}: parameters differ between ranks: rank(s) {bad} disagree with rank 0 "
                f"(checksums {[checks[r] for r in bad]} vs {checks[0]}); the run stops rather than "
                "train diverged copies"
            )

    def close(self) -> None:
        """Leave the process group (at the end of a run, or after an error)."""
        if self.launched and dist.is_initialized():
            dist.destroy_process_group()


def rank_label(env: Mapping[str, str] | None = None) -> str:
    """' (rank R)' for messages of a process torchrun started, else ''."""
    rank = (os.environ if env is None else env).get("RANK")
    return f" (rank {rank})" if rank is not None else ""


def init_distributed(cfg: TrainConfig, env: Mapping[str, str] | None = None) -> Distributed:
    """This process's place in the job, and its process group when torchrun started it: gloo on CPU, NCCL on
    CUDA (each process on cuda:LOCAL_RANK), with cfg.dist_timeout_seconds on every collective."""
    d = Distributed.from_env(os.environ if env is None else env, cfg.dist_timeout_seconds)
    if not d.launched:
        return d
    device = d.place(resolve_device(cfg), cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            rank=d.rank,
            world_size=d.world_size,
            timeout=timedelta(seconds=cfg.dist_timeout_seconds),
        )
    except (ValueError, RuntimeError) as e:  # e.g. no MASTER_ADDR / MASTER_PORT: not started by torchrun
        text = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"environment: the process group cannot start ({text}); start multi-process runs with "
            "torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
        ) from None
    return d


def param_checksum(params: Sequence[Tensor]) -> Tensor:
    """0-dim float64: sum_i (i + 1) * sum(p_i) + sum(p_i^2); equal on ranks whose parameters are identical."""
    terms = [(i + 1) * p.to(torch.float64).sum() + p.to(torch.float64).square().sum() for i, p in enumerate(params)]
    return torch.stack(terms).sum()

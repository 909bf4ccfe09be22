"""The retrieval readout's loss and gradients in one Triton launch (trainer2/physics/kernels/readout_grads.py) against
its torch reference, readout_loss_and_grads, in Triton's interpreter on CPU tensors; and proof that the Triton window
takes it where it fits.

Needs triton and numpy (pip install -e '.[kernels]') and TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton; skipped with the reason otherwise."""

from __future__ import annotations

import pytest
import torch
from interpreted import require_interpreted_triton

require_interpreted_triton("the readout kernel")

from tiny import tiny_config, tiny_machine  # noqa: E402

from trainer2.components import resolve  # noqa: E402
from trainer2.physics.costs.retrieval import Retrieval  # noqa: E402
from trainer2.physics.kernels import readout_grads  # noqa: E402
from trainer2.physics.kernels.backend import (  # noqa: E402
    AUTO_TAKES_TRITON_READOUT,
    choose_readout_backend,
    readout_kernel,
)
from trainer2.physics.kernels.rotor_angle_grad import RotorAngleGrad  # noqa: E402
from trainer2.physics.memory import MemoryBank  # noqa: E402
from trainer2.physics.readout import ReadoutScratch, readout_frame, rotor_layout, target_mask  # noqa: E402
from trainer2.running.trainer import Trainer  # noqa: E402
from trainer2.section import ConfigError  # noqa: E402
from trainer2.train_config import build_config  # noqa: E402

TOL = {torch.float32: 3e-5, torch.float64: 1e-12}
# (batch, coordinates, classes, memory slots, filled slots, retrieval beta): one block and a ragged second, odd sizes,
# a memory bank with empty slots (bias -inf), more than 16 classes one-hot and in the bank (three blocks of classes),
# and batches past ROWS_PER_PROGRAM rows, shared among programs (the last one ragged), summed by a second launch
CASES = [(5, 4, 7, 0, 0, 1.0), (37, 16, 20, 0, 0, 2.3), (16, 3, 7, 24, 17, 0.7), (21, 8, 35, 40, 40, 2.3)]
CASES += [(128, 16, 100, 0, 0, 1.0), (150, 8, 7, 0, 0, 1.3), (130, 4, 20, 160, 150, 0.9), (64, 4, 7, 0, 0, 1.0)]
CASES += [(65, 4, 7, 0, 0, 1.0)]  # the boundary: 64 rows in one program, 65 in two (the second holds one row)
PROGRAMS = [(128, 2), (150, 3), (130, 3), (65, 2)]  # those batches' programs at ROWS_PER_PROGRAM 64; one below 65 rows


def readout(case: tuple[int, int, int, int, int, float], dtype: torch.dtype):
    """q (B, n), the batch's cost frame, targets and target mask for a tiny machine (and memory bank) of these sizes."""
    batch, n, classes, slots, filled, beta = case
    dtype_name = str(dtype).split(".")[1]
    cfg = tiny_config(coord_dim_n=n, batch_size=batch, memory_capacity=slots, retrieval_beta=beta, dtype=dtype_name)
    m = tiny_machine(cfg, classes)
    gen = torch.Generator().manual_seed(batch + n + classes + slots)
    with torch.no_grad():
        m.readout.protos.copy_(torch.randn(m.readout.protos.shape, generator=gen, dtype=torch.float64))
        m.readout.r_sc.fill_(2.5)
    cand = m.prototype_candidates()
    if slots:
        bank = MemoryBank.allocate(slots, n, batch, m.readout.protos)
        for start in range(0, filled, batch):  # fills slots [0, filled) with labelled random points
            rows = min(batch, filled - start)
            bank.offsets = torch.arange(rows)
            bank.write(torch.randn(rows, n, generator=gen, dtype=dtype), torch.randint(0, classes, (rows,)))
        cand = bank.candidates(cand)
    q = torch.randn(batch, n, generator=gen, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, classes, (batch,), generator=gen)
    frame = readout_frame(m.readout, cand, m.layout, cfg.retrieval_beta, cfg.eps)
    cost = Retrieval.frame(m.readout, frame, cand, classes, m.layout, one_hot=slots == 0)
    return q, cost, target_mask(cand.labels, targets, dtype), cfg.retrieval_beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{b}-n{n}-V{v}-mem{s}-beta{r}" for b, n, v, s, _, r in CASES])
def test_the_kernel_equals_readout_loss_and_grads(case, dtype):
    """Loss, probabilities and every readout gradient as the torch operators give them, to rounding; twice in a row
    (the kernel's buffers are reused), the second time at other coordinates; a batch past ROWS_PER_PROGRAM rows in
    several programs and a second launch that adds their sums."""
    q, cost, mask, beta_r = readout(case, dtype)
    batch, n, classes = q.shape[0], q.shape[1], cost.num_classes
    rotor = RotorAngleGrad(cost.layout, q)  # theta through the rotor's kernel, as beside the Triton window here
    kernel = readout_grads.ReadoutGrads(batch, n, cost.cand.coords.shape[0], classes, beta_r, q, rotor)
    for q_now in (q, q.flip(0) * 0.7):
        sc = ReadoutScratch.allocate(batch, n, cost.cand.coords.shape[0], q)
        ref = Retrieval.loss_and_grads(q_now, cost, mask, sc)
        got = kernel(q_now.contiguous(), cost, mask)
        pairs = {
            "loss": (got.loss, ref.loss),
            "probs": (got.probs, ref.probs),
            "g_diag": (got.grads.g_diag, ref.grads.g_diag),
            "theta": (got.grads.theta, ref.grads.theta),
            "protos": (got.grads.protos, ref.grads.protos),
            "r_sc": (got.grads.r_sc, ref.grads.r_sc),
        }
        for name, (a, b) in pairs.items():
            assert a.shape == b.shape and a.dtype == b.dtype, name
            scale = max(float(b.abs().max()), 1e-3)
            assert float((a - b).abs().max()) <= TOL[dtype] * scale, (name, float((a - b).abs().max()), scale)
        assert float(ref.grads.protos.abs().max()) > 1e-4 and float(ref.grads.theta.abs().max()) > 1e-4  # not vacuous
    programs = {b: p for b, p in PROGRAMS}.get(batch, 1)
    assert kernel.programs == programs and kernel.launches == (4 if programs > 1 else 2) and rotor.launches == 2


def test_fits_bounds_the_candidates_and_the_rotors_tiles_in_bytes():
    assert readout_grads.fits(16, 512, 4) and readout_grads.fits(64, 128, 4) and readout_grads.fits(16, 256, 8)
    assert not readout_grads.fits(16, 512, 8) and not readout_grads.fits(64, 256, 4) and readout_grads.fits(3, 7, 8)
    assert readout_grads.fits(64, 10, 8) and not readout_grads.fits(128, 10, 4)  # the (n, n) rotor: 64 KiB at 128


def test_readout_backend_triton_runs_it_where_it_can_and_auto_takes_it_on_cuda_only():
    """--readout_backend triton with the retrieval cost: the kernel (beside either window); auto takes it on a CUDA
    device only (tests/test_window_backend.py), torch here; another cost (also a subclass of the retrieval cost, which
    may compute otherwise) or a readout past one program's registers is refused by name."""

    class MyRetrieval(Retrieval):
        kind = "my_retrieval"

    like, sizes = torch.zeros(1, dtype=torch.float64), (8, 16, 24, 24)
    tri = choose_readout_backend("triton", like, Retrieval, sizes)
    layout = rotor_layout(16, 5, dtype=like.dtype)
    kernel = readout_kernel(tri, sizes, 1.0, layout, like)
    assert tri.name == "triton" and isinstance(kernel, readout_grads.ReadoutGrads)
    assert isinstance(kernel.rotor, RotorAngleGrad)  # the interpreter always takes the rotor's kernel with it
    auto = choose_readout_backend("auto", like, Retrieval, sizes)
    assert auto.name == "torch" and readout_kernel(auto, sizes, 1.0, layout, like) is None and AUTO_TAKES_TRITON_READOUT
    assert choose_readout_backend("torch", like, Retrieval, sizes).name == "torch"
    with pytest.raises(ConfigError, match="readout_backend: triton cannot run here: .*this run's is my_retrieval"):
        choose_readout_backend("triton", like, MyRetrieval, sizes)
    with pytest.raises(ConfigError, match="this run's is mse"):
        choose_readout_backend("triton", like, resolve("cost", "mse"), sizes)
    with pytest.raises(ConfigError, match=r"512 candidates x 16 coordinates of torch.float64 .* \(32 KiB padded\)"):
        choose_readout_backend("triton", like, Retrieval, (8, 16, 512, 24))
    assert "the CPU" in choose_readout_backend("auto", like, Retrieval, sizes).reason  # auto: CUDA only


def test_a_run_with_the_readout_kernel_beside_the_torch_window(tmp_path, small_text):
    """--readout_backend triton with --window_backend torch: the kernel runs every window, the summary names it, and
    the run equals the all-torch run to rounding. With momentum: Adam divides a gradient near zero by its own size, so
    a rounding difference there (the rotor angle's, whose sin and cos the interpreter takes from numpy) becomes one of
    the learning rate's size (5e-9 with numpy 2.4.6; momentum leaves 7e-16)."""
    base = dict(hidden_sizes=[10], coord_dim_n=4, rotor_k=4, context_len=3, embed_dim=3, batch_size=8, free_steps=6)
    base.update(nudge_steps=4, max_windows=20, log_every_windows=20, eval_every_windows=0, eval_batches=1)
    base.update(dtype="float64", data=str(small_text), device="cpu", window_backend="torch", update_rule="momentum")
    runs = {}
    for backend in ("triton", "torch"):
        flags = {"readout_backend": backend, "checkpoint_dir": str(tmp_path / backend)}
        trainer = Trainer(build_config([("test", {**base, **flags})]), log=lambda *_: None)
        runs[backend] = trainer, trainer.train()
    (tri, tri_summary), (ref, ref_summary) = runs["triton"], runs["torch"]
    assert tri.relaxation.readout_kernel.launches == 20 and ref.relaxation.readout_kernel is None
    assert tri.relaxation.frame_kernel.launches == 20 and ref.relaxation.frame_kernel is None  # readout_frame.py
    assert tri_summary["readout_backend"] == "triton" and ref_summary["readout_backend"] == "torch"
    torch.testing.assert_close(tri.machine.flat, ref.machine.flat, rtol=1e-9, atol=1e-9)


def test_a_tensor_in_another_layout_is_refused_not_misread():
    q, cost, mask, beta_r = readout(CASES[1], torch.float64)
    kernel = readout_grads.ReadoutGrads(q.shape[0], q.shape[1], cost.cand.coords.shape[0], cost.num_classes, beta_r, q)
    with pytest.raises(ValueError, match="not contiguous"):
        kernel(q.T.contiguous().T, cost, mask)


def test_a_tensor_of_another_size_is_refused_by_name_not_read_past():
    """The kernel reads the sizes it was built for: fewer rows, a mask of other width, or float32 would be read past
    their ends (or as other numbers) without the check."""
    q, cost, mask, beta_r = readout(CASES[1], torch.float64)
    kernel = readout_grads.ReadoutGrads(q.shape[0], q.shape[1], cost.cand.coords.shape[0], cost.num_classes, beta_r, q)
    with pytest.raises(ValueError, match=r"q has shape \(%d, %d\)" % (q.shape[0] - 1, q.shape[1])):
        kernel(q[1:].contiguous(), cost, mask[1:].contiguous())
    with pytest.raises(ValueError, match="mask has shape"):
        kernel(q, cost, mask[:, 1:].contiguous())
    with pytest.raises(ValueError, match="q has shape .* dtype torch.float32"):
        kernel(q.float(), cost, mask)
    assert kernel.launches == 0


def test_bench_triton_modes_keep_the_torch_readout_where_its_kernel_cannot_run(small_text):
    """A readout past one program (300 memory slots, float64) with the config's auto: the triton row is measured, with
    the Triton window and update but the torch readout (5 launches, and the EP statistic's 2, the observables' 1 and
    the metrics' 2 that join them in the interpreter), not refused."""
    from trainer2.data.load import load_dataset
    from trainer2.running.bench import host_batches, prepare

    flags = dict(hidden_sizes=[8], coord_dim_n=4, rotor_k=3, batch_size=8, free_steps=3, nudge_steps=2, dtype="float64")
    cfg = build_config([("test", {**flags, "memory_capacity": 300, "data": str(small_text), "device": "cpu"})])
    data = load_dataset(cfg.data, cfg.context_len, cfg.heldout_fraction)
    row, runner = prepare(cfg, data, torch.device("cpu"), 8, "triton", host_batches(data, 8, 2, 0))
    assert row.note == "" and runner is not None and row.triton_per_batch == 10
    assert runner.batch_step.relax.readout_backend.name == "torch" and runner.batch_step.relax.backend.name == "triton"

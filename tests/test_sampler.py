"""The Feistel sampler: a permutation of the examples every epoch, O(1) state, bitwise resume mid-epoch, and
checkpoints of the randperm sampler (format 1) still resuming in their own order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer2.data.dataset import DataError
from trainer2.data.sampler import RandpermSampler, Sampler, permute


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 15, 16, 17, 100, 1023, 1024, 1025, 4099])
def test_every_epoch_is_a_bijection_of_the_positions(n):
    for epoch in range(3):
        out = permute(np.arange(n, dtype=np.uint64), n, seed=11, epoch=epoch)
        assert np.array_equal(np.sort(out), np.arange(n)), epoch


def test_each_epoch_gives_every_example_once_in_a_new_order():
    sampler = Sampler(num_examples=24, batch_size=4, seed=3)
    epochs = [torch.cat([sampler.next() for _ in range(6)]) for _ in range(4)]
    for order in epochs:
        assert order.dtype == torch.int64 and torch.equal(order.sort().values, torch.arange(24))
    assert len({tuple(o.tolist()) for o in epochs}) == 4  # four different orders
    assert sampler.epoch == 3


def test_the_ragged_tail_is_dropped_and_seeds_differ():
    sampler = Sampler(num_examples=23, batch_size=5, seed=0)
    first = torch.cat([sampler.next() for _ in range(4)])
    assert len(set(first.tolist())) == 20 and sampler.epoch == 0
    sampler.next()
    assert sampler.epoch == 1  # the fifth batch starts a new epoch
    a, b = Sampler(50, 7, seed=1), Sampler(50, 7, seed=2)
    assert not torch.equal(torch.cat([a.next() for _ in range(7)]), torch.cat([b.next() for _ in range(7)]))


def test_resume_mid_epoch_continues_bit_for_bit():
    sampler = Sampler(num_examples=17, batch_size=4, seed=5)
    for _ in range(6):  # into the second epoch
        sampler.next()
    state = {k: v.clone() for k, v in sampler.state_dict().items()}
    expected = [sampler.next() for _ in range(9)]
    restored = Sampler(num_examples=17, batch_size=4, seed=999)  # the saved seed wins
    restored.load_state_dict(state)
    assert all(torch.equal(a, restored.next()) for a in expected)
    assert restored.epoch == sampler.epoch


def test_state_is_constant_size_and_holds_no_permutation():
    small, big = Sampler(100, 4, seed=0), Sampler(10**12, 4, seed=0)
    assert small.state_dict().keys() == big.state_dict().keys()
    assert all(v.numel() == 1 for v in big.state_dict().values())
    batch = big.next()  # a trillion examples: no O(N) table anywhere
    assert batch.shape == (4,) and int(batch.min()) >= 0 and int(batch.max()) < 10**12


def test_a_format_1_randperm_state_resumes_in_its_own_order():
    old = RandpermSampler(num_examples=17, batch_size=4, seed=5)
    for _ in range(6):
        old.next()
    state = {k: v.clone() for k, v in old.state_dict().items()}
    expected = [old.next() for _ in range(9)]
    new = Sampler(num_examples=17, batch_size=4, seed=0)
    new.load_state_dict(state)
    assert all(torch.equal(a, new.next()) for a in expected)
    assert set(new.state_dict()) == set(state) and new.epoch == old.epoch  # it keeps saving format 1


def test_bad_states_are_refused_naming_the_format_or_the_problem():
    state = Sampler(10, 2, seed=0).state_dict()
    with pytest.raises(DataError, match="format 7"):
        Sampler(10, 2, seed=0).load_state_dict({**state, "format": torch.tensor(7)})
    with pytest.raises(DataError, match="missing"):
        Sampler(10, 2, seed=0).load_state_dict({"pos": torch.tensor(0)})
    with pytest.raises(DataError, match="11"):
        Sampler(11, 2, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match="larger than"):
        Sampler(3, 4, seed=0)


def test_a_run_with_format_1_sampler_state_resumes_bit_for_bit_through_the_trainer(tmp_path, small_text):
    """A checkpoint as main wrote it before issue 26 (sampler.generator, no format): resumed by the trainer, the run
    continues in the randperm order it started with, and ends exactly where the uninterrupted run does."""
    from safetensors.torch import load_file
    from test_checkpoint import assert_same_checkpoint, config, quiet, run_dir

    from trainer2.running import checkpoint as ck

    def legacy_run(name: str, windows: int):
        trainer = quiet(config(tmp_path, small_text, run_name=name, max_windows=windows, memory_capacity=0))
        s = trainer.sampler
        trainer.sampler.load_state_dict(RandpermSampler(s.num_examples, s.batch_size, trainer.cfg.seed).state_dict())
        return trainer

    legacy_run("whole", 20).train()
    legacy_run("cut", 10).train()
    cut = run_dir(tmp_path, "cut") / "step_00000010"
    saved = load_file(str(cut / ck.TENSORS_FILE))
    assert "sampler.generator" in saved and "sampler.format" not in saved  # format 1, as before issue 26
    resumed = quiet(config(tmp_path, small_text, run_name="cut", max_windows=20, memory_capacity=0))
    resumed.load_checkpoint(cut)
    resumed.train()
    assert_same_checkpoint(run_dir(tmp_path, "whole") / "step_00000020", run_dir(tmp_path, "cut") / "step_00000020")


def test_blocks_permuted_ahead_give_what_each_batch_permuted_alone_gives(monkeypatch):
    """The sampler permutes BLOCK positions at once; the indices are those of permuting each batch alone, across block
    and epoch boundaries and after a resume in the middle of a block."""
    monkeypatch.setattr("trainer2.data.sampler.BLOCK", 40)  # a few blocks per epoch, and batches that straddle them
    n, batch, seed = 203, 7, 11
    s = Sampler(n, batch, seed)
    epoch, pos = 0, 0
    for _ in range(100):  # about three and a half epochs
        if pos + batch > n:
            epoch, pos = epoch + 1, 0
        want = permute(np.arange(pos, pos + batch, dtype=np.uint64), n, s.seed, epoch).astype(np.int64)
        assert s.next().tolist() == want.tolist()
        pos += batch
    resumed = Sampler(n, batch, 0)
    resumed.load_state_dict(s.state_dict())
    assert [resumed.next().tolist() for _ in range(30)] == [s.next().tolist() for _ in range(30)]

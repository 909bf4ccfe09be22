"""Text sampling: probabilities, reproducibility, prompt padding, unknown characters, and the `sample` command."""

from __future__ import annotations

import math

import pytest
import torch

from trainer2.cli import main
from trainer2.data.dataset import DataError
from trainer2.physics.relaxation import Relaxation
from trainer2.running.sampling import generate, next_char_probs
from trainer2.running.trainer import Trainer
from trainer2.train_config import TrainConfig


@pytest.fixture
def trained(small_text, tmp_path) -> Trainer:
    """A tiny machine with a memory bank, trained for a few windows on the small text."""
    cfg = TrainConfig(
        data=str(small_text),
        device="cpu",
        dtype="float64",
        hidden_sizes=[24],
        coord_dim_n=4,
        rotor_k=4,
        context_len=4,
        embed_dim=4,
        batch_size=16,
        free_steps=24,
        nudge_steps=12,
        memory_capacity=64,
        max_windows=40,
        eval_batches=1,
        checkpoint_dir=str(tmp_path / "ck"),
    )
    t = Trainer(cfg, log=lambda *_: None)
    t.train()
    return t


def sampler(t: Trainer) -> Relaxation:
    return Relaxation(t.machine, t.cfg, 1, t.memory)


def test_probs_are_the_readout_distribution(trained: Trainer) -> None:
    inputs, targets = trained.data.batch("heldout", torch.arange(16))
    relax = Relaxation(trained.machine, trained.cfg, 16, trained.memory)
    probs = next_char_probs(relax, inputs)
    assert probs.shape == (16, len(trained.data.vocab))
    assert torch.allclose(probs.sum(1), torch.ones(16, dtype=probs.dtype))
    loss, _ = relax.score(inputs, targets)  # the training loss is -log p_y of the same distribution
    assert math.isclose(float(-probs.gather(1, targets[:, None]).log().sum()), float(loss), rel_tol=1e-9)


def test_fixed_seed_is_reproducible_and_stays_in_vocabulary(trained: Trainer) -> None:
    vocab = trained.data.vocab
    a = generate(sampler(trained), vocab, "the ", 60, 1.0, seed=5)
    assert len(a) == 60 and set(a) <= set(vocab)
    assert generate(sampler(trained), vocab, "the ", 60, 1.0, seed=5) == a
    assert generate(sampler(trained), vocab, "the ", 60, 2.0, seed=6) != generate(
        sampler(trained), vocab, "the ", 60, 2.0, seed=7
    )


def test_temperature_zero_is_argmax_whatever_the_seed(trained: Trainer) -> None:
    vocab, learner = trained.data.vocab, sampler(trained)
    text = generate(learner, vocab, "the c", 8, 0.0, seed=1)
    assert generate(learner, vocab, "the c", 8, 0.0, seed=2) == text
    context = "the c"[-4:]
    for ch in text:
        probs = next_char_probs(learner, trained.data.encode(context)[None])[0]
        assert ch == vocab[int(probs.argmax())]
        context = context[1:] + ch


def test_prompt_is_left_padded_or_truncated_to_the_context(trained: Trainer) -> None:
    vocab, learner = trained.data.vocab, sampler(trained)
    assert generate(learner, vocab, "at", 20, 1.0, 3) == generate(learner, vocab, "  at", 20, 1.0, 3)
    assert generate(learner, vocab, "we see the mat", 20, 1.0, 3) == generate(learner, vocab, " mat", 20, 1.0, 3)
    assert generate(learner, vocab, "", 20, 1.0, 3) == generate(learner, vocab, "    ", 20, 1.0, 3)


def test_unknown_prompt_character_is_named(trained: Trainer) -> None:
    with pytest.raises(DataError, match=r"--prompt: character 'Z' is not in the vocabulary"):
        generate(sampler(trained), trained.data.vocab, "the Zebra", 5, 1.0, 0)


def final_checkpoint(t: Trainer) -> str:
    """The checkpoint the fixture's run wrote at its end."""
    return str(t.run_dir / "step_00000040")


def test_sample_command_prints_prompt_and_continuation(trained: Trainer, capsys) -> None:
    rc = main(
        [
            "sample",
            "--checkpoint",
            final_checkpoint(trained),
            "--prompt",
            "the ",
            "--length",
            "30",
            "--temperature",
            "0.7",
            "--seed",
            "4",
        ]
    )
    assert rc == 0
    expected = "the " + generate(sampler(trained), trained.data.vocab, "the ", 30, 0.7, 4)
    assert capsys.readouterr().out == expected + "\n"


def test_sample_command_refuses_bad_input(trained: Trainer, tmp_path, capsys) -> None:
    assert main(["sample", "--checkpoint", str(tmp_path / "nope"), "--prompt", "the"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["sample", "--checkpoint", final_checkpoint(trained), "--prompt", "caf\u00e9"]) == 2
    assert "character '\u00e9' is not in the vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["sample", "--checkpoint", final_checkpoint(trained), "--temperature", "-1"])
    assert err.value.code == 2 and "--temperature must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--temperature", "nan", "--temperature must be a finite number >= 0, got nan"),  # was a traceback
        ("--temperature", "inf", "--temperature must be a finite number >= 0, got inf"),
        ("--length", "100000000000", "--length must be in 0..1,000,000, got 100,000,000,000"),  # was a traceback
        ("--seed", str(2**64), "--seed must be in"),
    ],
)
def test_sample_refuses_absurd_numbers_before_loading(tmp_path, capsys, flag, value, message) -> None:
    # The checkpoint does not even exist: the numbers are checked first, so nothing is loaded for a bad call.
    with pytest.raises(SystemExit) as err:
        main(["sample", "--checkpoint", str(tmp_path / "nope"), flag, value])
    assert err.value.code == 2 and message in capsys.readouterr().err

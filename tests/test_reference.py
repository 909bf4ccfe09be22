"""The presets train the same machine as before the energy became a list of couplings: parameters after 50 float64
windows of the dev and deep presets (and a three-hidden-layer machine), with the Jacobi 12 / 6 window they had then
(the overrides in the file), match values recorded by tests/make_reference.py on the commit named in
tests/data/reference_50_windows.json."""

from __future__ import annotations

import json

import pytest
import torch
from make_reference import OUT, corpus_sha256, trained_parameters

REFERENCE = json.loads(OUT.read_text())


@pytest.fixture(scope="module")
def same_corpus() -> None:
    """Skip where this Python's pydoc topics (the built-in corpus) are not the ones the values were recorded on."""
    if corpus_sha256() != REFERENCE["corpus_sha256"]:
        pytest.skip("this Python's built-in corpus (pydoc_data.topics) differs from the recorded one's")


@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_parameters_after_50_windows_match_the_recorded_reference(case, same_corpus):
    ref = REFERENCE["cases"][case]
    params = trained_parameters(ref["preset"], ref["overrides"])
    assert list(params) == list(ref["params"])  # same names, same order
    for name, want in ref["params"].items():
        got = params[name]
        assert list(got.shape) == want["shape"], name
        values = got.reshape(-1)[want["positions"]]
        torch.testing.assert_close(
            values,
            torch.tensor(want["values"], dtype=torch.float64),
            rtol=1e-10,
            atol=1e-12,
            msg=lambda m, n=name: f"{n}: {m}",
        )
        assert float(got.norm()) == pytest.approx(want["norm"], rel=1e-10), name

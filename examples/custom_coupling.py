"""A coupling of your own: written in this file, named in the config by its dotted path `custom_coupling.GaussianDense`.

    python examples/custom_coupling.py

A coupling is one term of the energy with its analytic pulls, EP statistic and spectral cap (trainer2.Coupling lists
them). Subclassing a built-in one and changing one part is the short way: here the initial weights are drawn from a
normal distribution instead of a uniform one. The dotted name is written to config.yaml and the checkpoint, so the run
resumes wherever `custom_coupling` imports; a file is data, never code, so `trainer2.load(checkpoint, trust_code=True)`
(or `--trust_code`) says you consent to import the module it names.
"""

import math

import numpy as np
import torch

import trainer2


class GaussianDense(trainer2.Dense):
    """A dense coupling whose initial weights are normal with standard deviation scale / sqrt(fan_in)."""

    @classmethod
    def init(cls, name, below, spec, scale, gen, dtype):
        fan_in, fan_out = math.prod(below), math.prod(cls.spec_size(spec))
        weight = torch.randn(fan_out, fan_in, generator=gen, dtype=dtype) * (scale / math.sqrt(fan_in))
        return cls(name, weight, torch.zeros(fan_out, dtype=dtype))


if __name__ == "__main__":  # the config imports this module by name, which must not train again
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, size=1500)
    x = (rng.normal(size=(3, 12))[y] + rng.normal(size=(1500, 12))).astype(np.float32)
    cfg = trainer2.config("dev", max_windows=200, eval_every_windows=0, layers=[{"custom_coupling.GaussianDense": 64}])
    run = trainer2.train(cfg, trainer2.from_arrays(x, y, heldout_fraction=0.2))
    print(f"{type(run.model.machine.energy.couplings[0]).__name__}: held-out accuracy {run.summary['heldout_acc']:.3f}")

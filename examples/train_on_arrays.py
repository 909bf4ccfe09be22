"""Train on arrays already in memory, predict, reload the model from its checkpoint, report held-out accuracy.

    python examples/train_on_arrays.py

Four classes of 20-feature vectors around random centres; any float features [N, D] or images [N, (C,) H, W] with
integer labels 0..K-1 train the same way.
"""

import numpy as np

import trainer2

rng = np.random.default_rng(0)
y = rng.integers(0, 4, size=2000)
x = (rng.normal(size=(4, 20))[y] + rng.normal(size=(2000, 20))).astype(np.float32)

cfg = trainer2.config("dev", max_windows=300, eval_every_windows=0)  # a preset, then overrides
data = trainer2.from_arrays(x[:1600], y[:1600], x[1600:], y[1600:])  # train and held-out splits
run = trainer2.train(cfg, data)  # writes checkpoints/run-<N>/; run.summary is its summary.json
pred = run.model.predict(x[1600:])  # class ids, one free-phase relaxation per example
model = trainer2.load(run.checkpoint)  # the trained model, from its final checkpoint
assert (model.predict(x[1600:]) == pred).all()
print(f"held-out accuracy {np.mean(pred == y[1600:]):.3f} ({run.checkpoint})")

"""trainer2: physics-style learning machines trained by Equilibrium Propagation, with no autograd.

    import trainer2
    cfg = trainer2.config("dev", max_windows=300)              # a preset (or YAML path) and overrides
    data = trainer2.from_arrays(x_train, y_train, x_test, y_test)
    run = trainer2.train(cfg, data, run_dir="runs/a")           # -> Run: run.model, run.summary, run.checkpoint
    pred = run.model.predict(x_test)                            # class ids; predict_proba(x), evaluate(data)
    model = trainer2.load(run.checkpoint)                       # the same predictions as run.model
    best = trainer2.sweep("space.yaml", "dev", data, trials=20)  # Optuna over the space's fields (the sweep extra)

Couplings are components: trainer2.Dense, trainer2.Conv and trainer2.Conv1d (along a text context) are the built-in
ones, and a class of your own (written to the trainer2.Coupling protocol, most simply a subclass of one of them) is
named in `layers` by its dotted path.
"""

from trainer2.components import ComponentError, UntrustedCodeError
from trainer2.data.arrays import from_arrays
from trainer2.data.dataset import DataError, Dataset, LabelWarning
from trainer2.physics.couplings import Conv, Conv1d, Coupling, Dense
from trainer2.presets import config
from trainer2.running.checkpoint import CheckpointError
from trainer2.running.health import Diverged
from trainer2.running.model import Model, load
from trainer2.running.run import Run, train
from trainer2.running.rundir import RunDirError
from trainer2.running.sweep import sweep
from trainer2.section import ConfigError
from trainer2.train_config import TrainConfig

__all__ = [
    "CheckpointError",
    "ComponentError",
    "ConfigError",
    "Conv",
    "Conv1d",
    "Coupling",
    "DataError",
    "Dataset",
    "Dense",
    "Diverged",
    "LabelWarning",
    "Model",
    "Run",
    "RunDirError",
    "TrainConfig",
    "UntrustedCodeError",
    "config",
    "from_arrays",
    "load",
    "sweep",
    "train",
]

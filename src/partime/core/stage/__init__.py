"""One stage of a pipeline, and what it is made of.

- ``stage``: ``Stage``, a slice of the model with its forward, loss, backward and step;
- ``config``: ``StageConfig``, what every stage of a pipeline shares (depth, loss, optimizer
  factory, grad mode, compensation);
- ``learning``: how a learning stage steps, with the compensation of its delay;
- ``record``: what a stage keeps of a forward for its late gradient;
- ``kept_graph``: a forward's graph kept across the stage's steps (``graph-stash``);
- ``tensor_slots``: running a forward with other weights in the module's own slots;
- ``random_stream``: the stage's own random stream, replayed for a forward run again.
"""

from .config import (
    DEFAULT_GRAD_MODE,
    GRAD_MODES,
    NONFINITE,
    LossFn,
    OptimizerFactory,
    StageConfig,
    check_loss_fn,
    takes_target,
)
from .record import value_of
from .stage import Learnt, Stage

__all__ = [
    "DEFAULT_GRAD_MODE",
    "GRAD_MODES",
    "NONFINITE",
    "Learnt",
    "LossFn",
    "OptimizerFactory",
    "Stage",
    "StageConfig",
    "check_loss_fn",
    "takes_target",
    "value_of",
]

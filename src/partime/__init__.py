"""partime: a deep network that keeps up with a stream.

An ``nn.Sequential`` is cut into D contiguous stages that work at once on D different samples,
for inference and for online learning; see SPEC.md for what is computed at every tick.
"""

from .checkpoint.files import CheckpointError
from .core.stage.config import GRAD_MODES
from .errors import PipelineClosedError, StageError, StageTimeoutError, WorkerDiedError
from .executors import EXECUTORS
from .pipeline.pipeline import Pipeline
from .planning.partition import Partition
from .result import Result

__all__ = [
    "EXECUTORS",
    "GRAD_MODES",
    "CheckpointError",
    "Partition",
    "Pipeline",
    "PipelineClosedError",
    "Result",
    "StageError",
    "StageTimeoutError",
    "WorkerDiedError",
]
__version__ = "0.1.0"

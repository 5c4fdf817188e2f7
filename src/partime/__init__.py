"""partime: a deep network that keeps up with a stream.

An ``nn.Sequential`` is cut into D contiguous stages that work at once on D different samples,
for inference and for online learning; see SPEC.md for what is computed at every tick.
"""

import importlib.metadata

from .checkpoint.files import CheckpointError
from .core.stage.config import GRAD_MODES, GradMode
from .errors import PipelineClosedError, StageError, StageTimeoutError, WorkerDiedError
from .executors import EXECUTORS, ExecutorName
from .pipeline.pipeline import Pipeline
from .planning.partition import Partition
from .result import Result
from .stats import StageStats

__all__ = [
    "EXECUTORS",
    "GRAD_MODES",
    "CheckpointError",
    "ExecutorName",
    "GradMode",
    "Partition",
    "Pipeline",
    "PipelineClosedError",
    "Result",
    "StageError",
    "StageStats",
    "StageTimeoutError",
    "WorkerDiedError",
]
try:
    # The one version is pyproject's, read from the installed distribution.
    __version__ = importlib.metadata.version("partime")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

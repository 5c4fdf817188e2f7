"""The one seam into partime's parts, for those who measure them apart.

Everything a user needs is in ``partime`` and its public modules (``partime.sources``,
``partime.metrics``, ``partime.streams``, ``partime.video``, ``partime.checkpoint``). This module is for microbenchmarks
and experiments that time or swap a piece of the pipeline on its own: a stage as its worker runs
it, the shared-memory channel and semaphores between processes, the link between ranks, the cut of
a model into stages, and what "auto" picks.

No promise of stability is made for these names: they follow partime's insides from one version
to the next, and the tools that ship with partime (``partime_tools``) and the scripts in
``experiments/`` are their only intended users. Nothing inside partime imports this module, those
users take nothing from partime but its public names and these, and every name here has one of them
as a user (``tests/test_imports.py``).
"""

from .core.boundary_values import TensorSpec, as_tensors
from .core.stage import Stage, StageConfig
from .core.stage.config import DEFAULT_GRAD_MODE
from .executors.distributed.link import LINK_TIMEOUT_S, RankLink
from .executors.distributed.ranks import Run, join_group
from .executors.driver import Driver
from .executors.malloc import keep_freed_memory
from .executors.messages import KIND_DATA, KIND_END
from .executors.process.semaphore import SharedSemaphore
from .executors.process.shared_memory import Channel, Flag
from .executors.waiting import POLL_S, SPIN_S, Aborted
from .learning.compensation import AUTO, AUTOMATIC, check_compensation
from .learning.optimizer_state import OPTIONS as OPTIMIZER_STATE_COMPENSATIONS
from .pipeline.arrivals import inbox, newest
from .planning.partition import split
from .planning.planner import plan, torch_threads
from .traced.fused import Fused, fused
from .traced.tracing import layers_of

__all__ = [
    "AUTO",
    "AUTOMATIC",
    "DEFAULT_GRAD_MODE",
    "KIND_DATA",
    "KIND_END",
    "LINK_TIMEOUT_S",
    "OPTIMIZER_STATE_COMPENSATIONS",
    "POLL_S",
    "SPIN_S",
    "Aborted",
    "Channel",
    "Driver",
    "Flag",
    "Fused",
    "RankLink",
    "Run",
    "SharedSemaphore",
    "Stage",
    "StageConfig",
    "TensorSpec",
    "as_tensors",
    "check_compensation",
    "fused",
    "inbox",
    "join_group",
    "keep_freed_memory",
    "layers_of",
    "newest",
    "plan",
    "split",
    "torch_threads",
]

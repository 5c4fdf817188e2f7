"""What fidelity measures: the streams, optimizers, grad modes and compensations.

``Config`` is one run; ``compensations`` says which compensations each grad mode is measured
with, ``choices`` the names by which a user picks among them and ``picked`` whether a run is
picked. The step sizes are chosen in ``fidelity_tuning``. Pure data: nothing here trains or times.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import cast

from partime import GRAD_MODES
from partime.internals import AUTO, AUTOMATIC, OPTIMIZER_STATE_COMPENSATIONS, StageConfig

STREAMS = ("digits", "shuffled", "camera")
OPTIMIZERS = ("sgd", "momentum", "adam", "nadam", "muon")
DEFAULT_GRAD_MODE = cast(str, StageConfig.__dataclass_fields__["grad_mode"].default)
"""The grad mode a ``Pipeline`` learns with when none is chosen."""
DEFAULT = "default"
"""The choice of what a ``Pipeline`` learns with when nothing is chosen: ``DEFAULT_GRAD_MODE``
with ``compensation="auto"``."""
DIGITS_LR = 0.07  # plain SGD's best step size for sequential learning of moving digits
_STASH = (
    "",
    "delay-correction",
    "step-scale",
    "optimizer-prediction",
    "optimizer-prediction+long-momentum",
    "spike",
    AUTO,
)
# The compensations each grad mode is measured with ("+" joins options used together; "auto": what
# compensation="auto" chooses for the optimizer); a grad mode missing here is measured plain. The
# optimizer-aware options need the optimizer's momentum (plain SGD has none, and its prediction is
# its weights), and with a prediction both stash modes compute the same (the predicted weights are
# stashed). "graph-stash" is measured wherever partime.GRAD_MODES has it.
COMPENSATIONS = {
    "partime": ("",),
    "weight-stash": ("", "delay-correction"),
    "stash": _STASH,
    "graph-stash": _STASH,
}
STATE_READ = ("momentum", "adam")
"""The optimizers whose state the optimizer-aware compensations read (partime's
``OPTIMIZER_STATE_COMPENSATIONS``): SGD with momentum, Adam."""
CUTS = ("fixed", "planned", "even")

FIXED_CUTS: dict[tuple[str, int], tuple[int, ...]] = {
    ("digits", 2): (3, 7),
    ("digits", 4): (2, 1, 2, 5),
    ("digits", 8): (1, 1, 1, 1, 1, 1, 1, 3),
    ("camera", 2): (4, 4),
    ("camera", 4): (2, 2, 2, 2),
    ("camera", 8): (1, 1, 1, 1, 1, 1, 1, 1),
}
"""Layers per stage of each model (``"digits"``, the shuffled stream's too, or ``"camera"``) at
each depth the fidelity bench runs by default: cuts that a learning ``Pipeline(balance=D)`` chose
on the 2-core development VM, fixed here so that the figures do not follow the timings of the
machine that runs them (a planned cut does: on these small models two cuts are often within the
planner's margins of each other, and the camera at D = 2 was planned [2, 6] on some runs and
[4, 4] on others)."""


def automatic(optimizer: str) -> str:
    """What ``compensation="auto"`` chooses for ``optimizer``, as a fidelity compensation."""
    return "+".join(AUTOMATIC[optimizer])


def compensations(grad_mode: str, optimizer: str) -> tuple[str, ...]:
    """The compensations measured with ``grad_mode`` under ``optimizer``, ``"auto"`` resolved
    (``DEFAULT_GRAD_MODE`` is always measured with it: the default is measured)."""
    resolved = [automatic(optimizer) if c == AUTO else c for c in COMPENSATIONS.get(grad_mode, ("",))]
    names = [
        c
        for c in resolved
        if optimizer in STATE_READ or not any(option in OPTIMIZER_STATE_COMPENSATIONS for option in c.split("+"))
    ]
    if grad_mode == DEFAULT_GRAD_MODE:
        names.append(automatic(optimizer))
    return tuple(dict.fromkeys(names))


def choice(grad_mode: str, compensation: str) -> str:
    """The name by which a user picks a grad mode and compensation: ``"stash+delay-correction"``."""
    return "+".join(n for n in (grad_mode, compensation) if n)


def choices(optimizers: Sequence[str]) -> tuple[str, ...]:
    """The names a user may pick configurations by, with any of ``optimizers``: ``DEFAULT``, and
    ``choice`` of each grad mode of ``GRAD_MODES`` and each of its compensations."""
    names = [DEFAULT] + [
        choice(mode, comp) for opt in optimizers for mode in GRAD_MODES for comp in compensations(mode, opt)
    ]
    return tuple(dict.fromkeys(names))


def picked(grad_mode: str, compensation: str, optimizer: str, only: Collection[str] | None) -> bool:
    """Whether ``only`` (names of ``choices``; None: all) picks ``grad_mode`` with ``compensation``
    under ``optimizer``: by its ``choice``, or as ``DEFAULT``."""
    if only is None or choice(grad_mode, compensation) in only:
        return True
    return DEFAULT in only and (grad_mode, compensation) == (DEFAULT_GRAD_MODE, automatic(optimizer))


@dataclass(frozen=True)
class Config:
    """One run: a stream learnt by a D-stage pipeline (D = 1: sequential)."""

    stream: str
    depth: int
    grad_mode: str = "partime"
    compensation: str = ""
    seed: int = 0
    balance: tuple[int, ...] | None = None  # layers per stage; None: even
    optimizer: str = "sgd"
    lr: float = DIGITS_LR

    @property
    def label(self) -> str:
        if self.depth == 1:
            return "sequential"
        return f"D={self.depth} {self.grad_mode}" + "".join(f" + {c}" for c in self.compensation.split("+") if c)

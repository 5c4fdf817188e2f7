"""What fidelity measures: the streams, optimizers, step sizes, grad modes and compensations.

``Config`` is one run; ``compensations`` says which compensations each grad mode is measured
with, ``tuning_configs`` the sequential runs that choose each step size and ``best_step_sizes``
the step size they choose. Pure data: nothing here trains or times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import lookahead
from ..compensation import AUTOMATIC

STREAMS = ("digits", "shuffled", "camera")
GRAD_MODES = ("partime", "stash", "weight-stash")
OPTIMIZERS = ("sgd", "momentum", "adam")
LR_GRID = {
    "sgd": (0.03, 0.1, 0.3, 1.0, 3.0),
    "momentum": (0.003, 0.01, 0.03, 0.1, 0.3),
    "adam": (3e-4, 1e-3, 3e-3, 1e-2),
}
"""The step sizes tried for sequential learning; each stream and optimizer learns with its best."""
TUNING_SEED = 0
"""The seed whose sequential runs choose the step size."""
DIGITS_LR = 0.07  # plain SGD's best step size for sequential learning of moving digits
# The compensations each grad mode is measured with ("+" joins options used together), beside what
# the default, compensation="auto", chooses for the optimizer. The optimizer-aware options need the
# optimizer's momentum (plain SGD has none, and its prediction is its weights), and with a
# prediction both stash modes compute the same (the predicted weights are stashed).
COMPENSATIONS = {
    "partime": ("",),
    "weight-stash": ("", "delay-correction"),
    "stash": (
        "",
        "delay-correction",
        "step-scale",
        "optimizer-prediction",
        "optimizer-prediction+long-momentum",
        "spike",
    ),
}
CUTS = ("planned", "even")


def automatic(optimizer: str) -> str:
    """What ``compensation="auto"`` chooses for ``optimizer``, as a fidelity compensation."""
    return "+".join(AUTOMATIC[optimizer])


def compensations(grad_mode: str, optimizer: str) -> tuple[str, ...]:
    """The compensations measured with ``grad_mode`` under ``optimizer`` (with ``stash``, the
    default's choice among them)."""
    names = [
        c
        for c in COMPENSATIONS[grad_mode]
        if optimizer != "sgd" or not any(option in lookahead.OPTIONS for option in c.split("+"))
    ]
    if grad_mode == "stash":
        names.append(automatic(optimizer))
    return tuple(dict.fromkeys(names))


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


StepSizes = dict[tuple[str, str], float]
"""The step size of each (stream, optimizer)."""


def tuning_configs(stream_names: Sequence[str], optimizers: Sequence[str]) -> list[Config]:
    """Sequential learning of each stream with each optimizer at every step size of its grid."""
    return [
        Config(stream, 1, seed=TUNING_SEED, optimizer=opt, lr=lr)
        for stream in stream_names
        for opt in optimizers
        for lr in LR_GRID[opt]
    ]


def best_step_sizes(rows: Sequence[dict[str, Any]]) -> StepSizes:
    """For each (stream, optimizer) among ``rows``, the step size whose run scored best (a
    diverged run never wins): the highest accuracy, or the lowest loss on the camera."""
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for row in rows:
        key = (row["stream"], row["optimizer"])
        if row["stream"] == "camera":
            score = -row["loss"] if row["loss"] is not None else -math.inf
        else:
            score = row["accuracy"] if row["diverged_at"] is None else -math.inf
        if key not in best or score > best[key][0]:
            best[key] = (score, row["lr"])
    return {key: lr for key, (_, lr) in best.items()}

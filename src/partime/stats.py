"""``StageStats``: what one stage of a running pipeline reports of itself (``Pipeline.stats``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StageStats:
    """Stage ``stage``'s statistics, as its worker last wrote them (``Pipeline(stats=True)``).

    ``ticks``: the ticks it has run since the stages started (a tick with no work for it, in the
    warm-up or the flush, counts too); ``steps``: the optimizer steps it has taken (0 for a
    pipeline that infers, and for a stage with nothing to learn).

    ``lrs``: the lr of each of its optimizer's param groups now, as the optimizer holds it (after
    the scheduler's step that follows each optimizer step; a step-size compensation scales the
    steps, not the lr); ``()`` without an optimizer. ``grad_norm``: the 2-norm, over the stage's
    own parameters (and the loss's, at the last stage), of the gradient its last step was given,
    before clipping: what ``torch.nn.utils.clip_grad_norm_`` returns there; None before its first
    step, or when it does not learn.

    ``tick_seconds``: how long its last tick worked (forward, loss, backward, step, sends);
    ``wait_seconds``: how long the stage waited since the tick before it: for the tick to be offered
    (the caller to feed a sample; in the inline executor, the stages before it to run) and for what
    the tick takes in (the sample or activation, the gradient, the target). Over a run, a stage's
    ticks and waits within a stream add up to its time there: the slowest stage waits least. ``total_tick_seconds`` and
    ``total_wait_seconds``: the same, summed over every tick; between two reads, their differences
    over the difference of ``ticks`` are the mean tick and wait.
    """

    stage: int
    ticks: int
    steps: int
    lrs: tuple[float, ...]
    grad_norm: float | None
    tick_seconds: float
    wait_seconds: float
    total_tick_seconds: float
    total_wait_seconds: float

    @property
    def lr(self) -> float | None:
        """The first param group's lr (None without an optimizer): the lr, for an optimizer of one group."""
        return self.lrs[0] if self.lrs else None

    @property
    def mean_tick_seconds(self) -> float:
        """The mean time of a tick, waits left out, over every tick so far (NaN before the first)."""
        return self.total_tick_seconds / self.ticks if self.ticks else math.nan

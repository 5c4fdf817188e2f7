"""``Result``: what one sample yields, handed out in sample order."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass
class Result:
    """What one sample yields: its index, the pipeline's output and, when learning, its loss.

    ``output`` is what the model returns: a tensor or a flat tuple of tensors; for a model traced
    on a sample (``Pipeline(sample=...)``), what its forward returns, such as a ``ModelOutput``.

    ``skipped`` under ``nonfinite="skip"``: the sample did not take part in learning. Its input
    was not finite (then ``output`` and ``loss`` are None: it never went forward), or its loss
    was not finite (then both are there, and no gradient was applied for it). ``dropped`` under
    ``when_behind="drop"``: the sample arrived while an earlier one still waited to go in, and a
    later one replaced it; it never went forward (``output`` and ``loss`` are None). ``target`` is
    the sample's target (a copy) when one was given and the sample went in, so that a result can
    be scored on its own.

    ``predicted``: the sample was offered to be predicted, not learnt from, in a pipeline that learns
    (``Pipeline.predict``, ``step(x, learn=False)``): it went forward through the weights of its
    ticks, in its place among the learnt samples, and ``output`` is what they gave it; ``loss`` is
    None, and no stage stepped for it. (One whose input is not finite, under ``nonfinite="skip"``,
    is ``skipped`` as any other: it never went forward.)

    ``offered_at`` is when the sample arrived (a live source's arrival time, or when the pipeline
    was given it) and ``handed_at`` when its result was handed out, in seconds on the stream's
    clock (``partime.sources``: a ``Paced`` source's own, else ``time.monotonic``); NaN for a
    sample offered before a checkpoint was loaded (its arrival was not kept).
    """

    index: int
    output: Any
    loss: float | None = None
    skipped: bool = False
    target: Tensor | tuple[Tensor, ...] | None = None
    dropped: bool = False
    offered_at: float = math.nan
    handed_at: float = math.nan
    predicted: bool = False

    @property
    def latency(self) -> float:
        """Seconds from the sample's arrival to its result's hand-out (``handed_at - offered_at``)."""
        return self.handed_at - self.offered_at

"""``PipelineState``: where a pipeline's stream stands, the part of it that a checkpoint keeps
beside the stages' own states.

A segment is the run of samples fed since the last flush. Of its ``in_segment`` samples, the first
``in_segment - (D - 1)`` have left a pipeline of D stages; ``taken`` of those were handed out::

    fed:       0 1 2 3 4 5 6 7        next_index = 8, D = 3
    segment:         3 4 5 6 7        in_segment = 5 (a flush ended the one before sample 3)
    left:            3 4 5            5 - (3 - 1) = 3
    handed out:      3                taken = 1; due: 4 and 5
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..core.boundary_layout import Layout
from ..core.boundary_values import ValueSpec, check_like, spec_of
from ..result import Result


@dataclass
class PipelineState:
    """A pipeline's counters, what it learnt from the first sample, and what it holds for the caller."""

    next_index: int = 0
    """The index the next sample offered gets: every sample offered so far, refused ones too."""
    in_segment: int = 0
    """Samples fed since the segment began."""
    taken: int = 0
    """Results handed out since the segment began."""
    supervised: bool | None = False
    """Whether samples come with a target; None while the loss's signature does not say and no
    sample has been fed (the first one decides)."""
    x_spec: ValueSpec | None = None
    """The layout of every sample, fixed by the first one."""
    y_spec: ValueSpec | None = None
    """The layout of every target, fixed by the first one."""
    held: deque[Result] = field(default_factory=deque)
    """Results taken from the executor for a checkpoint and not handed out yet."""
    given: deque[tuple[int, Any]] = field(default_factory=deque)
    """``(index, target)`` of the samples fed with a target whose results are not handed out yet."""
    offered: deque[tuple[int, float]] = field(default_factory=deque)
    """``(index, arrival time)`` of the samples fed whose results are not handed out yet (not
    kept by a checkpoint: a clock's times mean nothing to another process)."""
    dropped: deque[Result] = field(default_factory=deque)
    """The results of samples dropped under ``when_behind="drop"``, not handed out yet: each goes
    out once every sample before it has."""
    resume: dict[str, Any] | None = None
    """A loaded checkpoint: the executor starts from it (at ``start()``, the next sample or flush),
    and until it has run a tick from it, it is the pipeline's checkpoint as it was loaded."""
    layout: Layout | None = None
    """Every boundary's layout, once the executor has started."""
    ahead: bool = False
    """Whether the executor started from a sample before any was fed (``Pipeline.start``) and has
    run no tick since: the pipeline's checkpoint is then that of a pipeline not started."""

    def due(self, depth: int) -> int:
        """How many results have left a pipeline of ``depth`` stages and not been handed out."""
        return max(0, self.in_segment - (depth - 1)) - self.taken

    def check_sample(self, index: int, x: Any, y: Any, learning: bool, predicted: bool = False) -> None:
        """A TypeError or ValueError unless sample ``index`` (and its target ``y``, or None) has the
        layout of the first one; the first sample fixes the layouts (and, if the loss does not say,
        whether samples come with a target). A ``predicted`` sample may come without its target."""
        if self.x_spec is None:
            self.x_spec = spec_of(x, f"sample {index}")
        else:
            check_like(x, self.x_spec, f"sample {index}")
        if self.supervised is None and (y is not None or not predicted):  # the first target decides
            self.supervised = y is not None
        if self.supervised and y is None and not predicted:
            raise ValueError(f"loss_fn takes a target, but sample {index} came without one (pass y= or ys=)")
        if not self.supervised and y is not None:
            what = "this pipeline has no loss" if not learning else "loss_fn takes no target"
            raise ValueError(f"sample {index} came with a target, but {what}")
        if y is not None:
            if self.y_spec is None:
                self.y_spec = spec_of(y, f"target of sample {index}")
            else:
                check_like(y, self.y_spec, f"target of sample {index}")

    def fed(self, index: int, y: Any, at: float) -> None:
        """Note that sample ``index``, which arrived at ``at``, went in with target ``y`` (the
        pipeline's own copy, kept for its result)."""
        if y is not None:
            self.given.append((index, y))
        self.offered.append((index, at))
        self.next_index += 1
        self.in_segment += 1
        self.ran()

    def drop(self, at: float) -> None:
        """Note that the next sample, which arrived at ``at``, was dropped: its index is used up, and
        its result waits for those of the samples before it."""
        self.dropped.append(Result(self.next_index, None, dropped=True, offered_at=at))
        self.next_index += 1

    def next_is_dropped(self) -> bool:
        """Whether the next result to hand out is a dropped sample's (no sample before it is in flight)."""
        return bool(self.dropped) and (not self.offered or self.dropped[0].index < self.offered[0][0])

    def handed_out(self, result: Result, now: float) -> Result:
        """Note that ``result`` goes to the caller at ``now``; it gets its sample's target, if one
        was given, and its arrival time."""
        result.handed_at = now
        if result.dropped:
            return result
        self.taken += 1
        while self.given and self.given[0][0] < result.index:  # not in flight any more (a checkpoint dropped it)
            self.given.popleft()
        if self.given and self.given[0][0] == result.index:
            result.target = self.given.popleft()[1]
        while self.offered and self.offered[0][0] < result.index:
            self.offered.popleft()
        if self.offered and self.offered[0][0] == result.index:
            result.offered_at = self.offered.popleft()[1]
        return result

    def flushed(self) -> None:
        """Note that every sample of the segment was handed out: the next sample begins a new one."""
        self.in_segment = self.taken = 0
        self.ran()

    def ran(self) -> None:
        """Note that the executor has run a tick: the state it holds is the pipeline's now, no
        loaded checkpoint's and no unstarted pipeline's."""
        self.resume = None
        self.ahead = False

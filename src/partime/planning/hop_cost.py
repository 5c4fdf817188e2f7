"""What a boundary between two stages costs them, per tick.

A stage of a pipeline of two or more pays, at every tick, beyond its layers' compute: the Python
work of the tick in its worker (``TICK_OVERHEAD_S``), and the copies of the tensors that cross
each boundary it touches. Through the process executor's shared memory an activation is copied
once by the stage that sends it (into a preallocated slot) and once by the stage that takes it (a
clone out of the slot); when learning, its gradient goes back the same way. So a boundary costs
*each* of the two stages beside it one copy of what crosses it forward, plus, when learning, one
copy of its floating-point part (the gradient) back: ``HopMeter`` times exactly these copies with
``Tensor.copy_`` into preallocated buffers, during the profiling pass that times the layers.
``stage_hop`` adds them up for one stage. The sample's way into the first stage and the output's
way out of the last are the same at every depth, one stage included, and are not counted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.boundary_values import as_tensors

TICK_OVERHEAD_S = 40e-6
"""Seconds of Python work per tick in a stage that neither layers nor copies account for: waiting
on and posting the semaphores, writing and reading the message headers, the tick's bookkeeping
and, at the last stage (which the caller runs), the caller's own work per sample. Charged to every
stage of a pipeline of two or more, not to one stage alone (the model run as it is). A module
constant, read when a cut is planned. How it was measured: experiments/measured-and-not-kept.md."""

HOP_REPEATS = 5
"""How many timed copies of each boundary ``HopMeter`` takes the median of (after one untimed)."""


def stage_hop(start: int, stop: int, layers: int, hop_times: Sequence[float] | None, overhead: float) -> float:
    """Seconds per tick that the boundaries of the stage of layers ``start`` to ``stop - 1`` (of
    ``layers``) cost it: 0 for one stage of every layer (there is no boundary), else ``overhead``
    plus ``hop_times[start - 1]`` for its incoming boundary (if ``start > 0``) plus
    ``hop_times[stop - 1]`` for its outgoing one (if ``stop < layers``); ``hop_times[k - 1]`` is the
    cost of the boundary at cut position k, and None counts every boundary as free.

    Added in this order, always, so that a planner and a ``Partition`` get the very same float.
    """
    if start == 0 and stop == layers:
        return 0.0
    cost = overhead
    if hop_times is not None:
        if start > 0:
            cost += hop_times[start - 1]
        if stop < layers:
            cost += hop_times[stop - 1]
    return cost


class HopMeter:
    """The cost per tick, to each stage beside it, of every boundary of a model of ``layers``
    children: give it each child's output as the model computes it (``profile_layers``'s
    ``on_output``), then read ``hop_times`` and ``nbytes``.

    The boundary at cut position k carries child k - 1's output. Its cost is the median time of
    copying its tensors (``copy_`` into buffers allocated beforehand), plus, when ``learning``, of
    copying its floating-point tensors again (the gradient that comes back). On CUDA the device is
    synchronised around each timed copy. Each boundary takes ``2 * (repeats + 1)`` copies at most:
    far less than the forward that produced it.
    """

    def __init__(self, layers: int, *, learning: bool, repeats: int = HOP_REPEATS):
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"need repeats >= 1, got repeats={repeats!r}")
        self._learning = learning
        self._repeats = repeats
        self._seconds: list[float | None] = [None] * max(0, layers - 1)
        self._nbytes: list[int] = [0] * max(0, layers - 1)

    def __call__(self, child: int, output: object) -> None:
        """Time the boundary after ``child`` (its ``output``); nothing for the last child."""
        if not 0 <= child < len(self._seconds):
            return
        tensors = [t.detach() for t in as_tensors(output, f"the output of child {child}")]
        grads = [t for t in tensors if t.is_floating_point()] if self._learning else []
        self._nbytes[child] = sum(t.numel() * t.element_size() for t in (*tensors, *grads))
        self._seconds[child] = _copy_seconds(tensors, self._repeats) + _copy_seconds(grads, self._repeats)

    @property
    def hop_times(self) -> tuple[float, ...] | None:
        """Seconds per tick of each boundary, by cut position (1 to ``layers - 1``): ``[k - 1]`` is
        position k's; None until every boundary has been timed."""
        if any(s is None for s in self._seconds):
            return None
        return tuple(float(s) for s in self._seconds if s is not None)

    @property
    def nbytes(self) -> tuple[int, ...]:
        """Bytes copied per tick at each boundary, by cut position as ``hop_times`` (0 if not timed)."""
        return tuple(self._nbytes)


def _copy_seconds(tensors: list[Tensor], repeats: int) -> float:
    """Median seconds of copying ``tensors`` into buffers allocated beforehand; 0 for none."""
    if not tensors:
        return 0.0
    buffers = [torch.empty_like(t) for t in tensors]
    cuda = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    floor = time.get_clock_info("perf_counter").resolution
    times = []
    with torch.no_grad():
        for rep in range(repeats + 1):
            for d in cuda:
                torch.cuda.synchronize(d)
            start = time.perf_counter()
            for buffer, t in zip(buffers, tensors, strict=True):
                buffer.copy_(t)
            for d in cuda:
                torch.cuda.synchronize(d)
            if rep > 0:  # the first copy touches the buffers' pages for the first time
                times.append(max(time.perf_counter() - start, floor))
    return statistics.median(times)

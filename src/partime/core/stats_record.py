"""One stage's statistics record: written by whoever runs the stage, read by the caller at any time.

A ``StatsRecord`` is a small float64 tensor of fixed fields (a plain tensor for stages in the
caller's process, one in shared memory for a stage in a process of its own: ``shared=True``, and it
travels to the worker as a file descriptor). The stage's runner, its one writer, overwrites it after
every tick (``tick``); the caller reads it (``read``) without a lock, a message or a wait for the
stage: a read costs microseconds, whatever the stage is doing.

A read is kept whole by a sequence count (a seqlock): the writer makes the count odd before it
writes and even after; a reader copies the record and takes it if the count was the same even
number before and after, else copies again (up to ``READ_TRIES`` times: a writer may be paused in
the middle of a write for as long as the machine keeps it waiting, and a reader does not wait for
it), then gives the last whole copy it took (the record as it was before, a tick or more old). On
x86, whose stores are seen in the order they are made, a read is then never torn; on a CPU that
may reorder stores (ARM) a read may rarely mix two ticks' values of a few fields.

On a GPU stage the gradient norm is copied into the record without waiting for the device (into
pinned memory: ``pinned=True``), so a read may show the step before the last one's norm for as long
as the device is behind; nothing of the stage waits for a statistic.

A ``TickClock`` times a stage's ticks for its record: the span of a tick runs from the end of the
stage's previous tick in the segment (the tick's own start, for the first) to its end; the time
its receives wait for their message is waiting, and so is the time before the tick starts (for
its permit: for the caller to offer it, or, in the inline executor, for the stages before it to
run); the rest is its work.

Fields, by index: the sequence count, ticks, steps, the gradient norm (NaN: none yet), the last
tick's seconds and wait, their totals, the number of param groups, then the first ``LR_SLOTS`` lrs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..stats import StageStats
from .stage import Stage

log = logging.getLogger(__name__)

LR_SLOTS = 64
"""The param groups whose lr the record holds (an optimizer with more: the first ones, and a warning)."""

READ_TRIES = 100
"""How many copies a read takes at most before it gives the last whole one (see the module)."""

_COUNT, _TICKS, _STEPS, _NORM, _TICK_S, _WAIT_S, _TOTAL_TICK_S, _TOTAL_WAIT_S, _GROUPS, _LRS = range(10)


class TickClock:
    """Where a stage's time goes, tick by tick: its work, and its waits (see the module)."""

    def __init__(self) -> None:
        self.ended: float | None = None  # the end of the stage's previous tick (None: none yet)
        self.started = self.received = 0.0

    def start(self) -> None:
        """The tick starts now."""
        self.started, self.received = time.perf_counter(), 0.0

    def get(self, link: Any, check: Callable[[], None]) -> Any:
        """``link.get(check=check)``: the link's next message, its wait counted."""
        before = time.perf_counter()
        try:
            return link.get(check=check)
        finally:
            self.received += time.perf_counter() - before

    def end(self) -> tuple[float, float]:
        """The tick is over: the seconds of its work, and of its waits."""
        now = time.perf_counter()
        work = now - self.started - self.received
        span = now - (self.started if self.ended is None else self.ended)
        self.ended = now
        return work, span - work


class StatsRecord:
    """Stage statistics, written by one runner and read by anyone (see the module)."""

    def __init__(self, shared: bool = False, pinned: bool = False):
        cell = torch.zeros(_LRS + LR_SLOTS, dtype=torch.float64, pin_memory=pinned)
        cell[_NORM] = math.nan
        self._cell = cell.share_memory_() if shared else cell
        self._bind()
        self._steps = 0  # the steps written so far: a step's norm and lrs are written once
        self._norm: torch.Tensor | None = None  # the norm written last (a GPU stage's, copied without waiting)

    def _bind(self) -> None:
        self._values = self._cell.numpy()  # element writes through numpy: tens of nanoseconds each
        self._whole = self._values.copy()  # the last whole copy a read took (at first: as made, before any write)

    def __getstate__(self) -> dict[str, Any]:
        return {"cell": self._cell}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._cell = state["cell"]
        self._bind()
        self._steps, self._norm = int(self._values[_STEPS]), None

    def begin(self, stage: Stage) -> None:
        """``stage`` is built (or resumed): its lrs, before its first tick."""
        values = self._values
        values[_COUNT] += 1
        self._write_lrs(stage)
        values[_COUNT] += 1

    def tick(self, stage: Stage, seconds: float, waited: float) -> None:
        """``stage`` has run a tick that took ``seconds`` besides the ``waited`` seconds it waited
        for its inputs: count it, and note its step's gradient norm and lrs if it stepped."""
        values = self._values
        values[_COUNT] += 1
        values[_TICKS] += 1
        values[_TICK_S] = seconds
        values[_WAIT_S] = waited
        values[_TOTAL_TICK_S] += seconds
        values[_TOTAL_WAIT_S] += waited
        if stage.steps != self._steps:
            self._steps = stage.steps
            values[_STEPS] = stage.steps
            self._write_norm(stage.grad_norm)
            self._write_lrs(stage)
        values[_COUNT] += 1

    def read(self, index: int) -> StageStats:
        """Stage ``index``'s statistics now, whole (see the module)."""
        values = self._values
        for _ in range(READ_TRIES):
            before = values[_COUNT]
            copy = values.copy()
            if before % 2 == 0 and values[_COUNT] == before:
                self._whole = copy
                break
            time.sleep(0)  # let the writer finish
        fields = self._whole.tolist()  # Python floats
        norm = fields[_NORM]
        return StageStats(
            stage=index,
            ticks=int(fields[_TICKS]),
            steps=int(fields[_STEPS]),
            lrs=tuple(fields[_LRS : _LRS + min(int(fields[_GROUPS]), LR_SLOTS)]),
            grad_norm=None if math.isnan(norm) else norm,
            tick_seconds=fields[_TICK_S],
            wait_seconds=fields[_WAIT_S],
            total_tick_seconds=fields[_TOTAL_TICK_S],
            total_wait_seconds=fields[_TOTAL_WAIT_S],
        )

    def _write_norm(self, norm: torch.Tensor | None) -> None:
        if norm is None:
            return
        if norm.device.type == "cpu":
            self._values[_NORM] = float(norm)
            return
        # a device's norm: copied when the device gets there, the stage does not wait for it
        self._norm = norm.detach().to(torch.float64).reshape(1)
        self._cell.narrow(0, _NORM, 1).copy_(self._norm, non_blocking=self._cell.is_pinned())

    def _write_lrs(self, stage: Stage) -> None:
        optimizer = stage.optimizer
        groups = [] if optimizer is None else optimizer.param_groups
        if len(groups) > LR_SLOTS and self._values[_GROUPS] != len(groups):
            log.warning(
                "stage %d: its optimizer has %d param groups; its statistics hold the lrs of the first %d",
                stage.index,
                len(groups),
                LR_SLOTS,
            )
        self._values[_GROUPS] = len(groups)
        for k, group in enumerate(groups[:LR_SLOTS]):
            self._values[_LRS + k] = float(group["lr"])

"""The last stage, run by the caller itself in its own thread.

On a machine with as many cores as stages, a caller that only feeds samples and takes results is
one process more than there are cores: it takes a core from a stage at every tick, and every
sample costs a hand-over and a wake-up more. So the process executor runs its last stage in the
caller (as the distributed executor's rank 0 hosts a stage beside its caller): each tick the
caller offers, it runs that stage's tick itself (``worker_loop.segment``, the loop every worker runs),
after the other stages' workers have been offered it. The results and the targets then go
between the caller and that stage by reference (``Local`` links), and the last stage, which in
learning does the least (its gradient is never late), carries the caller's own work between two
samples (taking results, the user's loop).

A failure inside the hosted stage is raised as the ``StageError`` a worker would report (its
stage, the sample, the phase, with the exception as its ``__cause__``); what the caller's check
raises while the stage waits (another stage's failure, a timeout) goes through as it is. A
forward of the hosted stage that never returns holds the caller, as the plain model would.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Generator
from typing import Any

import torch

from ..core.stage import Stage
from .base import stage_error
from .handoff import Handoff
from .in_flight import stage_answer
from .malloc import keep_freed_memory
from .messages import Message
from .worker_loop import Links, Sent, Where, segment


class Local(Handoff):
    """A ``Handoff`` between the caller and the stage it hosts, in one thread: a ``get`` never waits,
    because the caller puts what the stage takes (a sample, a target) before it runs the tick, and
    takes a result only once the tick that makes it has run."""

    def get(self, *, check: Callable[[], None] | None = None) -> Message:
        try:
            return self._items.get_nowait()
        except queue.Empty:
            raise RuntimeError(
                f"link {self.name!r}: nothing was put to take (the caller would wait on itself)"
            ) from None


class Count:
    """A ``worker_loop.Gate`` kept in the caller's thread: the hosted stage's count of finished ticks
    (and its permits, which nobody waits for: the caller runs each tick it offers)."""

    def __init__(self) -> None:
        self.value = 0

    def release(self) -> None:
        self.value += 1

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        if self.value:
            self.value -= 1
            return True
        if blocking:
            raise RuntimeError("a count kept in the caller's thread would be waited for in that same thread")
        return False


class HostedStage:
    """``stage``, run in the caller one tick per ``run_tick``: the first segment on ``first`` from
    ``tick`` (a resumed stage's links and tick), every other on ``links``.

    While it is hosted, the caller's torch intra-op thread count is ``threads`` (torch counts them
    per calling thread); ``close`` gives the caller its own back.
    """

    def __init__(self, stage: Stage, links: Links, *, first: Links | None = None, tick: int = 0, threads: int = 1):
        self.stage, self.links = stage, links
        self.where, self.sent = Where(), Sent()
        self._check: Callable[[], None] = _nothing
        self._raised_by_check: BaseException | None = None
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        keep_freed_memory()  # for the caller too: no page faults for the activations of every tick
        self._ticks = self._segment(first or links, tick)

    def run_tick(self, check: Callable[[], None]) -> None:
        """Run the stage's next tick, asking ``check`` while it waits for its neighbours."""
        self._check = check
        try:
            try:
                next(self._ticks)
            except StopIteration as over:  # the segment is over: the next one begins
                self._ticks = self._segment(self.links, 0)
                if over.value:  # the tick was not run: it is the new segment's first
                    next(self._ticks)
        except Exception as exc:
            if exc is self._raised_by_check:
                raise  # another stage's failure, or a timeout: not this stage's
            raise stage_error(self.stage.index, self.where.sample, self.where.phase, exc) from exc

    def answer(self) -> dict[str, Any]:
        """The stage's part of a checkpoint, between two ticks (``in_flight.stage_answer``)."""
        return stage_answer(self.stage, self.sent)

    def close(self) -> None:
        """Give the caller back its own count of torch threads."""
        torch.set_num_threads(self._threads_before)

    def _segment(self, links: Links, tick: int) -> Generator[int, None, bool]:
        """A segment's ticks (``worker_loop.segment``), started up to its first tick."""
        ticks = segment(self.stage, links, self._checked, self.where, tick=tick, sent=self.sent)
        next(ticks)
        return ticks

    def _checked(self) -> None:
        """The caller's check, noting what it raises (so that ``run_tick`` tells it from the stage's own failure)."""
        try:
            self._check()
        except BaseException as exc:
            self._raised_by_check = exc
            raise


def _nothing() -> None:
    pass

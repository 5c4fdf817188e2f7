"""Turns at the process's random stream: who may draw from torch's CPU generator now.

The process's stream is one for all its threads (torch's CPU default generator, and dropout cannot
be given another), so its users take turns at it (``TURNS``, a ``Turns``):

- a stage's forward (its loss, a replay) holds the turn while the process's stream is the stage's:
  stages that draw run their forwards one at a time, whatever thread each runs in;
- a *caller*, the thread that drives a pipeline whose stages run in threads of their own (the
  thread executor), holds it whenever it runs the user's code: between partime's calls, while
  the user's iterator is asked for a sample, while a result is handed out. It gives the turn up
  only while it waits inside partime (``Turns.waiting``), so what the caller draws (a sample made
  with ``torch.randn``) is drawn from the caller's stream as with the inline executor, and never
  in a stage's;
- the thread that reads a live source (``arrivals.Threaded``) holds it around each ``next()`` of
  the source (``SourceReads``), so that a draw of the source's never lands in a stage's stream: a
  forward that draws waits for a read in progress. A source whose first read draws nothing (a
  camera) is read without it from then on;
- a pipeline that plans and starts (``Pipeline._running``) holds it too: it rolls back what it
  draws, and would roll a reader's draws back with it.

One thread may call several pipelines (a stream fed by another's): it is inside partime, and the
stages of each may draw, while it waits in any of them.

So with the thread executor a seeded stream of samples drawn lazily, through a model with dropout,
gives the inline executor's samples, outputs and losses, to the bit. What is not promised: draws
made by the user's own other threads (not the caller's, nor a source's read by partime) while a
stage's stream is swapped in, and the order of a live source's draws against the caller's.

A stage whose first forward draws nothing (``stage.random_stream.RandomStream``) says so
(``Turns.draws_nothing``); once every stage thread of a pipeline draws nothing, its caller holds
nothing either.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
D = TypeVar("D")

POLL_S = 0.05
"""How long a wait for the turn sleeps before it looks again (each change it waits for is notified):
a stage thread asks its check then, so that a pipeline closed while its caller runs the user's code
stops its threads within it."""


class Caller:
    """A pipeline whose stages run in threads of their own, as ``Turns`` counts it: the thread that
    calls it, how many of its stage threads may still draw, and whether it is closed."""

    def __init__(self, thread: int, drawers: int) -> None:
        self.thread, self.drawers, self.closed = thread, drawers, False


class Turns:
    """Who draws from the process's random stream now (see the module docstring).

    The state is a few counts under one condition, on a reentrant lock (a pipeline closed by the
    garbage collector, in whatever thread, may reach it while that thread holds it). Nobody holds
    the lock while it computes, reads a source or runs the user's code: it guards the counts only.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._swapped: int | None = None  # the thread whose stage's stream is the process's now
        self._depth = 0  # how deep that thread is in ``swapping`` (a replay inside a forward)
        self._readers: set[int] = set()  # the threads reading a source now (``reading``)
        # forwards waiting for the turn (thread -> its caller): a source's next read lets those first
        # that wait for nothing else (a stage thread whose caller runs the user's code waits for it)
        self._swaps_waiting: dict[int, Caller | None] = {}
        self._inside: dict[int, int] = {}  # callers' threads inside partime's waits: how deeply
        self._local = threading.local()  # a stage thread's ``Caller`` and ``check`` (``serving``)

    # -- stages -------------------------------------------------------------------------------

    @contextmanager
    def swapping(self) -> Iterator[None]:
        """Within it, this thread may swap a stage's stream in: no other stage has, no source is
        being read and, in a stage thread, its caller is not running the user's code. A stage thread
        waiting for it asks its check (``serving``) every ``POLL_S``: what that raises propagates."""
        me = threading.get_ident()
        with self._cond:
            if self._swapped == me:
                self._depth += 1
            else:
                caller, check = getattr(self._local, "caller", None), getattr(self._local, "check", None)
                self._swaps_waiting[me] = caller
                try:
                    while not self._may_swap(caller):
                        self._cond.wait(POLL_S)
                        if check is not None:
                            check()
                finally:
                    del self._swaps_waiting[me]
                    self._cond.notify_all()  # a reader that let it go first may read now
                self._swapped, self._depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:
                    self._swapped = None
                    self._cond.notify_all()

    def _may_swap(self, caller: Caller | None) -> bool:
        return self._swapped is None and not self._readers and self._callers_inside(caller)

    def _callers_inside(self, caller: Caller | None) -> bool:
        """Whether ``caller`` (a stage thread's, or None) lets its stage draw: it waits inside partime."""
        return caller is None or caller.closed or bool(self._inside.get(caller.thread))

    @contextmanager
    def serving(self, caller: Caller, check: Callable[[], None]) -> Iterator[None]:
        """The body of a stage thread of ``caller``: it swaps its stream in only while ``caller``'s
        thread waits inside partime, its waits for that ask ``check``, and a stream that draws
        nothing says so to ``caller`` (``draws_nothing``)."""
        self._local.caller, self._local.check, self._local.counted = caller, check, True
        try:
            yield
        finally:
            self.draws_nothing()
            self._local.caller = self._local.check = None

    def draws_nothing(self) -> None:
        """Called by a stream whose first forward drew nothing (and by a stage thread that ends):
        if it is a stage thread's, its caller need not hold the turn for it any more."""
        caller = getattr(self._local, "caller", None)
        if caller is not None and self._local.counted:
            self._local.counted = False
            with self._cond:
                caller.drawers -= 1

    # -- callers ------------------------------------------------------------------------------

    def call(self, drawers: int) -> Caller:
        """This thread drives a pipeline with ``drawers`` stage threads that may draw: from now on
        it holds the turn for them whenever it is not inside ``waiting``, until ``close``."""
        return Caller(threading.get_ident(), drawers)

    @contextmanager
    def waiting(self, caller: Caller | None, timeout: float | None = None) -> Iterator[None]:
        """Within it, ``caller``'s thread waits inside partime: its stage threads may draw. On the
        way out it holds the turn again once the stage drawing now (if any) is done; a
        ``TimeoutError`` naming that stage's thread if that takes longer than ``timeout``. A caller
        whose stage threads draw nothing, or closed, costs nothing here."""
        if caller is None or caller.drawers <= 0 or caller.closed:
            yield
            return
        me = threading.get_ident()
        with self._cond:
            caller.thread = me  # the thread that calls it now: a pipeline may change threads between calls
            self._inside[me] = self._inside.get(me, 0) + 1
            self._cond.notify_all()
        failed = True
        try:
            yield
            failed = False
        finally:
            with self._cond:
                self._inside[me] -= 1
                if not self._inside[me]:
                    del self._inside[me]
                    self._cond.notify_all()  # its stages' forwards wait again: a reader need not let them first
                # back to the user's code: no stage of its may have its stream swapped in any more
                patience = timeout if not failed else min(timeout or POLL_S, POLL_S)
                done = self._cond.wait_for(lambda: self._swapped in (None, me), patience)
                holder = self._holder_name()
            if not done and not failed:
                raise TimeoutError(f"{holder} has drawn from the process's random stream for over {timeout:g} s")

    def close(self, caller: Caller | None) -> None:
        """``caller``'s pipeline is closed (from any thread): its thread holds no turn for it now."""
        if caller is not None:
            with self._cond:
                caller.closed = True
                self._cond.notify_all()

    # -- a live source's reader -----------------------------------------------------------------

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Within it, this thread reads a source: no stage's stream is swapped in (a forward waiting
        for the turn goes first). Neither other readers nor callers are held back: the order of
        their draws against each other's is the threads' own."""
        me = threading.get_ident()
        with self._cond:
            while not (self._swapped is None and not self._swaps_ready()):
                self._cond.wait(POLL_S)  # notified when that changes; the poll only guards against a miss
            self._readers.add(me)
        try:
            yield
        finally:
            self.stop_reading(me)

    def stop_reading(self, thread: int | None) -> None:
        """``thread`` reads no source now: also said by whoever gives up on a reader blocked in its
        source for good (``arrivals.Threaded.close``), so that no forward waits for it."""
        with self._cond:
            if thread in self._readers:
                self._readers.discard(thread)
                self._cond.notify_all()

    def _swaps_ready(self) -> bool:
        """Whether a forward waits for the turn, and for nothing but the turn."""
        return any(self._callers_inside(caller) for caller in self._swaps_waiting.values())

    def _holder_name(self) -> str:
        names = {t.ident: t.name for t in threading.enumerate()}
        return f"thread {names.get(self._swapped, self._swapped)}"


class SourceReads(Generic[T]):
    """The reads of a live source by a thread of its own (``arrivals.Threaded``): each ``next()`` of
    it holds a reader's turn (``Turns.reading``), until one has drawn nothing: like a stage, a
    source whose first item was read without a draw is taken to draw nothing, and is read without
    the turn from then on (a camera, whose reads block for a frame, then never holds a forward up)."""

    def __init__(self, items: Iterator[T], turns: Turns) -> None:
        self._items, self._turns = items, turns
        self.draws: bool | None = None  # whether its reads draw; None until one has been read

    def next(self, default: D) -> T | D:
        """The source's next item, or ``default`` once it has ended."""
        if self.draws is False:
            return next(self._items, default)
        with self._turns.reading():
            before = torch.get_rng_state()
            item = next(self._items, default)
            if self.draws is None:  # a draw by the caller meanwhile counts too: then it is held, to be safe
                self.draws = not torch.equal(before, torch.get_rng_state())
        return item


TURNS = Turns()
"""The process's one ``Turns``: its random stream is one."""

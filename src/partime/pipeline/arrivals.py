"""What has arrived from a stream, and when: the reading side of ``when_behind`` (``newest``
serves a plain loop that reads a live source the same way).

``inbox(items, when_behind)`` opens one of three readers, each of which answers ``take()``: what
arrived since the last take, waiting until something has (``Arrived``; empty once the stream ends),
and ``begin()``, once the taker has taken the first item and is ready for the rest:

- ``Pulled``, a recorded stream (anything but a ``Paced`` source, under ``"wait"``): one item per
  take, read when it is taken, timed then on ``MONOTONIC``;
- ``Scheduled``, a ``Paced`` source: item ``k`` arrives at its time on the source's clock. Under
  ``"wait"`` a take sleeps until the next item's time (it is late if the taker was); under
  ``"drop"`` it reads every item that has arrived and keeps the newest;
- ``Threaded``, any other iterable under ``"drop"``: a thread reads it as fast as it yields (a
  camera's pace), timing each item as it comes and keeping only the newest waiting one.

Under ``"drop"`` a take keeps exactly one item, the newest, and gives the arrival times of those
it replaced (``dropped``): their items are let go as soon as a newer one arrives, so the memory a
reader holds is one item whatever the source's pace.

What the source raises is raised by a take once every item the source yielded before it has been
taken (kept or dropped): no item it gave is lost to its error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.random_turns import TURNS, SourceReads
from ..sources import MONOTONIC, Clock, Paced

log = logging.getLogger(__name__)

WhenBehind = Literal["wait", "drop"]
"""What ``Pipeline.stream(when_behind=...)`` takes, for a type checker: the values of ``WHEN_BEHIND``."""
WHEN_BEHIND: tuple[WhenBehind, ...] = ("wait", "drop")

JOIN_S = 0.1
"""How long closing a ``Threaded`` reader waits for its thread to finish the item it is reading:
a camera's next frame (33 ms at 30 fps) comes within it. A thread still reading then is blocked
in the source's own iterator; it is left to end, as the daemon thread it is, once that yields."""


@dataclass
class Arrived:
    """What one ``take`` found: the items kept, ``(item, arrival time)`` in order, and the arrival
    times of the items dropped before the first of them (newest last)."""

    kept: list[tuple[Any, float]] = field(default_factory=list)
    dropped: list[float] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.kept or self.dropped)


class Pulled:
    """A recorded stream, read one item per ``take``."""

    live = False

    def __init__(self, items: Iterable[Any]) -> None:
        self.clock: Clock = MONOTONIC
        self._items = iter(items)

    def take(self) -> Arrived:
        for item in self._items:
            return Arrived([(item, self.clock.now())])
        return Arrived()

    def begin(self) -> None:
        pass

    def close(self) -> None:
        pass


class Scheduled:
    """A ``Paced`` source, item ``k`` arriving at ``source.arrival(k, start)``. With ``drop``, a take
    keeps the newest item arrived (see the module docstring). What the source raises is raised by
    the take that reads it, or, if that take had found items before it, by the next one.

    ``start`` is the first take's time, until ``begin`` moves it to the time the taker has taken
    the first item: a simulated source waits for a pipeline to start (its workers, the timing of
    its layers) as a real one would not, so that what is measured is the pipeline's pace.
    """

    live = True

    def __init__(self, source: Paced[Any], drop: bool) -> None:
        self.clock = source.clock
        self._source, self._drop = source, drop
        self._items = iter(source.items)
        self._next = 0  # the index of the next item to read
        self._start: float | None = None
        self._error: Exception | None = None  # what the source raised after the items a take kept

    def take(self) -> Arrived:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._start is None:
            self._start = self.clock.now()
        arrival = self._source.arrival
        self.clock.sleep_until(arrival(self._next, self._start))  # nothing waits: then the next one
        found = Arrived()
        while True:
            at = arrival(self._next, self._start)
            if found.kept and (not self._drop or at > self.clock.now()):
                return found
            try:
                item = next(self._items, _END)
            except Exception as exc:
                if not found:
                    raise
                # the items read before it arrived, and the taker owes each a result: they come first
                self._error = exc
                return found
            if item is _END:
                return found
            self._next += 1
            if found.kept:
                found.dropped.append(found.kept.pop()[1])  # let go of the item at once
            found.kept.append((item, at))

    def begin(self) -> None:
        """The taker is ready: the next item arrives one period from now, and each after it a period later."""
        self._start = self.clock.now() - (self._next - 1) / self._source.fps

    def close(self) -> None:
        pass


class Threaded:
    """Any iterable read by a thread of its own as fast as it yields, each item timed as it comes;
    a take waits for an item and keeps the newest one waiting (see the module docstring).

    What the iterable raises is raised by the next take. Its ``next()`` holds a reader's turn at
    torch's random stream (``random_turns.SourceReads``): what the source draws is its own, and a
    stage's forward that draws waits for a read in progress; a source whose first read draws
    nothing (a camera) is read without it from then on.

    ``close`` asks the thread to stop and returns within ``JOIN_S``: the thread ends once the item
    it is reading has come. One that has not come by then (a source that stalled in its iterator)
    is not waited for: the thread, a daemon, is left blocked there and ends when the source yields,
    and a warning says so; its turn is given up for it, so that no forward waits for it.
    """

    live = True

    def __init__(self, items: Iterable[Any]) -> None:
        self.clock: Clock = MONOTONIC
        self._items = items
        self._ready = threading.Condition()
        self._waiting: tuple[Any, float] | None = None
        self._dropped: list[float] = []
        self._ended = False
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="partime-source", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            # what the source draws from torch's random stream stays out of the stages' (core.stage.random_stream)
            reads = SourceReads(iter(self._items), TURNS)
            while True:
                item = reads.next(_END)
                if item is _END:
                    break
                at = self.clock.now()
                with self._ready:
                    if self._waiting is not None:
                        self._dropped.append(self._waiting[1])
                    self._waiting = (item, at)
                    self._ready.notify()
                if self._stop.is_set():
                    return
        except Exception as exc:  # noqa: BLE001 - raised in the caller, by its next take
            self._error = exc
        with self._ready:
            self._ended = True
            self._ready.notify()

    def take(self) -> Arrived:
        with self._ready:
            self._ready.wait_for(lambda: self._waiting is not None or self._ended)
            found = Arrived([self._waiting] if self._waiting is not None else [], self._dropped)
            self._waiting, self._dropped = None, []
            if not found and self._error is not None:
                error, self._error = self._error, None
                raise error
            return found

    def begin(self) -> None:
        pass  # a source with a pace of its own does not wait for the taker

    def close(self) -> None:
        self._stop.set()
        # Past its own few lines the thread runs only the source's iterator, so one still alive
        # after a short wait is blocked in it, and nothing the caller does can end that sooner.
        self._thread.join(JOIN_S)
        if self._thread.is_alive():
            TURNS.stop_reading(self._thread.ident)  # what it draws once it wakes up is not kept apart any more
            log.warning(
                "the stream has ended, but the thread reading its source (%s) is still blocked in the "
                "source's iterator (it did not yield within %.1f s): it is a daemon thread, and it will "
                "end when the iterator yields (or the program exits)",
                _described(self._items),
                JOIN_S,
            )
        with self._ready:
            self._waiting = None  # let go of the newest item: nobody takes it now


def _described(items: object) -> str:
    """``items`` in a message: its type, and the name of a generator's function."""
    name = getattr(items, "__qualname__", None)
    return f"{type(items).__name__} {name}" if name else type(items).__name__


Inbox = Pulled | Scheduled | Threaded


def inbox(items: Iterable[Any], when_behind: str) -> Inbox:
    """The reader of ``items`` under ``when_behind`` (``"wait"`` or ``"drop"``): see the module docstring."""
    if when_behind not in WHEN_BEHIND:
        raise ValueError(f"when_behind must be one of {WHEN_BEHIND}, not {when_behind!r}")
    if isinstance(items, Paced):
        return Scheduled(items, drop=when_behind == "drop")
    return Threaded(items) if when_behind == "drop" else Pulled(items)


def newest(source: Iterable[Any]) -> Iterator[tuple[Any, float, int]]:
    """Read a live source as ``when_behind="drop"`` does, for a plain loop over the model: each
    time it is asked, the newest item arrived (waiting for one), its arrival time on the source's
    clock (a ``Paced`` source's own, else ``MONOTONIC``) and how many items it replaced. A
    ``Paced`` source begins once the loop has done its work on the first item."""
    reader = inbox(source, "drop")
    try:
        begun = False
        while found := reader.take():
            (item, at), *_ = found.kept
            yield item, at, len(found.dropped)
            if not begun:  # the loop has done its work on the first item: the rest may come
                reader.begin()
                begun = True
    finally:
        reader.close()


_END = object()

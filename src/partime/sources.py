"""Live sources: samples that arrive at their own pace, and the clocks they are timed on.

A recorded stream (a list, a tensor, a generator) is read as fast as the pipeline takes it: the
pipeline holds it back (``when_behind="wait"``). A live source does not wait: a camera's frame
exists at its time whether or not anyone is ready for it. ``at_rate`` makes any iterable such a
source, its ``k``-th item arriving ``k / fps`` seconds after the stream began, on a clock:

- ``MONOTONIC``, the real one (``time.monotonic``), which sleeps until an item's time;
- ``FakeClock``, for tests: time moves only when told (``advance``) or when someone sleeps until a
  later time, so every arrival, drop and latency is exact and repeatable.

``Pipeline.stream(at_rate(frames, 30), when_behind="drop")`` then keeps up with the source by
leaving out what it cannot take (SPEC.md, "Live sources"), and every ``Result`` carries when its
sample arrived (``offered_at``), when it was handed out (``handed_at``) and its ``latency``, on
the source's clock.

``video_frames`` decodes a video file (or a camera) into tensors with PyAV, and ``write_video``
encodes frames into a file; both need the ``video`` extra (``pip install 'partime[video]'``).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Iterable, Iterator
from typing import Generic, SupportsFloat, TypeVar

from .video import video_frames, write_video

T = TypeVar("T")


class Clock:
    """Seconds on a monotonic clock (``now``), and a way to wait for a later time (``sleep_until``)."""

    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, when: float) -> None:
        """Return once ``now()`` has reached ``when`` (at once if it has)."""
        while (left := when - time.monotonic()) > 0:
            time.sleep(left)

    def __repr__(self) -> str:
        return "MONOTONIC" if self is MONOTONIC else f"{type(self).__name__}()"


MONOTONIC = Clock()
"""The real clock: ``time.monotonic``; results of a stream that is no live source are timed on it."""


class FakeClock(Clock):
    """A clock for tests: it stands still until ``advance`` moves it, and ``sleep_until`` jumps to
    the time slept until (at once: nobody waits in real time).

    >>> from partime.sources import FakeClock
    >>> clock = FakeClock()
    >>> clock.advance(0.5)
    >>> clock.sleep_until(2.0)
    >>> clock.now()
    2.0
    """

    def __init__(self, start: float = 0.0) -> None:
        self.time = float(start)

    def now(self) -> float:
        return self.time

    def sleep_until(self, when: float) -> None:
        self.time = max(self.time, when)

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on (they must not be negative: it is monotonic)."""
        if seconds < 0:
            raise ValueError(f"a clock only moves on: advance({seconds}) would turn it back")
        self.time += seconds

    def __deepcopy__(self, memo: dict[int, object]) -> FakeClock:
        return self  # one time: a copy of what holds the clock (a pipeline's model) shares it

    def __repr__(self) -> str:
        return f"FakeClock(time={self.time:g})"


def checked_fps(fps: object) -> float:
    """``fps`` as a float: any finite real number above 0 (an int or a float, a
    ``fractions.Fraction`` such as PyAV's ``average_rate`` of 30000/1001, a numpy number); a
    ValueError for anything else (a bool, a string, NaN, an infinity, 0 or less)."""
    value = float(fps) if isinstance(fps, numbers.Real) and not isinstance(fps, bool) else math.nan
    if not (0 < value < math.inf):
        raise ValueError(f"fps must be a finite number of items per second above 0, not {fps!r}")
    return value


class Paced(Generic[T]):
    """``items`` as a live source: item ``k`` arrives at ``start + k / fps`` on ``clock``, where
    ``start`` is the clock's time when the stream begins (when it is first read). ``fps`` is any
    real number above 0 (see ``checked_fps``), kept as a float.

    Iterating it is the plain way to read a live source: each item is yielded once it has arrived
    (sleeping until then), and at once when its time has passed (nothing is left out: a loop that
    is behind gets every item, late). A pipeline's ``stream`` reads it knowing when each item
    arrived, so that it can leave out those it cannot take in time (``when_behind="drop"``).
    """

    def __init__(self, items: Iterable[T], fps: SupportsFloat, clock: Clock = MONOTONIC) -> None:
        self.items, self.fps, self.clock = items, checked_fps(fps), clock

    def arrival(self, k: int, start: float) -> float:
        """When item ``k`` arrives, in a stream that began at ``start``."""
        return start + k / self.fps

    def __iter__(self) -> Iterator[T]:
        start = self.clock.now()
        for k, item in enumerate(self.items):
            self.clock.sleep_until(self.arrival(k, start))
            yield item

    def __repr__(self) -> str:
        return f"at_rate({type(self.items).__name__}, fps={self.fps:g}, clock={self.clock!r})"


def at_rate(items: Iterable[T], fps: SupportsFloat, *, clock: Clock = MONOTONIC) -> Paced[T]:
    """``items`` arriving like a live source's, ``fps`` of them per second on ``clock`` (``Paced``).

    ``fps`` is any finite real number above 0: an int, a float, a numpy number, or the
    ``fractions.Fraction`` that PyAV gives as a stream's ``average_rate`` (30000/1001).

    >>> from partime.sources import FakeClock, at_rate
    >>> clock = FakeClock()
    >>> source = at_rate(["a", "b", "c"], fps=10, clock=clock)
    >>> [(item, clock.now()) for item in source]
    [('a', 0.0), ('b', 0.1), ('c', 0.2)]
    """
    return Paced(items, fps, clock)


__all__ = ["MONOTONIC", "Clock", "FakeClock", "Paced", "at_rate", "video_frames", "write_video"]

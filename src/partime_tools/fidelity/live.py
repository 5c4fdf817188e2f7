"""What a learner keeps of a live stream that arrives faster than it learns: the drop schedule.

Sample ``k`` of a live stream arrives at ``k / rate`` seconds; a contender (the plain loop, or a
pipeline, one tick per sample) is busy ``seconds_per_sample`` with each sample it takes. Under
``when_behind="drop"`` (SPEC.md, "Live sources") a sample that arrives while the one before it
still waits to go in replaces it; the contender takes the newest waiting sample the moment it is
free, and when nothing waits, it waits for the next arrival. ``drop_schedule`` says which samples
go in and when, at rate 10 per second and 0.15 s per sample::

    sample     0    1    2    3    4    5    6    7    8    9
    arrives    0   .10  .20  .30  .40  .50  .60  .70  .80  .90
    goes in    0   .15   -   .30  .45   -   .60  .75   -   .90

The rule is the library's own: the schedule drives ``partime.internals.inbox``, the reader of a paced source
(``when_behind="drop"``) on a ``partime.sources.FakeClock``; no torch, no processes, no real time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partime.internals import inbox
from partime.sources import FakeClock, at_rate

TIE = 1e-9
"""How close, in periods of the stream, the moment a contender is free must come to an arrival to
be that arrival's moment: sums of a period that binary floats cannot hold (0.1 s) would otherwise
decide by their last bit whether a sample arriving as the contender gets free is taken."""


@dataclass(frozen=True)
class Entry:
    """A sample that went in: its index in the stream, when it arrived and when it went in (seconds)."""

    index: int
    arrived: float
    went_in: float


def drop_schedule(samples: int, rate: float, seconds_per_sample: float) -> list[Entry]:
    """The samples of a stream of ``samples`` arriving at ``rate`` per second that a contender busy
    ``seconds_per_sample`` with each one takes under ``when_behind="drop"``, in order, with when
    each arrived and went in; the first goes in as it arrives, at 0. A sample that arrives at the
    very moment the contender is free is taken (it has arrived).

    >>> [(e.index, round(e.went_in, 2)) for e in drop_schedule(5, rate=10, seconds_per_sample=0.15)]
    [(0, 0.0), (1, 0.15), (3, 0.3), (4, 0.45)]
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ValueError(f"samples must be a whole number of at least 0, not {samples!r}")
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"rate must be a finite number of samples per second above 0, not {rate!r}")
    if not math.isfinite(seconds_per_sample) or seconds_per_sample < 0:
        raise ValueError(f"seconds_per_sample must be a finite number of at least 0, not {seconds_per_sample!r}")
    # The clock counts periods of the stream: sample k arrives at k exactly, so that a contender
    # busy a whole number of periods meets the arrivals exactly.
    clock, busy = FakeClock(), seconds_per_sample * rate
    reader = inbox(at_rate(range(samples), 1.0, clock=clock), "drop")
    kept = []
    while found := reader.take():
        (index, arrived), *_ = found.kept  # under drop a take keeps one sample, the newest
        went_in = clock.now()
        kept.append(Entry(index, arrived / rate, went_in / rate))
        clock.sleep_until(_snapped(went_in + busy))
    reader.close()
    return kept


def _snapped(periods: float) -> float:
    """``periods``, or the whole number of periods within ``TIE`` of it."""
    whole = round(periods)
    return float(whole) if abs(periods - whole) < TIE else periods


__all__ = ["TIE", "Entry", "drop_schedule"]

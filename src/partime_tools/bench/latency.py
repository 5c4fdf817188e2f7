"""How long each sample waits for its result, for ``partime bench --sizes``.

A sample's latency runs from the moment it is offered (``Offered`` hands it to the stream, which
pulls it) to the moment its result is handed out::

    offered_at[i]   the stream pulls sample i from Offered          (time.perf_counter())
    handed_at[i]    the result of sample i comes out of the stream  (time.perf_counter())
    latency[i] = handed_at[i] - offered_at[i]

A pipeline pulls sample i at tick i and hands its result out at tick i + D - 1, so its latency
is about D ticks; the plain model's is its time per sample.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")

PERCENTILES = (50, 99)
"""The percentiles that ``latencies`` reports."""


class Offered(Generic[T]):
    """An iterator over ``items`` that notes the clock (``time.perf_counter()``) as each item is
    pulled, in ``offered_at`` (one entry per item pulled, in order)."""

    def __init__(self, items: Iterable[T]):
        self._items = iter(items)
        self.offered_at: list[float] = []

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        item = next(self._items)
        self.offered_at.append(time.perf_counter())
        return item


def percentile(values: Sequence[float], percent: int) -> float:
    """The nearest-rank ``percent``-th percentile of ``values``: the smallest value that at least
    ``percent`` % of them do not exceed (one of the values, never an interpolation)."""
    if not values:
        raise ValueError("the percentile of no values")
    if not 0 < percent <= 100:
        raise ValueError(f"percent must be in (0, 100], got {percent}")
    ordered = sorted(values)
    rank = -(-percent * len(ordered) // 100)  # ceil(percent * n / 100), exactly, in integers
    return ordered[rank - 1]


def latencies(offered_at: Sequence[float], handed_at: Sequence[float]) -> dict[str, float]:
    """``p50_ms`` and ``p99_ms``: the nearest-rank percentiles (see ``percentile``) of the latencies
    ``handed_at[i] - offered_at[i]``, in milliseconds, over every sample i.

    Both sequences are clock readings in seconds, one per sample; a ValueError if their lengths
    differ, if they are empty, or if a result is handed out before its sample was offered.
    """
    if len(offered_at) != len(handed_at) or not offered_at:
        raise ValueError(
            f"need as many offered as handed times, and some: got {len(offered_at)} offered, {len(handed_at)} handed"
        )
    waits = [(handed - offered) * 1e3 for offered, handed in zip(offered_at, handed_at)]
    early = [i for i, wait in enumerate(waits) if wait < 0]
    if early:
        raise ValueError(f"results handed out before their samples were offered: samples {early[:5]}")
    return {f"p{p}_ms": percentile(waits, p) for p in PERCENTILES}

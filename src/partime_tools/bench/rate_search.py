"""The highest rate a contender keeps up with, by bisection on a grid of ratios (``partime bench --rate``).

A contender *keeps up* with a rate when a run of it at that rate drops no sample, in one of
``TRIES`` tries: a run that drops is run again at once, so that one stall of the machine does
not decide the rate. The rates tried are ``start * grid ** k`` for whole ``k``, where ``start`` is
the contender's own speed on a recorded stream: from ``k = 0`` the search climbs by 4, 8, 16 ...
steps while the contender keeps up (or descends so while it drops), until it has one rate kept and
one dropped; then it bisects ``k`` until those are neighbours on the grid. For a contender that
keeps up to between ``start * grid ** 4`` and ``start * grid ** 5``::

    k tried:   0   4   12   8   6   5
    drops:     0   0   31  19   6   2    →  sustained: start * grid ** 4 (the next rate up, ** 5, drops)

The search assumes that a contender that keeps up with a rate keeps up with every lower one; a
run that contradicts it (a hiccup of the machine) only narrows the bracket, as any other run
does. It never tries a rate more than ``RANGE`` times above or below ``start``: a contender that
drops frames even at ``start / RANGE`` kept up with no rate, and its sustained rate is 0.
``sustained_rates`` runs the searches of several contenders interleaved, one run of each in turn.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .sweep import round_order

GRID = 1.02
"""The ratio between neighbouring rates of the grid: the search's precision (2 %)."""

STRIDE = 4
"""The first climb (or descent) from the start, in steps of the grid; each next one doubles."""

RANGE = 8.0
"""How far from its start a search looks, as a factor either way."""

TRIES = 2
"""How many runs at one rate may try to drop none before the rate counts as too fast."""

Probe = Callable[[float], int]
"""A run of a contender at a rate (items per second): how many of its timed samples it dropped."""


@dataclass
class Search:
    """One contender's search from ``start`` on the grid ``start * grid ** k`` (see the module).

    ``probes`` are the rates tried so far, ``(rate, drops)`` in order; ``kept`` is the highest
    ``k`` run without a drop and ``dropped`` the lowest ``k`` that dropped (None until there is one).
    """

    start: float
    grid: float = GRID
    probes: list[tuple[float, int]] = field(default_factory=list)
    kept: int | None = None
    dropped: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start) and self.start > 0):
            raise ValueError(f"a search starts from a rate above 0, got {self.start}")
        if not (math.isfinite(self.grid) and self.grid > 1):
            raise ValueError(f"the grid's ratio must be above 1, got {self.grid}")

    @property
    def limit(self) -> int:
        """The farthest ``k`` either way (``RANGE``)."""
        return math.floor(math.log(RANGE) / math.log(self.grid))

    def rate(self, k: int) -> float:
        """The rate at step ``k`` of the grid."""
        return self.start * self.grid**k

    def next_k(self) -> int | None:
        """The step to run next; None once the search is done (``sustained`` is known). A RuntimeError
        if it kept up even at ``RANGE`` times its start: the start was no measure of its speed."""
        if self.kept is not None and self.dropped is not None:
            return (self.kept + self.dropped) // 2 if self.dropped - self.kept > 1 else None
        if self.kept is None and self.dropped is None:
            return 0
        stride = STRIDE * 2 ** (len(self.probes) - 1)  # every run so far went the same way
        if self.dropped is None:
            assert self.kept is not None
            if self.kept >= self.limit:
                raise RuntimeError(
                    f"kept up even at {self.rate(self.kept):.4g}/s, {RANGE:g} times its start ({self.start:.4g}/s): "
                    "the start is no measure of its speed"
                )
            return min(self.kept + stride, self.limit)
        if self.dropped <= -self.limit:
            return None  # it dropped frames even at start / RANGE: it keeps up with no rate
        return max(self.dropped - stride, -self.limit)

    def record(self, k: int, drops: int) -> None:
        """Note that the run at step ``k`` dropped ``drops`` samples."""
        self.probes.append((self.rate(k), drops))
        if drops == 0:
            self.kept = k
        else:
            self.dropped = k

    @property
    def done(self) -> bool:
        return self.next_k() is None

    @property
    def sustained(self) -> float:
        """The highest rate kept up with, once done (0 if it kept up with none)."""
        if not self.done:
            raise RuntimeError(f"the search is not done: runs so far {self.probes}")
        return 0.0 if self.kept is None else self.rate(self.kept)

    @property
    def dropped_at(self) -> float:
        """The lowest rate that dropped samples (the grid's next rate above ``sustained``), once done."""
        if self.dropped is None or not self.done:
            raise RuntimeError(f"the search is not done: runs so far {self.probes}")
        return self.rate(self.dropped)


def sustained_rates(
    probes: Mapping[str, Probe],
    starts: Mapping[str, float],
    *,
    grid: float = GRID,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Search]:
    """Each contender's search (by name), its runs interleaved with the others': in each round
    every search not yet done tries its next rate (up to ``TRIES`` runs, the fewest drops
    recorded), each round starting one contender later (``bench_sweep.round_order``);
    ``progress`` is told the contender and rate before each run."""
    searches = {name: Search(starts[name], grid) for name in probes}
    # as many rounds as it takes: each search ends, done or refusing a rate beyond its RANGE
    for order in round_order(list(probes), sys.maxsize):
        waiting = [name for name in order if not searches[name].done]
        if not waiting:
            break
        for name in waiting:
            search = searches[name]
            k = search.next_k()
            assert k is not None
            tries: list[int] = []
            while len(tries) < TRIES and 0 not in tries:
                if progress is not None:
                    progress(f"{name} at {search.rate(k):.4g}/s")
                tries.append(probes[name](search.rate(k)))
            search.record(k, min(tries))
            try:
                search.next_k()
            except RuntimeError as error:  # it kept up beyond its RANGE: name whose search it was
                raise RuntimeError(f"{name}: {error}") from None
    return searches

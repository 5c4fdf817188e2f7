"""Where to cut among the cuts that are about as fast: by what measurement noise does not change.

Layer times are measured, so two runs of one script time the same model a few percent apart,
and the fastest cut (``best_split``) can move from one run to the next. ``steady_split`` takes
the cut by criteria that need no timing, among the cuts that are about as fast as the fastest,
so that the same script cuts a model the same way on the same machine, run after run (unless a
cut's predicted time falls right at the edge of the band).

A pipeline that learns also weighs *which* layers sit in the early stages: stage ``i`` of ``D``
applies gradients ``2(D - 1 - i)`` samples old, so among the cuts whose slowest stage is within
``DELAY_SLACK`` of the fastest, the one that minimises the delay-weighted number of weights
(``sum over layers of params × delay of its stage``) is taken first: a few percent of throughput
for what delay would cost the weights that carry the learning (docs/results/fidelity.md measures it).
The weight count is a proxy for how much a layer has to learn, and one that needs no data.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence

from ..core.schedule import delay
from .partition import Partition, best_split, stage_time_table

DELAY_SLACK = 0.1
"""How much slower than the fastest cut's slowest stage a cut that delays fewer weights may be (10%)."""

WEIGHT_UNIT = 0.05
"""The step in which a layer's part of the model's weights counts for the delay-weighted cost (5%)."""

CUT_NOISE = 0.05
"""How far apart two cuts' predicted times may be and still count as equally fast (5%): about
what the medians of two profiles of one model differ by on a busy machine."""


def steady_split(
    layer_times: Sequence[float],
    depth: int,
    *,
    layer_params: Sequence[int] | None = None,
    boundary_bytes: Sequence[int] | None = None,
    hop_times: Sequence[float] | None = None,
    overhead: float = 0.0,
    forbidden: Collection[int] = (),
    slack: float = DELAY_SLACK,
    noise: float = CUT_NOISE,
) -> tuple[int, ...]:
    """The balance into ``depth`` stages chosen among the cuts about as fast as the fastest.

    A cut's time is that of its slowest stage, hops included, as ``best_split`` counts it
    (``hop_times``, ``overhead``); ``T`` is the fastest cut's. The cuts considered:

    - without ``layer_params`` (inference), every cut whose time is at most ``(1 + noise) T``;
    - with ``layer_params`` (one weight count per layer, a pipeline that learns), those with the
      fewest delay-weighted weights, ``sum(share[k] * 2 * (depth - 1 - stage of k))``, of the cuts
      within ``(1 + slack) T``; and of these, every one whose time is at most ``(1 + noise)``
      times the fastest of them (and ``(1 + slack) T``). ``share[k]`` is layer ``k``'s part of
      all the weights in units of ``WEIGHT_UNIT``, rounded: layers with few weights each, however
      many, do not pull the cut to the edge of the band, where noise would move it.

    Among them the one taken is, in this order: the one whose cut positions carry the fewest
    ``boundary_bytes`` (``boundary_bytes[k - 1]`` is what crosses cut position ``k`` per tick;
    none given: all equal), the one whose cut positions lie closest to an even cut by layer count
    (least sum of squared distances), the lexicographically smallest balance. None of these
    depends on the times, so noise in them changes the cut only where it moves a cut in or out
    of the band.

    No cut falls at a position in ``forbidden`` (as in ``best_split``): the bands and the choice
    are then taken among the cuts that avoid them.
    """
    times = list(layer_times)
    fastest = best_split(times, depth, forbidden=forbidden, hop_times=hop_times, overhead=overhead)  # validates
    n = len(times)
    counts = [0] * n if layer_params is None else [int(p) for p in layer_params]
    if len(counts) != n or any(p < 0 for p in counts):
        raise ValueError(f"need one weight count >= 0 per layer: {n} layers, got {list(layer_params or ())}")
    params = [round(p / sum(counts) / WEIGHT_UNIT) for p in counts] if any(counts) else counts
    nbytes = [0] * (n - 1) if boundary_bytes is None else [int(b) for b in boundary_bytes]
    if len(nbytes) != n - 1 or any(b < 0 for b in nbytes):
        raise ValueError(f"need one byte count >= 0 per cut position: {n - 1} positions, got {nbytes}")
    for name, value in (("slack", slack), ("noise", noise)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    seg = stage_time_table(times, None if hop_times is None else list(hop_times), overhead)
    prefix = list(itertools.accumulate(params, initial=0))  # prefix[b] - prefix[a]: the weights of layers a to b - 1
    quickest = max(seg[a][b] for a, b in Partition(fastest).bounds)
    banned = set(forbidden)
    Key = tuple[int, float, int, int, tuple[int, ...]]

    def cheapest(bound: float, fast: bool) -> Key:
        """The best cut whose every stage takes at most ``bound``: by (delay cost, slowest stage)
        when ``fast``, else by (delay cost, bytes across the cuts, evenness, balance)."""
        # best[b]: the key of the best cut of the first b layers into the stages so far (absent:
        # none). Each part of the key adds up over stages (the slowest stage: takes the max), so
        # the best cut of b layers extends a best cut of some prefix.
        best: dict[int, Key] = {0: (0, 0.0, 0, 0, ())}
        for k in range(depth):
            longer: dict[int, Key] = {}
            for b in range(k + 1, n + 1):
                options = [
                    (
                        cost + (prefix[b] - prefix[a]) * delay(k, depth),
                        max(slowest, seg[a][b]) if fast else 0.0,
                        crossing + (nbytes[a - 1] if a else 0),
                        off + ((depth * a - k * n) ** 2 if a else 0),
                        balance + (b - a,),
                    )
                    for a in range(k, b)
                    if a in best and a not in banned and seg[a][b] <= bound
                    for cost, slowest, crossing, off, balance in (best[a],)
                ]
                if options:
                    longer[b] = min(options)
            best = longer
        return best[n]

    if layer_params is None:
        band = quickest * (1 + noise)
    else:  # no cut slower than the slack allows, so the cheapest in the band costs what the fastest of them does
        band = min(cheapest(quickest * (1 + slack), fast=True)[1] * (1 + noise), quickest * (1 + slack))
    return cheapest(band, fast=False)[4]

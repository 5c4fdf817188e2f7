"""Where to cut a model that learns: keep the weights that carry the learning out of the delay.

Stage ``i`` of ``D`` applies gradients ``2(D - 1 - i)`` samples old and runs its forward with
weights that have not yet seen the last ``2(D - 1 - i)`` samples; the last stage has no delay at
all. How much that costs depends on *which* layers sit in the early stages. Measured by
``partime fidelity`` on moving digits (a CNN whose ``Linear(1152, 64)`` holds 93% of its
weights), SGD, D = 8, seed 0, ``weight-stash``: the even cut by layer count, which leaves that
layer 4 samples late, scored 24% (sequential 86%); the cut that gives it to the last stage, with
the same slowest stage, 82%.

So when a pipeline that learns is balanced by timing, among the cuts whose slowest stage is
within ``DELAY_SLACK`` of the fastest possible, ``delay_aware_split`` takes the one that
minimises the delay-weighted number of weights, ``sum over layers of params × delay of its
stage``: a cut that costs at most a few percent of throughput and can save most of the accuracy
that delay would cost. The weight count is a proxy for how much a layer has to learn, and the
one that needs no data to compute; the README's fidelity table is the measurement.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from .compensation import delay
from .partition import Partition, best_split

DELAY_SLACK = 0.1
"""How much slower than the fastest cut's slowest stage a delay-aware cut's may be (10%)."""


def delay_aware_split(
    layer_times: Sequence[float],
    layer_params: Sequence[int],
    depth: int,
    *,
    slack: float = DELAY_SLACK,
    forbidden: Collection[int] = (),
) -> tuple[int, ...]:
    """The balance into ``depth`` stages with the fewest delay-weighted weights among those whose
    slowest stage takes at most ``(1 + slack)`` times the slowest stage of ``best_split``.

    The cost of a balance is ``sum(layer_params[k] * 2 * (depth - 1 - stage of k))``, exactly
    minimised. Ties go to the cut ``best_split`` would prefer (stage times, sorted from the
    largest down, lexicographically smallest; then the balance). With ``slack=0`` the slowest
    stage is as fast as ``best_split``'s; ``best_split``'s own cut always qualifies.

    No cut falls at a position in ``forbidden`` (as in ``best_split``): the bound and the choice
    are then taken among the cuts that avoid them.
    """
    times = list(layer_times)
    params = [int(p) for p in layer_params]
    fastest = best_split(times, depth, forbidden=forbidden)  # validates times, depth, forbidden
    if len(params) != len(times) or any(p < 0 for p in params):
        raise ValueError(f"need one weight count >= 0 per layer: {len(times)} layers, got {list(layer_params)}")
    if not (math.isfinite(slack) and slack >= 0):
        raise ValueError(f"slack must be a finite number >= 0, got {slack!r}")
    n = len(times)
    banned = set(forbidden)
    seg = [[0.0] * (n + 1) for _ in range(n + 1)]  # seg[a][b] = sum(times[a:b]), left to right
    weights = [[0] * (n + 1) for _ in range(n + 1)]
    for a in range(n):
        for b in range(a + 1, n + 1):
            seg[a][b] = seg[a][b - 1] + times[b - 1]
            weights[a][b] = weights[a][b - 1] + params[b - 1]
    bound = max(seg[a][b] for a, b in Partition(fastest).bounds) * (1 + slack)
    # best[b]: the key (cost, stage times sorted from the largest down, balance) of the best cut
    # of the first b layers into k stages, each within the bound; absent if there is none. The
    # key orders two cuts the same way after one more stage is appended to both, so the best
    # cut of b layers extends a best cut of some prefix.
    Key = tuple[int, tuple[float, ...], tuple[int, ...]]
    best: dict[int, Key] = {
        b: (weights[0][b] * delay(0, depth), (seg[0][b],), (b,)) for b in range(1, n + 1) if seg[0][b] <= bound
    }
    for k in range(1, depth):
        longer: dict[int, Key] = {}
        for b in range(k + 1, n + 1):
            options = [
                (
                    best[a][0] + weights[a][b] * delay(k, depth),
                    tuple(sorted(best[a][1] + (seg[a][b],), reverse=True)),
                    best[a][2] + (b - a,),
                )
                for a in range(k, b)
                if a in best and a not in banned and seg[a][b] <= bound
            ]
            if options:
                longer[b] = min(options)
        best = longer
    return best[n][2]

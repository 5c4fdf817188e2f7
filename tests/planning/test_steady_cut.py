"""Tests of partime.planning.steady_cut: the cut among the near-fastest, against brute force, known cases and noise."""

from __future__ import annotations

import itertools
import random

import pytest

from partime.planning.hop_cost import stage_hop
from partime.planning.partition import best_split
from partime.planning.steady_cut import steady_split


def _balances(n: int, depth: int, forbidden: set[int]) -> list[tuple[int, ...]]:
    return [
        tuple(b - a for a, b in itertools.pairwise((0, *cuts, n)))
        for cuts in itertools.combinations([k for k in range(1, n) if k not in forbidden], depth - 1)
    ]


def _stage_sums(values: list[float], balance: tuple[int, ...]) -> list[float]:
    edges = list(itertools.accumulate(balance, initial=0))
    return [sum(values[a:b]) for a, b in itertools.pairwise(edges)]


def _delay_cost(params: list[int], balance: tuple[int, ...]) -> int:
    """The delay-weighted weights of a cut, each layer's weights in 5 % steps of the model's."""
    depth = len(balance)
    shares = [round(p / sum(params) / 0.05) for p in params] if any(params) else params
    return sum(2 * (depth - 1 - i) * w for i, w in enumerate(_stage_sums(shares, balance)))


def _brute_force(
    times: list[float],
    depth: int,
    *,
    params: list[int] | None,
    nbytes: list[int],
    hops: list[float] | None = None,
    forbidden: set[int] = frozenset(),  # type: ignore[assignment]
    slack: float,
    noise: float,
) -> tuple[int, ...]:
    n = len(times)

    def slowest(b: tuple[int, ...]) -> float:
        edges = list(itertools.accumulate(b, initial=0))
        return max(
            sum(times[a:c]) + (stage_hop(a, c, n, hops, 0.0) if hops is not None else 0.0)
            for a, c in itertools.pairwise(edges)
        )

    balances = _balances(n, depth, forbidden)
    fastest = min(slowest(b) for b in balances)
    if params is None:
        band = [b for b in balances if slowest(b) <= fastest * (1 + noise)]
    else:
        within = [b for b in balances if slowest(b) <= fastest * (1 + slack)]
        cost = min(_delay_cost(params, b) for b in within)
        quickest = min(slowest(b) for b in within if _delay_cost(params, b) == cost)
        bound = min(quickest * (1 + noise), fastest * (1 + slack))
        band = [b for b in balances if _delay_cost(params, b) == cost and slowest(b) <= bound]

    def key(b: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
        positions = list(itertools.accumulate(b))[:-1]
        crossing = sum(nbytes[k - 1] for k in positions)
        off = sum((depth * k - i * n) ** 2 for i, k in enumerate(positions, start=1))
        return crossing, off, b

    return min(band, key=key)


def test_the_layer_with_the_weights_goes_to_the_last_stage_when_speed_allows() -> None:
    # Ten layers shaped like the fidelity CNN: two convolutions dominate the time, the first
    # linear layer (index 7) holds the weights. At D = 8 the fastest cut leaves it two samples
    # late; the delay-aware one, as fast, gives it no delay.
    times = [2.0, 0.1, 0.1, 6.0, 0.1, 0.1, 0.05, 0.3, 0.05, 0.05]
    params = [416, 0, 0, 4640, 0, 0, 0, 73792, 0, 650]
    assert best_split(times, 8) == (1, 1, 1, 1, 1, 2, 1, 2)
    assert steady_split(times, 8, layer_params=params) == (1, 1, 1, 1, 1, 1, 1, 3)


def test_no_slack_keeps_the_fastest_speed() -> None:
    times = [1.0, 1.0, 1.0, 1.0]
    assert steady_split(times, 2, layer_params=[0, 0, 0, 100], slack=0.0) == (2, 2)
    assert steady_split(times, 2, layer_params=[0, 0, 0, 100], slack=0.5) == (2, 2)  # (3, 1) is 50% slower
    assert steady_split(times, 2, layer_params=[100, 0, 0, 0], slack=0.5) == (2, 2)
    assert steady_split(times, 2, layer_params=[0, 0, 100, 0], slack=0.5) == (2, 2)
    assert steady_split(times, 2, layer_params=[0, 100, 0, 0], slack=0.5) == (1, 3)


def test_among_equally_fast_cuts_the_fewest_bytes_then_the_most_even() -> None:
    times = [1.0] * 8
    assert steady_split(times, 2, noise=0.3) == (4, 4)  # (3, 5) and (5, 3) are in the band too
    assert steady_split(times, 2, noise=0.3, boundary_bytes=[9, 9, 9, 9, 1, 9, 9]) == (5, 3)
    assert steady_split(times, 2, noise=0.2, boundary_bytes=[9, 1, 9, 9, 9, 9, 9]) == (4, 4)  # (2, 6) is 50% slower


@pytest.mark.parametrize("learning", [False, True])
@pytest.mark.parametrize(("slack", "noise"), [(0.0, 0.0), (0.1, 0.05), (0.5, 0.2)])
def test_matches_brute_force(learning: bool, slack: float, noise: float) -> None:
    rng = random.Random(99)
    for _ in range(150):
        n = rng.randint(1, 8)
        depth = rng.randint(1, min(5, n))
        times = [float(rng.randint(0, 6)) for _ in range(n)]  # many ties
        params = [rng.choice([0, 0, 10, 500]) for _ in range(n)] if learning else None
        nbytes = [rng.choice([4, 4, 16]) for _ in range(n - 1)]
        got = steady_split(times, depth, layer_params=params, boundary_bytes=nbytes, slack=slack, noise=noise)
        expected = _brute_force(times, depth, params=params, nbytes=nbytes, slack=slack, noise=noise)
        assert got == expected, (times, params, nbytes, depth)


@pytest.mark.parametrize("learning", [False, True])
def test_matches_brute_force_with_hops_and_forbidden_cuts(learning: bool) -> None:
    rng = random.Random(11)
    for _ in range(200):
        n = rng.randint(2, 8)
        depth = rng.randint(1, n)
        times = [float(rng.randint(0, 6)) for _ in range(n)]
        hops = [rng.choice([0.0, 0.5, 1.0]) for _ in range(n - 1)]
        params = [rng.choice([0, 0, 10, 500]) for _ in range(n)] if learning else None
        forbidden = {k for k in range(1, n) if rng.random() < 0.3}
        if not _balances(n, depth, forbidden):
            continue
        got = steady_split(times, depth, layer_params=params, hop_times=hops, forbidden=forbidden)
        expected = _brute_force(
            times, depth, params=params, nbytes=[0] * (n - 1), hops=hops, forbidden=forbidden, slack=0.1, noise=0.05
        )
        assert got == expected, (times, hops, params, depth, forbidden)


@pytest.mark.parametrize("learning", [False, True])
def test_noise_in_the_layer_times_does_not_move_the_cut(learning: bool) -> None:
    # 245 small layers shaped like a ShuffleNetV2: four resolutions, each crossing fewer bytes
    # than the one before, times that vary from layer to layer, most weights in five layers.
    # Timed again with 2 % noise per layer, the fastest cut moves from one profile to the next;
    # the steady cut does not.
    rng = random.Random(5)
    base = [rng.lognormvariate(0, 0.5) * 1e-4 for _ in range(245)]
    nbytes = [[4096, 2048, 1024, 512][k * 4 // 245] for k in range(1, 245)]
    heavy = {30, 90, 150, 200, 244}
    params = [50_000 if k in heavy else rng.choice([0, 0, 100, 400]) for k in range(245)] if learning else None
    fastest, steady = set(), set()
    for _ in range(30):
        times = [t * rng.gauss(1, 0.02) for t in base]
        fastest.add(best_split(times, 2))
        steady.add(steady_split(times, 2, layer_params=params, boundary_bytes=nbytes))
    assert len(fastest) > 1
    assert len(steady) == 1, steady


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"one weight count >= 0 per layer: 3 layers, got \[1, 2\]"):
        steady_split([1.0, 2.0, 3.0], 2, layer_params=[1, 2])
    with pytest.raises(ValueError, match=r"got \[1, -2\]"):
        steady_split([1.0, 2.0], 1, layer_params=[1, -2])
    with pytest.raises(ValueError, match=r"one byte count >= 0 per cut position: 1 positions, got \[1, 2\]"):
        steady_split([1.0, 2.0], 2, boundary_bytes=[1, 2])
    with pytest.raises(ValueError, match=r"slack must be a finite number >= 0, got -0.1"):
        steady_split([1.0, 2.0], 1, slack=-0.1)
    with pytest.raises(ValueError, match=r"noise must be a finite number >= 0, got nan"):
        steady_split([1.0, 2.0], 1, noise=float("nan"))
    with pytest.raises(ValueError, match=r"cannot cut 2 layers into 3 stages"):
        steady_split([1.0, 2.0], 3)

"""Tests of partime.delay_cut: the delay-aware cut against brute force and known cases."""

from __future__ import annotations

import itertools
import random

import pytest

from partime.delay_cut import delay_aware_split
from partime.partition import best_split


def _stage_sums(values: list[float], balance: tuple[int, ...]) -> list[float]:
    edges = list(itertools.accumulate(balance, initial=0))
    return [sum(values[a:b]) for a, b in itertools.pairwise(edges)]


def _delay_cost(params: list[int], balance: tuple[int, ...]) -> int:
    depth = len(balance)
    return sum(2 * (depth - 1 - i) * w for i, w in enumerate(_stage_sums(params, balance)))


def test_the_layer_with_the_weights_goes_to_the_last_stage_when_speed_allows() -> None:
    # Ten layers shaped like the fidelity CNN: two convolutions dominate the time, the first
    # linear layer (index 7) holds the weights. At D = 8 the fastest cut leaves it two samples
    # late; the delay-aware one, as fast, gives it no delay. At D = 4 both agree.
    times = [2.0, 0.1, 0.1, 6.0, 0.1, 0.1, 0.05, 0.3, 0.05, 0.05]
    params = [416, 0, 0, 4640, 0, 0, 0, 73792, 0, 650]
    assert best_split(times, 8) == (1, 1, 1, 1, 1, 2, 1, 2)
    assert delay_aware_split(times, params, 8) == (1, 1, 1, 1, 1, 1, 1, 3)
    assert best_split(times, 4) == delay_aware_split(times, params, 4) == (1, 2, 1, 6)


def test_no_slack_keeps_the_fastest_speed() -> None:
    times = [1.0, 1.0, 1.0, 1.0]
    params = [0, 0, 0, 100]
    assert delay_aware_split(times, params, 2, slack=0.0) == (2, 2)
    assert delay_aware_split(times, params, 2, slack=0.5) == (2, 2)  # (3, 1) is 50% slower
    assert delay_aware_split([1.0, 1.0, 1.0, 1.0], [100, 0, 0, 0], 2, slack=0.5) == (2, 2)
    assert delay_aware_split([1.0, 1.0, 1.0, 1.0], [0, 0, 100, 0], 2, slack=0.5) == (2, 2)
    assert delay_aware_split([1.0, 1.0, 1.0, 1.0], [0, 100, 0, 0], 2, slack=0.5) == (1, 3)


@pytest.mark.parametrize("slack", [0.0, 0.1, 0.5])
def test_matches_brute_force(slack: float) -> None:
    rng = random.Random(99)
    for _ in range(150):
        n = rng.randint(1, 8)
        depth = rng.randint(1, min(5, n))
        times = [float(rng.randint(0, 6)) for _ in range(n)]  # many ties
        params = [rng.choice([0, 0, 10, 500]) for _ in range(n)]
        balances = [
            tuple(b - a for a, b in itertools.pairwise((0, *cuts, n)))
            for cuts in itertools.combinations(range(1, n), depth - 1)
        ]
        bound = max(_stage_sums(times, best_split(times, depth))) * (1 + slack)
        allowed = [b for b in balances if max(_stage_sums(times, b)) <= bound]
        expected = min(allowed, key=lambda b: (_delay_cost(params, b), sorted(_stage_sums(times, b), reverse=True), b))
        assert delay_aware_split(times, params, depth, slack=slack) == expected, (times, params, depth)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"one weight count >= 0 per layer: 3 layers, got \[1, 2\]"):
        delay_aware_split([1.0, 2.0, 3.0], [1, 2], 2)
    with pytest.raises(ValueError, match=r"got \[1, -2\]"):
        delay_aware_split([1.0, 2.0], [1, -2], 1)
    with pytest.raises(ValueError, match=r"slack must be a finite number >= 0, got -0.1"):
        delay_aware_split([1.0, 2.0], [1, 2], 1, slack=-0.1)
    with pytest.raises(ValueError, match=r"cannot cut 2 layers into 3 stages"):
        delay_aware_split([1.0, 2.0], [1, 2], 3)

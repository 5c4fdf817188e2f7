"""Tests for partime_tools.bench.hop: the bench's hop timing reports finite times and leaves no process."""

from __future__ import annotations

import math
import multiprocessing

import pytest

from partime_tools.bench.hop import measure_hop


def test_measure_hop_reports_finite_times_and_leaves_no_process() -> None:
    result = measure_hop(nbytes=4096, rounds=200)
    assert set(result) == {"nbytes", "rounds", "hop_us_median", "hop_us_p90"}
    assert (result["nbytes"], result["rounds"]) == (4096, 200)
    assert 0 < result["hop_us_median"] <= result["hop_us_p90"] < math.inf
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="got 6"):
        measure_hop(nbytes=6)

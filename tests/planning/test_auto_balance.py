"""Tests of the planner with hop costs (partime.planning.planner, partime.planning.hop_cost) and of ``balance="auto"``.

The choices are tested on synthetic profiles with known answers and against brute force over
every cut; the pipeline tests fix the profile (``planner.profile_layers``) where they need a
particular depth, and otherwise only ask that the pipeline compute what inline computes at the
depth it chose.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from typing import Any

import pytest
import torch
from models import CountedForward
from torch import nn

import partime
from partime.planning import auto_check, planner
from partime.planning import hop_cost as hops
from partime.planning.hop_cost import HopMeter, stage_hop
from partime.planning.partition import Partition, best_split
from partime.planning.planner import AUTO_MARGIN, choose_depth, plan
from partime.planning.profiling import profile_layers


def _balances(n: int, depth: int, forbidden: set[int]) -> list[tuple[int, ...]]:
    """Every balance of ``n`` layers into ``depth`` stages that cuts at no position of ``forbidden``."""
    out = []
    for cuts in itertools.combinations(range(1, n), depth - 1):
        if not forbidden & set(cuts):
            out.append(tuple(b - a for a, b in itertools.pairwise((0, *cuts, n))))
    return out


def _key(times: list[float], hop_times: list[float], overhead: float, balance: tuple[int, ...]) -> tuple:
    """best_split's order: stage times (hops included) sorted from the largest down, then the balance."""
    predicted = Partition(balance, times, hop_times, overhead).predicted_times
    assert predicted is not None
    return tuple(sorted(predicted, reverse=True)), balance


# --- the cost of a boundary ----------------------------------------------------------------


def test_stage_hop_charges_the_overhead_and_each_boundary_a_stage_touches() -> None:
    hop_times = [0.5, 0.25, 0.125]  # positions 1, 2, 3 of 4 layers
    assert stage_hop(0, 4, 4, hop_times, 1.0) == 0.0  # one stage: no boundary, no tick overhead
    assert stage_hop(0, 2, 4, hop_times, 1.0) == 1.25  # outgoing boundary at position 2
    assert stage_hop(2, 4, 4, hop_times, 1.0) == 1.25  # incoming boundary at position 2
    assert stage_hop(1, 3, 4, hop_times, 1.0) == 1.0 + 0.5 + 0.125
    assert stage_hop(1, 3, 4, None, 1.0) == 1.0


@pytest.mark.parametrize("learning", [False, True])
def test_hop_meter_times_each_boundary_with_its_bytes(learning: bool) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    meter = HopMeter(len(model), learning=learning)
    assert meter.hop_times is None  # nothing timed yet
    times = profile_layers(model, torch.randn(2, 4), learning=learning, repeats=2, warmup=1, on_output=meter)
    assert len(times) == 3
    assert meter.hop_times is not None and len(meter.hop_times) == 2 and min(meter.hop_times) > 0
    # 2 x 8 float32 cross each boundary, and when learning their gradient comes back
    assert meter.nbytes == ((2 if learning else 1) * 64,) * 2
    with pytest.raises(ValueError, match=r"repeats=0"):
        HopMeter(3, learning=False, repeats=0)


# --- Partition's predictions ---------------------------------------------------------------


def test_partition_predicts_compute_plus_hop_and_says_so() -> None:
    p = Partition((1, 2), (2e-3, 1e-3, 1e-3), (0.5e-3, 0.25e-3), 0.1e-3)
    assert p.stage_times == (2e-3, 2e-3)  # compute alone, as before
    assert p.hop_costs == pytest.approx((0.6e-3, 0.6e-3))
    assert p.predicted_times == pytest.approx((2.6e-3, 2.6e-3))
    assert p.predicted_time == pytest.approx(2.6e-3)
    assert p.bound == 2e-3  # the slowest compute, not sequential / depth
    assert p.sequential_time == pytest.approx(4e-3)
    assert str(p) == "2 stages: [1, 2] layers, predicted 2.60 / 2.60 ms"
    assert p.summary().splitlines() == [
        "2 stages: [1, 2] layers",
        "  stage 0: 2.600 ms per sample = 2.000 compute + 0.600 hop",
        "  stage 1: 2.600 ms per sample = 2.000 compute + 0.600 hop",
        (
            "  pipeline: 2.600 ms per sample (its slowest stage), bound 2.000 ms (the slowest compute, hops free), "
            "sequential 4.000 ms: 1.54x predicted"
        ),
    ]
    assert Partition((3,), (1.0, 2.0, 3.0), sequential_time=5.0).sequential_time == 5.0
    assert Partition((1, 1)).summary() == "2 stages: [1, 1] layers"
    assert Partition((1, 1)).predicted_time is None and Partition((1, 1)).bound is None


def test_partition_refuses_predictions_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match=r"hop_times must be 2 finite numbers >= 0, one per cut position of 3"):
        Partition((1, 2), (1.0, 1.0, 1.0), (1.0,))
    with pytest.raises(ValueError, match=r"got \[1.0, -1.0\]"):
        Partition((1, 2), (1.0, 1.0, 1.0), (1.0, -1.0))
    with pytest.raises(ValueError, match=r"give layer_times too \(balance: \[1, 2\]\)"):
        Partition((1, 2), None, (1.0, 1.0))
    with pytest.raises(ValueError, match=r"overhead must be a finite number of seconds >= 0, got -1"):
        Partition((1, 2), (1.0, 1.0, 1.0), overhead=-1)
    with pytest.raises(ValueError, match=r"sequential_time must be .* got inf"):
        Partition((3,), (1.0, 1.0, 1.0), sequential_time=float("inf"))


# --- best_split with hops --------------------------------------------------------------------


def test_best_split_moves_a_cut_off_an_expensive_boundary() -> None:
    times = [1.0, 1.0, 1.0, 1.0]
    assert best_split(times, 2) == (2, 2)
    # a fat activation after layer 1: cutting there costs each side 3 s, more than an uneven cut
    assert best_split(times, 2, hop_times=[0.0, 3.0, 0.0]) == (1, 3)
    with pytest.raises(ValueError, match=r"hop_times must be 3 finite numbers >= 0 for 4 layers, got \[1.0\]"):
        best_split(times, 2, hop_times=[1.0])
    with pytest.raises(ValueError, match=r"overhead must be .* got -0.5"):
        best_split(times, 2, overhead=-0.5)


def test_best_split_with_hops_is_the_exact_optimum() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 7)
        depth = rng.randint(1, n)
        times = [rng.choice([0.0, rng.random(), float(rng.randint(1, 4))]) for _ in range(n)]
        hop_times = [rng.choice([0.0, rng.random(), 2.0]) for _ in range(n - 1)]
        overhead = rng.choice([0.0, 0.1, rng.random()])
        forbidden = {k for k in range(1, n) if rng.random() < 0.25}
        balances = _balances(n, depth, forbidden)
        if not balances:
            continue
        expected = min(balances, key=lambda b: _key(times, hop_times, overhead, b))
        got = best_split(times, depth, forbidden=forbidden, hop_times=hop_times, overhead=overhead)
        assert got == expected, (times, hop_times, overhead, depth, forbidden)


# --- choose_depth: known answers -------------------------------------------------------------


def test_choose_depth_takes_two_stages_where_more_would_cut_expensive_boundaries(caplog) -> None:
    # Cuts at positions 1 and 3 cost each side 2.5 s; position 2 costs 0.1 s. D = 2: 4.1 | 4.1.
    # D = 3 or 4 must cut at 1 or 3: its slowest stage takes 4.5 s or more. Sequential: 8 s.
    caplog.set_level(logging.INFO, logger="partime.planning.planner")
    p = choose_depth([2.0, 2.0, 2.0, 2.0], [2.5, 0.1, 2.5], overhead=0.0)
    assert p.balance == (2, 2)
    assert p.predicted_time == pytest.approx(4.1) and p.sequential_time == 8.0
    assert "balance='auto': 2 stages [2, 2]" in caplog.text
    assert "sequential 8.000, 2 stages 4.100, 3 stages 4.600, 4 stages 4.600 (hops included)" in caplog.text


def test_choose_depth_takes_three_stages_when_they_are_fastest() -> None:
    # D = 3: 3 + 0.05 + 0.1 (+ 0.1 in the middle) -> 3.25 s; D = 2: 6.15 s; sequential 9 s.
    p = choose_depth([3.0, 3.0, 3.0], [0.1, 0.1], overhead=0.05)
    assert p.balance == (1, 1, 1) and p.predicted_time == pytest.approx(3.25)
    assert choose_depth([3.0, 3.0, 3.0], [0.1, 0.1], overhead=0.05, max_depth=2).balance == (1, 2)


def test_choose_depth_stays_sequential_when_hops_cost_more_than_they_save(caplog) -> None:
    caplog.set_level(logging.INFO, logger="partime.planning.planner")
    p = choose_depth([1.0, 1.0], [5.0], overhead=0.0)
    assert p.balance == (2,) and p.predicted_time == 2.0 == p.sequential_time
    assert caplog.records[-1].levelno == logging.INFO
    assert caplog.records[-1].getMessage() == (
        "balance='auto': 1 stage, no pipeline is predicted at least 10% faster than sequential; "
        "predicted s per sample: sequential 2.000, 2 stages 6.000 (hops included)"
    )


def test_choose_depth_wants_a_pipeline_faster_by_the_margin() -> None:
    assert AUTO_MARGIN == 0.1
    # 1.0 s against 1.05 s sequential: faster, but by less than 10%
    assert choose_depth([1.0, 0.05], [0.0], overhead=0.0).depth == 1
    assert choose_depth([1.0, 0.05], [0.0], overhead=0.0, margin=0.0).depth == 2
    assert choose_depth([1.0, 0.5], [0.0], overhead=0.0).depth == 2  # 1.0 against 1.5


def test_choose_depth_reads_the_tick_overhead_when_it_runs(monkeypatch) -> None:
    monkeypatch.setattr(hops, "TICK_OVERHEAD_S", 10.0)
    assert choose_depth([1.0] * 4, [0.0] * 3).depth == 1
    monkeypatch.setattr(hops, "TICK_OVERHEAD_S", 0.0)
    assert choose_depth([1.0] * 4, [0.0] * 3).balance == (1, 1, 1, 1)


def test_choose_depth_compares_with_the_threads_each_depth_gets() -> None:
    # One stage with every core: 1 + 1; two stages, each with half the cores: 3 | 3.
    assert choose_depth({1: [1.0, 1.0], 2: [3.0, 3.0]}, [0.0], overhead=0.0).depth == 1
    assert choose_depth({1: [4.0, 4.0], 2: [3.0, 3.0]}, [0.0], overhead=0.0).balance == (1, 1)


def test_choose_depth_with_no_pipeline_possible_says_why(caplog) -> None:
    caplog.set_level(logging.INFO, logger="partime.planning.planner")
    assert choose_depth([1.0, 1.0, 1.0], [0.0, 0.0], overhead=0.0, max_depth=1).depth == 1
    assert "1 stage, no pipeline can be made (max_depth: 1, layers: 3, tied cut positions: 0)" in caplog.text
    # two tied cut positions of three leave two stages at most
    assert choose_depth([1.0] * 4, [0.0] * 3, overhead=0.0, forbidden={1, 2}).balance == (3, 1)


def test_choose_depth_refuses_profiles_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match=r"depths \[2\] do not \(layers per depth: \{1: 2, 2: 3\}\)"):
        choose_depth({1: [1.0, 1.0], 2: [1.0, 1.0, 1.0]}, [0.0])
    with pytest.raises(ValueError, match=r"depths \[2\] do not"):
        choose_depth({1: [1.0, 1.0]}, [0.0], max_depth=2)
    with pytest.raises(ValueError, match=r"max_depth must be an int >= 1, got 0"):
        choose_depth([1.0, 1.0], [0.0], max_depth=0)
    with pytest.raises(ValueError, match=r"margin must be a finite number >= 0, got -0.1"):
        choose_depth([1.0, 1.0], [0.0], margin=-0.1)


def test_choose_depth_is_the_best_of_every_cut_of_every_depth() -> None:
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 6)
        times = [rng.choice([rng.random(), float(rng.randint(1, 3))]) for _ in range(n)]
        hop_times = [rng.choice([0.0, rng.random() / 4, 3.0]) for _ in range(n - 1)]
        overhead = rng.choice([0.0, 0.05])
        forbidden = {k for k in range(1, n) if rng.random() < 0.2}
        got = choose_depth(times, hop_times, overhead=overhead, forbidden=forbidden)
        cuts = [b for d in range(2, n + 1) for b in _balances(n, d, forbidden)]
        sequential = sum(times)
        if cuts:
            best = min(cuts, key=lambda b: (_key(times, hop_times, overhead, b)[0][0], len(b)))
            fastest = _key(times, hop_times, overhead, best)[0][0]
            if fastest * (1 + AUTO_MARGIN) <= sequential:
                assert got.depth == len(best) and got.predicted_time == fastest, (times, hop_times, forbidden)
                assert got.balance == best_split(
                    times, got.depth, forbidden=forbidden, hop_times=hop_times, overhead=overhead
                )
                continue
        assert got.balance == (n,) and got.predicted_time == sequential, (times, hop_times, forbidden)


# --- plan and Pipeline with "auto" -----------------------------------------------------------


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def _run(model: nn.Sequential, balance, xs, ys=None, **kw) -> list[partime.Result]:
    learning = {"loss_fn": nn.MSELoss(), "optimizer": _sgd} if ys is not None else {}
    with partime.Pipeline(model, balance, threads=1, **learning, **kw) as pipe:
        return list(pipe.stream(xs, ys))


def _same(a: list[partime.Result], b: list[partime.Result]) -> None:
    assert [r.index for r in a] == [r.index for r in b]
    for r, s in zip(a, b, strict=True):
        assert torch.equal(r.output, s.output)
        assert r.loss == s.loss  # a float, or None for inference


@pytest.fixture
def four_equal_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile of four layers of one second each, on four cores: "auto" takes four stages."""
    monkeypatch.setattr(planner, "profile_layers", lambda *args, **kwargs: (1.0, 1.0, 1.0, 1.0))
    monkeypatch.setattr(planner, "usable_cores", lambda: 4)
    # and a stage's own tick, measured before "auto" keeps a pipeline, takes one second per layer too,
    # as does the plain model
    monkeypatch.setattr(auto_check, "_tick_seconds", lambda index, module, config, value: float(len(module)))
    monkeypatch.setattr(auto_check, "in_turns", lambda *runs: (4.0,) * len(runs))


@pytest.mark.usefixtures("four_equal_layers")
@pytest.mark.parametrize("learning", [False, True])
def test_auto_with_a_fixed_profile_runs_the_depth_it_chose(learning: bool) -> None:
    model = nn.Sequential(*_model()[:4])
    xs = [torch.randn(4) for _ in range(7)]
    ys = [torch.randn(16) for _ in range(7)] if learning else None
    with partime.Pipeline(model, "auto", sample=xs[0], executor="inline") as pipe:
        assert pipe.depth == 4 and pipe.partition is not None and pipe.partition.balance == (1, 1, 1, 1)
        assert pipe.partition.predicted_time == pytest.approx(1.0 + hops.TICK_OVERHEAD_S, rel=1e-3)
    auto = _run(model, "auto", xs, ys, sample=xs[0], executor="inline")
    _same(auto, _run(model, [1, 1, 1, 1], xs, ys, executor="inline"))
    if not learning:
        with torch.no_grad():
            assert all(torch.equal(r.output, model(x)) for r, x in zip(auto, xs, strict=True))


@pytest.mark.parametrize("learning", [False, True])
def test_auto_equals_inline_at_the_depth_it_chose(learning: bool) -> None:
    model = _model()
    xs = [torch.randn(3, 4) for _ in range(6)]
    ys = [torch.randn(3, 2) for _ in range(6)] if learning else None
    learn = {"loss_fn": nn.MSELoss(), "optimizer": _sgd} if learning else {}
    with partime.Pipeline(model, "auto", sample=xs[0], executor="inline", threads=1, **learn) as pipe:
        chosen = pipe.partition
        auto = list(pipe.stream(xs, ys))
    assert chosen is not None and chosen.layer_times is not None and chosen.hop_times is not None
    assert 1 <= chosen.depth <= min(planner.usable_cores(), len(model)) and pipe.depth == chosen.depth
    _same(auto, _run(model, list(chosen.balance), xs, ys, executor="inline"))


def test_auto_in_processes_equals_inline_at_the_depth_it_chose() -> None:
    model = _model()
    xs = [torch.randn(3, 4) for _ in range(6)]
    ys = [torch.randn(3, 2) for _ in range(6)]
    with partime.Pipeline(
        model, "auto", sample=xs[0], executor="process", loss_fn=nn.MSELoss(), optimizer=_sgd, threads=1
    ) as pipe:
        balance = pipe.partition.balance
        results = list(pipe.stream(xs, ys))
    _same(results, _run(model, list(balance), xs, ys, executor="inline"))


@pytest.mark.usefixtures("four_equal_layers")
def test_an_auto_checkpoint_loads_into_an_auto_pipeline(tmp_path) -> None:
    model = nn.Sequential(*_model()[:4])
    xs, ys = [torch.randn(4) for _ in range(6)], [torch.randn(16) for _ in range(6)]
    kw = {"sample": xs[0], "executor": "inline", "loss_fn": nn.MSELoss(), "optimizer": _sgd}
    with partime.Pipeline(model, "auto", **kw) as pipe:
        first = [pipe.step(x, y) for x, y in zip(xs[:3], ys[:3], strict=True)]
        pipe.save(tmp_path / "run.pt")
    with partime.Pipeline(model, "auto", **kw) as again:
        again.load(tmp_path / "run.pt")
        rest = [again.step(x, y) for x, y in zip(xs[3:], ys[3:], strict=True)] + again.flush()
    _same([r for r in first + rest if r is not None], _run(model, [1, 1, 1, 1], xs, ys, executor="inline"))


def test_plan_auto_times_each_depth_with_its_threads(monkeypatch) -> None:
    seen: list[int] = []

    def profile(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return (1.0, 1.0, 1.0)

    monkeypatch.setattr(planner, "profile_layers", profile)
    monkeypatch.setattr(planner, "usable_cores", lambda: 3)
    p = plan(nn.Sequential(*_model()[:3]), "auto", torch.randn(4), threads=lambda d: 6 // d)
    assert seen == [6, 3, 2] and p.balance == (1, 1, 1)
    assert torch.get_num_threads() == 1  # restored (conftest sets one thread)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({}, r"balance='auto' needs sample= .*; or give a number of stages \(e.g. balance=2\)"),
        (
            {"sample": torch.randn(4), "devices": ["cpu", "cpu"]},
            r"devices cannot be given one per stage \(got \['cpu', 'cpu'\]\)",
        ),
        ({"sample": torch.randn(4), "executor": "distributed"}, r"the distributed executor runs one stage per rank"),
    ],
)
def test_auto_says_what_it_needs(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partime.Pipeline(_model(), "auto", **kw)


def test_any_other_string_balance_is_refused_with_the_accepted_forms() -> None:
    with pytest.raises(
        ValueError, match=r"unknown balance 'Auto': give 'auto' .* a number of stages .* layers of each"
    ):
        partime.Pipeline(_model(), "Auto", sample=torch.randn(4))
    with pytest.raises(ValueError, match=r"balance='auto' needs a sample .*: pass sample=, or give the layers"):
        plan(_model(), "auto")


@pytest.mark.usefixtures("four_equal_layers")
@pytest.mark.parametrize(("plain", "depth"), [(4.0, 1), (4.2, 4)])
def test_auto_keeps_a_pipeline_only_if_its_stages_own_ticks_beat_the_plain_model(
    monkeypatch, caplog, plain: float, depth: int
) -> None:
    # the layers' profile predicts 4 stages at 1 s, but each stage's tick, as partime's Stage runs it
    # (a learning stage's second forward, its compensation, its step), takes 3.8 s; the model as
    # one of partime's stages would take longer still, but it is the plain model that "auto" must beat
    monkeypatch.setattr(
        auto_check, "_tick_seconds", lambda index, module, config, value: 3.8 if config.depth > 1 else 9.0
    )
    monkeypatch.setattr(auto_check, "in_turns", lambda *runs: (plain,))  # the plain model's alone
    model = nn.Sequential(*_model()[:4])
    xs = [torch.randn(4) for _ in range(5)]
    with caplog.at_level(logging.INFO, logger="partime.pipeline.pipeline"):
        pipe = partime.Pipeline(model, "auto", sample=xs[0], executor="inline", loss_fn=nn.MSELoss(), optimizer=_sgd)
    assert pipe.depth == depth and pipe.partition is not None and len(pipe.partition.balance) == depth
    said = f"measured 3.8e+03 ms per sample at 4 stages [1, 1, 1, 1] (its stages' ticks), {plain * 1e3:.3g} ms for the plain model"
    if depth == 1:
        assert f"1 stage, no pipeline is measured at least 10% faster: {said}" in caplog.text
    else:
        assert f"4 stages, {said}" in caplog.text


class _Counting(nn.Module):
    """A linear layer that counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.calls = nn.Linear(4, 4), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


def test_a_stages_measured_tick_is_its_work_in_the_pipeline() -> None:
    # stage 0 of 2, learning in stash mode: a forward per tick and, from its delay of 2 ticks on, the
    # product of a late gradient, which runs that sample's forward again, and a step
    config = partime.core.stage.StageConfig(2, nn.MSELoss(), _sgd, "stash")
    counting = _Counting()
    before = counting.linear.weight.detach().clone()
    auto_check._tick_seconds(0, counting, config, torch.randn(1, 4))
    ticks = 2 + auto_check.WARMUP_TICKS + auto_check.TIMED_TICKS
    # the gradient's shape, each tick's forward, and each product but the first (no step came between
    # sample 0's forward and its gradient: its graph still holds)
    assert counting.calls == 1 + ticks + (ticks - 2 - 1)
    assert not torch.equal(counting.linear.weight, before)  # it stepped


@pytest.mark.parametrize("learning", [False, True])
def test_the_plain_models_calls_are_its_own_work_without_partime(learning: bool) -> None:
    # a forward per call (and one for the gradient's shape); learning, a backward of zeros and a
    # step of the pipeline's optimizer on the model's own parameters, with no stage around it
    counting = _Counting()
    before = [p.detach().clone() for p in counting.parameters()]
    config = partime.core.stage.StageConfig(2, nn.MSELoss(), _sgd) if learning else partime.core.stage.StageConfig(2)
    calls = auto_check._plain_calls(counting, config, torch.randn(1, 4))
    for _ in itertools.islice(calls, 5):
        pass
    assert counting.calls == 1 + 5
    assert all(torch.equal(p, b) for p, b in zip(counting.parameters(), before, strict=True))  # zero gradients
    grads = [p.grad for p in counting.parameters()]
    if learning:
        assert all(g is not None and torch.equal(g, torch.zeros_like(g)) for g in grads)
    else:
        assert grads == [None, None]


class _Clock:
    """A clock for ``time.perf_counter`` that moves ``steps[k]`` at its ``k``-th reading, then ``last``."""

    def __init__(self, steps: list[float], last: float) -> None:
        self.now, self.steps, self.last = 0.0, steps, last

    def __call__(self) -> float:
        self.now += self.steps.pop(0) if self.steps else self.last
        return self.now


def _counting(taken: list[int]):
    """Endless items 0, 1, 2, ..., each noted in ``taken`` when it is made."""
    for k in itertools.count():
        taken.append(k)
        yield k


def test_a_window_runs_until_its_seconds_and_items_have_passed(monkeypatch) -> None:
    # items 1/16 s apart: a window of 0.5 s ends at the 8th item after its first, of 1 s at the
    # 16th, of 0.1 s at the 3rd (the fewest, WINDOW_COUNT)
    assert auto_check.WINDOW_COUNT == 3
    monkeypatch.setattr(auto_check.time, "perf_counter", _Clock([], 1 / 16))
    taken: list[int] = []
    run = _counting(taken)
    assert auto_check.window_seconds(run, 0.5) == 1 / 16 and len(taken) == 1 + 8
    assert auto_check.window_seconds(run, 1.0) == 1 / 16 and len(taken) == 9 + 1 + 16
    assert auto_check.window_seconds(run, 0.1) == 1 / 16 and len(taken) == 26 + 1 + 3


def test_runs_in_turns_are_timed_by_the_median_of_their_windows(monkeypatch) -> None:
    # two runs whose items come 1/64 and 1/16 s apart, read off one clock that moves 1/64 s at
    # each reading while the first is taken and 1/16 s while the second is: each run's warm-up,
    # then 4 windows of each in turns, at the fewest items or 0.25 s
    clock = {"step": 0.0, "now": 0.0}

    def reading() -> float:
        clock["now"] += clock["step"]
        return clock["now"]

    def items(step: float, taken: list[float]):
        while True:
            clock["step"] = step
            taken.append(step)
            yield step

    monkeypatch.setattr(auto_check.time, "perf_counter", reading)
    fast: list[float] = []
    slow: list[float] = []
    assert auto_check.in_turns((items(1 / 64, fast), 1), (items(1 / 16, slow), 1)) == (1 / 64, 1 / 16)
    # a warm-up of 0.5 s, then windows of 0.25 s: 1 + 32 and 1 + 16 items of the fast run, 1 + 8
    # and 1 + 4 of the slow one
    assert len(fast) == 33 + 4 * 17 and len(slow) == 9 + 4 * 5
    assert torch.get_num_threads() == 1  # each window at its run's threads, then restored


def test_a_timed_run_that_ends_is_an_error() -> None:
    with pytest.raises(ValueError, match="a timed run ended after 3 items of a window"):
        auto_check.window_seconds(iter(range(3)), 0.5)


@pytest.mark.usefixtures("four_equal_layers")
@pytest.mark.parametrize(("plain", "depth"), [(0.0, 1), (1e9, 4)])
def test_auto_with_workers_measures_a_running_pipeline_of_its_cut(
    monkeypatch, caplog, plain: float, depth: int
) -> None:
    def no_ticks(*args):
        raise AssertionError("the stages' ticks are not what an executor with workers is measured by")

    taken: list[Any] = []

    def in_turns(*runs):  # a few results of the running pipeline, and the plain model's calls
        (results, _), (calls, threads) = runs
        taken.extend(itertools.islice(results, 3))
        next(calls)
        assert threads == os.cpu_count()  # as one stage would have: every core
        return 1.0, plain

    monkeypatch.setattr(auto_check, "_tick_seconds", no_ticks)
    monkeypatch.setattr(auto_check, "in_turns", in_turns)
    model = nn.Sequential(*_model()[:4])
    xs, ys = [torch.randn(4) for _ in range(6)], [torch.randn(16) for _ in range(6)]
    before = [p.detach().clone() for p in model.parameters()]
    kw = {"loss_fn": nn.MSELoss(), "optimizer": _sgd}
    with caplog.at_level(logging.INFO, logger="partime.pipeline.pipeline"):
        with partime.Pipeline(model, "auto", sample=xs[0], executor="thread", **kw) as pipe:
            assert pipe.depth == depth
            results = list(pipe.stream(xs, ys))
    said = f"measured 1e+03 ms per sample at 4 stages [1, 1, 1, 1] (running), {plain * 1e3:.3g} ms for the plain model"
    assert said in caplog.text
    # results of the trial pipeline: the sample's, again and again, with no loss (it learns from zero)
    assert [r.index for r in taken] == [0, 1, 2] and all(r.loss == 0.0 for r in taken)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    # the trial ran on copies: the pipeline learns from its first sample as one that never ran one
    _same(results, _run(model, [1, 1, 1, 1] if depth == 4 else [4], xs, ys, executor="inline"))


@pytest.mark.parametrize("learning", [False, True])
def test_auto_weighs_a_traced_model_against_its_own_forward(monkeypatch, learning: bool) -> None:
    # three layers of one second on three cores: "auto" takes three stages, then times the plain
    # model, which must be the module as its user runs it (its forward), not the graph's layers
    monkeypatch.setattr(planner, "profile_layers", lambda *args, **kwargs: (1.0, 1.0, 1.0))
    monkeypatch.setattr(planner, "usable_cores", lambda: 3)
    monkeypatch.setattr(auto_check, "_tick_seconds", lambda index, module, config, value: float(len(module)))
    runs: list[int] = []

    def in_turns(*runs_given):
        ((calls, _),) = runs_given
        before = CountedForward.runs
        for _ in itertools.islice(calls, 5):
            runs.append(CountedForward.runs - before)
        return (10.0,)

    monkeypatch.setattr(auto_check, "in_turns", in_turns)
    learn = {"loss_fn": nn.MSELoss(), "optimizer": _sgd} if learning else {}
    pipe = partime.Pipeline(CountedForward(), "auto", sample=torch.randn(4), executor="inline", **learn)
    # one run of the forward per call (the first after one more, for the output's shape)
    assert runs == [2, 3, 4, 5, 6] and pipe.depth == 3

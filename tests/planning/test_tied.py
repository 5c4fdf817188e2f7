"""Tests of tied tensors in partime.planning.partition: no cut may give two stages the same parameter."""

from __future__ import annotations

import itertools
import logging
import random

import pytest
import torch
from torch import nn

import partime
from partime.planning import planner
from partime.planning.partition import best_split, check_balance, split
from partime.planning.planner import plan
from partime.planning.ties import Tie, tied_cuts


def _tied(n_between: int = 1) -> tuple[nn.Sequential, nn.Linear]:
    """``emb, ReLU * n_between, emb``: one module, so one weight, at both ends."""
    emb = nn.Linear(8, 8)
    return nn.Sequential(emb, *(nn.ReLU() for _ in range(n_between)), emb), emb


def _decoder_tied() -> nn.Sequential:
    """Weight tying proper: two modules, one weight (child 0 and child 2), biases apart."""
    enc, dec = nn.Linear(8, 8), nn.Linear(8, 8)
    dec.weight = enc.weight
    return nn.Sequential(enc, nn.ReLU(), dec, nn.ReLU(), nn.Linear(8, 8))


def _all_balances(n: int, depth: int, forbidden: set[int]) -> list[tuple[int, ...]]:
    return [
        tuple(b - a for a, b in itertools.pairwise((0, *cuts, n)))
        for cuts in itertools.combinations([k for k in range(1, n) if k not in forbidden], depth - 1)
    ]


def _sums(values: list[float], balance: tuple[int, ...]) -> list[float]:
    edges = list(itertools.accumulate(balance, initial=0))
    return [sum(values[a:b]) for a, b in itertools.pairwise(edges)]


# --- tied_cuts ----------------------------------------------------------------------------


def test_tied_cuts_of_weight_tying_across_children_0_and_2() -> None:
    model = _decoder_tied()
    tie = Tie("parameter", 0, "0.weight", 2, "2.weight")
    assert tied_cuts(model) == {1: tie, 2: tie}
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    assert "0.weight" in names and "2.weight" in names  # the names the model itself gives


def test_tied_cuts_of_a_child_that_appears_twice() -> None:
    lin = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), lin, nn.ReLU(), lin, nn.Linear(4, 4))
    # Both its weight and its bias are shared; the tie named is the first in the model's order.
    tie = Tie("parameter", 1, "1.weight", 3, "3.weight")
    assert tied_cuts(model) == {2: tie, 3: tie}


def test_tied_cuts_of_a_shared_buffer() -> None:
    norm = nn.BatchNorm1d(8)
    model = nn.Sequential(norm, nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8))
    model[2].register_buffer("mean", norm.running_mean)
    tie = Tie("buffer", 0, "0.running_mean", 2, "2.mean")
    assert tied_cuts(model) == {1: tie, 2: tie}


def test_tied_cuts_of_a_nested_child_and_of_three_holders() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    nested = nn.Sequential(nn.Sequential(nn.ReLU(), a), b)
    assert tied_cuts(nested) == {1: Tie("parameter", 0, "0.1.weight", 1, "1.weight")}

    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.ReLU(), lin, nn.ReLU(), lin)  # each holder tied to the next
    first, second = Tie("parameter", 0, "0.weight", 2, "2.weight"), Tie("parameter", 2, "2.weight", 4, "4.weight")
    assert tied_cuts(model) == {1: first, 2: first, 3: second, 4: second}


def test_no_shared_tensor_means_no_tied_cut() -> None:
    act = nn.ReLU()  # appears twice but holds no tensor: nothing is shared
    model = nn.Sequential(nn.Linear(4, 4), act, nn.BatchNorm1d(4), act, nn.Linear(4, 4))
    assert tied_cuts(model) == {}
    check_balance(model, [1, 1, 1, 1, 1])
    assert tied_cuts(nn.Sequential(nn.Linear(2, 2))) == {}


# --- check_balance and Pipeline: a list balance ---------------------------------------------


def test_check_balance_names_the_parameter_and_both_stages() -> None:
    model, _ = _tied()
    with pytest.raises(ValueError) as info:
        check_balance(model, [1, 2])
    assert str(info.value) == (
        'balance [1, 2] splits a shared parameter between stage 0 and stage 1: "0.weight" of '
        'layer 0 (stage 0) is "2.weight" of layer 2 (stage 1), and each stage would update it on '
        "its own (layers: 3); put layers 0 to 2 in one stage: balance=[3] (no cut into 2 stages "
        "keeps the shared tensors together: 1 stage at most), or untie the weights"
    )
    check_balance(model, [3])


def test_check_balance_proposes_a_balance_with_as_many_stages() -> None:
    model = _decoder_tied()  # layers 0 to 2 tied: cuts 3 and 4 are left
    with pytest.raises(ValueError) as info:
        check_balance(model, [1, 2, 2])
    message = str(info.value)
    assert message.startswith("balance [1, 2, 2] splits a shared parameter between stage 0 and stage 1: ")
    assert message.endswith("put layers 0 to 2 in one stage: balance=[3, 1, 1], or untie the weights")
    check_balance(model, [3, 1, 1])
    with pytest.raises(ValueError, match=r"between stage 0 and stage 2: .*\(stage 0\).*\(stage 2\)"):
        check_balance(model, [1, 1, 3])  # the tied layers 0 and 2 lie two stages apart
    with pytest.raises(ValueError, match=r"stage 0 and stage 1: .*balance=\[3, 2\], or untie"):
        check_balance(model, [2, 3])


def test_check_balance_names_a_shared_buffer() -> None:
    norm = nn.BatchNorm1d(8)
    model = nn.Sequential(norm, nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8))
    model[2].register_buffer("mean", norm.running_mean)
    with pytest.raises(
        ValueError,
        match=r'shared buffer between stage 0 and stage 1: "0.running_mean" '
        r'of layer 0 \(stage 0\) is "2.mean" of layer 2 \(stage 1\)',
    ):
        check_balance(model, [2, 2])
    check_balance(model, [3, 1])


def test_pipeline_refuses_a_tied_list_balance_at_construction() -> None:
    model, _ = _tied()
    with pytest.raises(
        ValueError,
        match=r'stage 0 and stage 1: "0.weight" of layer 0 \(stage 0\) is '
        r'"2.weight" of layer 2 \(stage 1\)',
    ):
        partime.Pipeline(model, [1, 2], executor="inline")
    with pytest.raises(ValueError, match=r"splits a shared parameter"):
        split(model, [1, 2])
    with partime.Pipeline(model, [3], executor="inline") as pipe:
        x = torch.randn(8)
        (result,) = list(pipe.stream([x]))
    assert torch.equal(result.output, model(x))


# --- best_split with forbidden cuts (steady_split's: test_steady_cut.py) -----------------------------------


def test_best_split_with_forbidden_cuts_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 8)
        depth = rng.randint(1, n)
        times = [float(rng.randint(0, 4)) if rng.random() < 0.5 else rng.uniform(0, 5) for _ in range(n)]
        forbidden = {k for k in range(1, n) if rng.random() < 0.4}
        balances = _all_balances(n, depth, forbidden)
        if not balances:
            with pytest.raises(ValueError, match=rf"cannot cut {n} layers into {depth} stages without cutting"):
                best_split(times, depth, forbidden=forbidden)
            continue
        got = best_split(times, depth, forbidden=forbidden)
        expected = min(balances, key=lambda b: (sorted(_sums(times, b), reverse=True), b))
        assert got == expected, (times, depth, forbidden)


def test_best_split_without_forbidden_cuts_is_unchanged() -> None:
    rng = random.Random(3)
    for _ in range(100):
        n = rng.randint(1, 8)
        depth = rng.randint(1, n)
        times = [float(rng.randint(0, 3)) for _ in range(n)]
        expected = min(_all_balances(n, depth, set()), key=lambda b: (sorted(_sums(times, b), reverse=True), b))
        assert best_split(times, depth) == best_split(times, depth, forbidden=()) == expected


def test_best_split_rejects_bad_forbidden_cuts() -> None:
    with pytest.raises(ValueError, match=r"forbidden cuts must be ints from 1 to 2 for 3 layers, got \[0, 3\]"):
        best_split([1.0, 1.0, 1.0], 2, forbidden=[0, 1, 3])
    with pytest.raises(
        ValueError, match=r"without cutting at \[1, 2\]: 2 stages need 1 of the 2 positions, and only 0 are left"
    ):
        best_split([1.0, 1.0, 1.0], 2, forbidden=[1, 2])
    assert best_split([1.0, 1.0, 1.0], 1, forbidden=[1, 2]) == (3,)


# --- plan and Pipeline: a number of stages ---------------------------------------------------


@pytest.mark.parametrize("learning", [False, True])
def test_plan_never_cuts_a_tie(monkeypatch: pytest.MonkeyPatch, learning: bool) -> None:
    # With these times the fastest cut of all is [1, 4] (5 | 4), at a tied position; of the
    # allowed cuts (3 and 4), [3, 2] (7 | 2) is fastest, and no other is within 10% of it.
    model = _decoder_tied()
    monkeypatch.setattr(planner, "profile_layers", lambda *args, **kwargs: (5.0, 1.0, 1.0, 1.0, 1.0))
    assert best_split([5.0, 1.0, 1.0, 1.0, 1.0], 2) == (1, 4)
    p = plan(model, 2, torch.randn(8), learning=learning)
    assert p.balance == (3, 2) and p.stage_times == (7.0, 2.0)


def test_pipeline_balanced_by_timing_chooses_an_allowed_cut() -> None:
    torch.manual_seed(0)
    model = _decoder_tied()
    forbidden = set(tied_cuts(model))
    assert forbidden == {1, 2}
    xs = [torch.randn(8) for _ in range(4)]
    with partime.Pipeline(model, 2, sample=xs[0], executor="inline") as pipe:
        assert pipe.partition is not None
        assert pipe.partition.balance in {(3, 2), (4, 1)}
        assert pipe.partition.balance[0] not in forbidden
        outputs = [r.output for r in pipe.stream(xs)]
    assert all(torch.equal(out, model(x)) for out, x in zip(outputs, xs, strict=True))


def test_too_few_allowed_cuts_for_a_number_of_stages() -> None:
    model, _ = _tied(n_between=2)  # emb, ReLU, ReLU, emb: layers 0 to 3 in one stage
    model.append(nn.ReLU())
    check_balance(model, 2)
    with pytest.raises(ValueError) as info:
        check_balance(model, 3)
    assert str(info.value) == (
        "cannot cut 5 layers into 3 stages without splitting a shared parameter or buffer "
        '(balance: 3, layers: 5): layers 0 to 3 must stay in one stage ("0.weight" of layer 0 '
        'is "3.weight" of layer 3), so 2 stages at most: balance=[4, 1], or untie the weights'
    )
    with pytest.raises(ValueError, match=r"cannot cut 5 layers into 3 stages without splitting"):
        partime.Pipeline(model, 3, executor="inline")
    with pytest.raises(ValueError, match=r"so 2 stages at most: balance=\[4, 1\]"):
        plan(model, 3, torch.randn(8))
    assert plan(model, 2, torch.randn(8)).balance == (4, 1)


def test_too_few_allowed_cuts_names_every_run_of_ties() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    model = nn.Sequential(a, a, nn.ReLU(), b, nn.ReLU(), b)  # layers 0-1 and 3-5 each together
    with pytest.raises(
        ValueError,
        match=(
            r'layers 0 to 1 must stay in one stage \("0.weight" of layer 0 is "1.weight" of layer 1\); '
            r'layers 3 to 5 must stay in one stage \("3.weight" of layer 3 is "5.weight" of layer 5\), '
            r"so 3 stages at most: balance=\[2, 1, 3\]"
        ),
    ):
        check_balance(model, 4)
    check_balance(model, 3)


def _tied_past_a_cheap_first_layer() -> nn.Sequential:
    """ReLU, enc, ReLU, Linear, ReLU, dec, with dec's weight enc's: layers 1 to 5 stay together."""
    enc, dec = nn.Linear(8, 8), nn.Linear(8, 8)
    dec.weight = enc.weight
    return nn.Sequential(nn.ReLU(), enc, nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), dec)


def test_a_number_of_stages_that_a_tie_keeps_from_any_useful_cut_is_warned_of(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the only cut into 2 stages the tie allows is [1, 5]: 5 s a sample, against 5.2 s as one
    # stage; [3, 3] would take 3 s, but cuts through the tie
    model = _tied_past_a_cheap_first_layer()
    monkeypatch.setattr(planner, "profile_layers", lambda *args, **kwargs: (0.2, 1.0, 1.0, 1.0, 1.0, 1.0))
    monkeypatch.setattr(planner.hop_cost, "TICK_OVERHEAD_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="partime.planning.planner"):
        assert plan(model, 2, torch.randn(8), learning=True).balance == (1, 5)
    (warned,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == (
        "balance=2: the cut [1, 5] is predicted 5.000 s per sample (its stages: 0.200 / 5.000), against "
        "5.200 s for the model as one stage: no faster, because shared tensors keep every faster cut out: "
        'layers 1 to 5 must stay in one stage ("1.weight" of layer 1 is "5.weight" of layer 5); a cut such '
        "as [3, 3] (3.000 s) would split them. To pipeline this model, untie the weights: give one of the "
        "modules that share a tensor a copy of its own (for a tied language-model head, model.lm_head.weight "
        "= nn.Parameter(model.lm_head.weight.detach().clone())); for inference that changes no output, and "
        "when learning each copy then learns on its own. Or run the model as one stage (balance=1)"
    )


@pytest.mark.parametrize(
    "times",
    [
        (4.0, 1.0, 1.0, 1.0, 1.0, 1.0),  # [1, 5] takes 5 s against 9 s: the cut the tie allows pays
        (0.0, 0.0, 0.0, 0.0, 0.0, 5.0),  # no cut of one layer of 5 s pays: not the tie's doing
    ],
)
def test_a_number_of_stages_whose_tied_cut_pays_or_no_cut_would_is_not_warned_of(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, times: tuple[float, ...]
) -> None:
    monkeypatch.setattr(planner, "profile_layers", lambda *args, **kwargs: times)
    with caplog.at_level(logging.WARNING, logger="partime.planning.planner"):
        assert plan(_tied_past_a_cheap_first_layer(), 2, torch.randn(8)).balance == (1, 5)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

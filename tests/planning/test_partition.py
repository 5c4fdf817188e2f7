"""Tests of partime.planning.partition: checking a balance, splitting, the exact best split, profiling."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from partime.planning.partition import Partition, best_split, check_balance, split
from partime.planning.planner import plan
from partime.planning.profiling import profile_layers
from partime.planning.steady_cut import CUT_NOISE, DELAY_SLACK

# --- best_split ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("times", "depth", "expected"),
    [
        ([1, 1, 1, 1], 2, (2, 2)),
        ([5, 1, 1, 1, 1, 1], 2, (1, 5)),  # sums 5 | 5
        # Largest sum >= 17: the last stage is [9] (then 1..8 in two has a part >= 21),
        # [8, 9] = 17, or more (>= 24). With [8, 9], only 1..5 | 6, 7 keeps both <= 17.
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, (5, 2, 2)),
        # Greedy "close a stage once it reaches the mean (4)" gives (1, 4, 1): 4 | 7 | 1.
        # The optimum is 5: (1, 3, 2) = 4 | 3 | 5 and (2, 2, 2) = 5 | 2 | 5; the tie rule
        # prefers (5, 4, 3) to (5, 5, 2).
        ([4, 1, 1, 1, 4, 1], 3, (1, 3, 2)),
        # Largest sum 5 is forced; (1, 2, 2) = 5 | 2 | 2 beats (1, 1, 3) = 5 | 1 | 3.
        ([5, 1, 1, 1, 1], 3, (1, 2, 2)),
        # All splits give sums sorted (2, 1, 1): the lexicographically smallest balance wins.
        ([1, 1, 1, 1], 3, (1, 1, 2)),
        ([3.0, 0.5, 0.5], 1, (3,)),
        ([3.0, 0.5, 0.5], 3, (1, 1, 1)),
        ([0.0, 0.0, 2.0], 2, (1, 2)),  # 0 | 2 either way: fewer layers first
    ],
)
def test_best_split_known_optimum(times: list[float], depth: int, expected: tuple[int, ...]) -> None:
    assert best_split(times, depth) == expected


def _group_sums(times: list[float], balance: tuple[int, ...]) -> list[float]:
    sums, start = [], 0
    for b in balance:
        sums.append(sum(times[start : start + b]))
        start += b
    return sums


def _all_balances(n: int, depth: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.combinations(range(1, n), depth - 1):
        edges = (0, *cuts, n)
        out.append(tuple(b - a for a, b in itertools.pairwise(edges)))
    return out


@pytest.mark.parametrize("kind", ["floats", "small ints"])
def test_best_split_matches_brute_force(kind: str) -> None:
    rng = random.Random(1234)
    for _ in range(150):
        n = rng.randint(1, 8)
        depth = rng.randint(1, min(4, n))
        if kind == "floats":
            times = [rng.uniform(0.0, 10.0) for _ in range(n)]
        else:
            times = [float(rng.randint(0, 4)) for _ in range(n)]  # many ties
        balances = _all_balances(n, depth)
        got = best_split(times, depth)
        assert len(got) == depth and sum(got) == n and min(got) >= 1
        assert got in balances
        assert max(_group_sums(times, got)) == min(max(_group_sums(times, b)) for b in balances)
        # The documented tie rule: sums sorted largest first, then the balance itself.
        expected = min(balances, key=lambda b: (sorted(_group_sums(times, b), reverse=True), b))
        assert got == expected, (times, depth)


def test_best_split_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"cannot cut 3 layers into 4 stages.*from 1 to 3"):
        best_split([1.0, 2.0, 3.0], 4)
    with pytest.raises(ValueError, match=r"cannot cut 3 layers into 0 stages"):
        best_split([1.0, 2.0, 3.0], 0)
    with pytest.raises(ValueError, match=r"cannot cut 2 layers into True stages"):
        best_split([1.0, 2.0], True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"finite numbers >= 0, got \[1.0, -2.0\]"):
        best_split([1.0, -2.0], 1)
    with pytest.raises(ValueError, match=r"got \[1.0, nan\]"):
        best_split([1.0, float("nan")], 1)
    with pytest.raises(ValueError, match=r"got \[\]"):
        best_split([], 1)


# --- Partition ----------------------------------------------------------------------------


def test_partition_derived_values() -> None:
    p = Partition((2, 3, 3), (1e-3, 2e-4, 4e-4, 5e-4, 4.1e-4, 2e-4, 5e-4, 4.8e-4))
    assert p.depth == 3
    assert p.bounds == ((0, 2), (2, 5), (5, 8))
    assert p.stage_times == pytest.approx((1.2e-3, 1.31e-3, 1.18e-3))
    assert str(p) == "3 stages: [2, 3, 3] layers, predicted 1.20 / 1.31 / 1.18 ms"
    assert str(Partition((4,))) == "1 stage: [4] layers"
    assert Partition((1, 1)).stage_times is None
    assert str(Partition((1, 1), (2e-6, 3.5e-6))) == ("2 stages: [1, 1] layers, predicted 2.00 / 3.50 us")


def test_partition_validates() -> None:
    with pytest.raises(ValueError, match=r"positive ints, got \[2, 0\]"):
        Partition((2, 0))
    with pytest.raises(ValueError, match=r"positive ints, got \[\]"):
        Partition(())
    with pytest.raises(ValueError, match=r"layer_times: 2, sum of balance: 3, balance: \[1, 2\]"):
        Partition((1, 2), (1.0, 2.0))


# --- check_balance ------------------------------------------------------------------------


def _five() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])


@pytest.mark.parametrize("balance", [1, 3, 5, [5], [1, 4], (2, 2, 1), [1, 1, 1, 1, 1], "auto"])
def test_check_balance_accepts(balance: int | list[int]) -> None:
    check_balance(_five(), balance)


@pytest.mark.parametrize(
    ("model", "balance", "error", "match"),
    [
        (
            nn.Linear(2, 2),
            1,
            TypeError,
            r"model must be an nn.Sequential, got Linear; wrap it: nn.Sequential\(model\)",
        ),
        (nn.Sequential(), 1, ValueError, r"empty nn.Sequential"),
        (
            _five(),
            7,
            ValueError,
            (
                r"cannot cut 5 layers into 7 stages: a stage needs at least one layer "
                r"\(balance: 7, layers: 5\)"
            ),
        ),
        (_five(), 0, ValueError, r"cannot cut 5 layers into 0 stages.*\(balance: 0, layers: 5\)"),
        (_five(), -2, ValueError, r"into -2 stages"),
        (_five(), True, TypeError, r"got bool \(True\)"),
        (_five(), 2.0, TypeError, r"got float \(2.0\)"),
        (
            _five(),
            "23",
            ValueError,
            r"unknown balance '23': give 'auto' .*, a number of stages .* or the layers of each",
        ),
        (_five(), b"2", TypeError, r"got bytes \(b'2'\)"),
        (_five(), [], ValueError, r"balance is empty.*layers: 5"),
        (
            _five(),
            [2, 2],
            ValueError,
            (
                r"balance and number of layers differ "
                r"\(layers: 5, sum of balance: 4, balance: \[2, 2\]\)"
            ),
        ),
        (_five(), [3, 3], ValueError, r"\(layers: 5, sum of balance: 6, balance: \[3, 3\]\)"),
        (
            _five(),
            [2, 0, 3],
            ValueError,
            r"at least one layer, got 0 at index 1 \(balance: \[2, 0, 3\]\)",
        ),
        (_five(), [4, -1, 2], ValueError, r"got -1 at index 1"),
        (
            _five(),
            [2, 1.5, 1.5],
            TypeError,
            r"must hold ints, got float \(1.5\) at index 1 \(balance: \[2, 1.5, 1.5\]\)",
        ),
        (_five(), [True, 4], TypeError, r"got bool \(True\) at index 0"),
    ],
)
def test_check_balance_rejects(model: nn.Module, balance: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        check_balance(model, balance)  # type: ignore[arg-type]


# --- split --------------------------------------------------------------------------------


def test_split_shares_the_models_children_in_order() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    stages = split(model, [2, 1, 2])
    assert [len(s) for s in stages] == [2, 1, 2]
    flat = [m for s in stages for m in s]
    assert len(flat) == len(model)
    assert all(a is b for a, b in zip(flat, model, strict=True))
    assert [name for s in stages for name, _ in s.named_children()] == ["0", "1", "2", "3", "4"]
    assert stages[2][1].weight is model[4].weight  # the child keeps its name "4" inside stage 2

    x = torch.randn(5, 3)
    y = x
    for s in stages:
        y = s(y)
    assert torch.equal(y, model(x))

    # Training a stage trains the model.
    before = model[2].weight.detach().clone()
    opt = torch.optim.SGD(stages[1].parameters(), lr=0.1)
    stages[1](torch.randn(5, 4)).sum().backward()
    opt.step()
    assert not torch.equal(model[2].weight, before)


def test_split_keeps_a_repeated_module() -> None:
    act = nn.ReLU()
    model = nn.Sequential(nn.Linear(2, 2), act, nn.Linear(2, 2), act)
    stages = split(model, [2, 2])
    assert stages[0][1] is act and stages[1][1] is act


def test_split_rejects() -> None:
    with pytest.raises(TypeError, match=r"got the int 2; use plan\(\)"):
        split(_five(), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sum of balance: 4"):
        split(_five(), [2, 2])


# --- profile_layers -----------------------------------------------------------------------


class Fork(nn.Module):
    """Returns a tuple: the input, and the input scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x * self.scale


class Join(nn.Module):
    """Takes the tuple of Fork and adds its parts."""

    def forward(self, xs: tuple[Tensor, Tensor]) -> Tensor:
        return xs[0] + xs[1]


def _small_model() -> nn.Sequential:
    return nn.Sequential(
        nn.ReLU(),  # no parameters, input does not require grad: nothing to differentiate
        nn.Linear(6, 8),
        nn.BatchNorm1d(8),
        nn.Dropout(0.5),
        Fork(),
        Join(),
        nn.Linear(8, 3),
    )


@pytest.mark.parametrize("learning", [False, True])
def test_profile_layers_times_each_child_and_leaves_the_model_alone(learning: bool) -> None:
    torch.manual_seed(0)
    model = _small_model().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(4, 6)
    rng = torch.get_rng_state()

    times = profile_layers(model, sample, learning=learning, repeats=3, warmup=1)

    assert len(times) == len(model)
    assert all(isinstance(t, float) and 0 < t < 1.0 for t in times)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model[2].num_batches_tracked.item() == 0
    assert torch.equal(torch.get_rng_state(), rng)  # Dropout ran on a forked RNG
    assert model.training


def test_profile_layers_takes_a_tuple_sample() -> None:
    model = nn.Sequential(Join(), nn.Linear(3, 3))
    times = profile_layers(model, (torch.ones(2, 3), torch.ones(2, 3)), learning=True, repeats=1)
    assert len(times) == 2 and min(times) > 0


class Double(nn.Module):
    """Doubles its input in place."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2)


@pytest.mark.parametrize("learning", [False, True])
def test_profile_layers_copes_with_in_place_children(learning: bool) -> None:
    model = nn.Sequential(Double(), nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 1))
    sample = torch.ones(2, 3, requires_grad=learning)
    times = profile_layers(model, sample, learning=learning, repeats=2, warmup=1)
    assert len(times) == 4 and min(times) > 0
    assert torch.equal(sample, torch.ones(2, 3))  # the user's sample is not doubled
    assert sample.grad is None


def test_profile_layers_names_the_failing_child() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 5))
    with pytest.raises(RuntimeError, match=r"profiling child 1 \(Linear\) failed in its forward"):
        profile_layers(model, torch.ones(2, 4), learning=False, repeats=1, warmup=0)
    with pytest.raises(ValueError, match=r"repeats=0, warmup=1"):
        profile_layers(model, torch.ones(2, 4), learning=False, repeats=0, warmup=1)


# --- plan ---------------------------------------------------------------------------------


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a busy machine, idle OpenMP threads stall for tens of ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _one_heavy_child() -> nn.Sequential:
    # Child 2 costs ~2 * 256 * 16 * 16384 * 2 flops, 2000 times each of the others (~256 * 16 * 16 * 2);
    # with their fixed cost per call, three tiny children still take well under DELAY_SLACK of its time.
    tiny = [nn.Linear(16, 16) for _ in range(5)]
    heavy = nn.Sequential(nn.Linear(16, 16384), nn.Linear(16384, 16))
    return nn.Sequential(tiny[0], tiny[1], heavy, tiny[2], tiny[3], tiny[4])


@pytest.mark.usefixtures("one_thread")
def test_plan_for_inference_takes_the_steady_cut_among_the_fastest() -> None:
    # The heavy child sets the pace wherever the tiny ones go: every cut that gives it a stage of
    # its own or with tiny neighbours is as fast, within noise, and the most even by layer count
    # of those, (2, 2, 2), is the one taken, in every run.
    torch.manual_seed(0)
    model = _one_heavy_child()
    p = plan(model, 3, torch.randn(256, 16), learning=False)
    assert p.depth == 3 and sum(p.balance) == len(model)
    assert p.layer_times is not None and len(p.layer_times) == len(model)
    assert p.balance == (2, 2, 2), str(p)
    fastest = Partition(best_split(p.layer_times, 3, hop_times=p.hop_times, overhead=p.overhead), p.layer_times)
    assert max(Partition(p.balance, p.layer_times).stage_times) <= (1 + CUT_NOISE) * max(fastest.stage_times)
    assert all(q.grad is None for q in model.parameters())


@pytest.mark.usefixtures("one_thread")
def test_plan_for_learning_gives_the_expensive_child_to_the_last_stage() -> None:
    # The heavy child holds most weights, and the tiny ones after it cost less than DELAY_SLACK
    # of its time: the delay-aware cut keeps it out of the delay at hardly any cost in speed.
    torch.manual_seed(0)
    model = _one_heavy_child()
    p = plan(model, 3, torch.randn(256, 16), learning=True)
    assert p.layer_times is not None
    assert p.balance == (1, 1, 4), str(p)
    assert max(p.stage_times) <= (1 + DELAY_SLACK) * max(
        Partition(best_split(p.layer_times, 3), p.layer_times).stage_times
    )
    assert all(q.grad is None for q in model.parameters())


def test_plan_with_a_list_balance_does_not_profile() -> None:
    p = plan(_five(), [2, 3], torch.randn(1, 2))
    assert p == Partition((2, 3), None)


def test_plan_with_a_depth_needs_a_sample() -> None:
    with pytest.raises(ValueError, match=r"balance=2 needs a sample"):
        plan(_five(), 2)
    with pytest.raises(ValueError, match=r"cannot cut 5 layers into 6 stages"):
        plan(_five(), 6, torch.randn(1, 2))


def test_plan_with_one_stage() -> None:
    p = plan(_five(), 1, torch.randn(1, 2))
    assert p.balance == (5,) and p.stage_times is not None and p.stage_times[0] > 0

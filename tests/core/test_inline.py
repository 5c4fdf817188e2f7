"""The inline executor against hand-computed tick traces and plain online learning."""

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import partime
from partime.executors.malloc import keep_freed_memory


def scalar_chain(weights):
    """Stages y = w * x, one per weight, in float64 so that hand-computed values match exactly."""
    layers = []
    for w in weights:
        layer = nn.Linear(1, 1, bias=False).double()
        with torch.no_grad():
            layer.weight.fill_(w)
        layers.append(layer)
    return nn.Sequential(*layers)


def half_square(output, target):
    return 0.5 * ((output - target) ** 2).sum()


def sgd(lr):
    return lambda params: torch.optim.SGD(params, lr=lr)


def run(model, depth, xs, ys, grad_mode, lr=0.1):
    with partime.Pipeline(
        model,
        [len(model) // depth] * depth,
        executor="inline",
        loss_fn=half_square,
        optimizer=sgd(lr),
        grad_mode=grad_mode,
        compensation=(),  # the tick rules alone
    ) as pipe:
        results = list(pipe.stream(xs, ys))
        return results, pipe.module


def column(values):
    return [torch.tensor([[float(v)]], dtype=torch.float64) for v in values]


# The trace of D = 2, w0 = 1, w1 = 2, lr = 0.1, x = 1, 2, 3, y = 1, 1, 1, computed by hand:
#   tick 0: s0 f x0: h0 = 1
#   tick 1: s0 f x1: h1 = 2;  s1 f h0: o0 = 2, loss 0.5, dw1 = 1, delta0 = 1 * 2 = 2, w1 = 1.9
#   tick 2: s0 f x2: h2 = 3;  s0 b(0): partime dw0 = 2 * x2 = 6 -> w0 = 0.4
#                                      stash   dw0 = 2 * x0 = 2 -> w0 = 0.8
#           s1 f h1 = 2: o1 = 3.8, loss 3.92, dw1 = 5.6, delta1 = 2.8 * 1.9 = 5.32, w1 = 1.34
#   tick 3: s0 b(1): partime dw0 = 5.32 * x2 = 15.96 -> w0 = -1.196
#                    stash   dw0 = 5.32 * x1 = 10.64 -> w0 = -0.264
#           s1 f h2 = 3: o2 = 4.02, loss 4.5602, dw1 = 9.06, delta2 = 3.02 * 1.34 = 4.0468, w1 = 0.434
#   tick 4: s0 b(2): dw0 = 4.0468 * x2 = 12.1404 -> partime w0 = -2.41004, stash w0 = -1.47804
@pytest.mark.parametrize(
    "grad_mode, w0",
    [("partime", -2.41004), ("stash", -1.47804), ("weight-stash", -1.47804), ("graph-stash", -1.47804)],
)
def test_hand_computed_trace_d2(grad_mode, w0):
    results, trained = run(scalar_chain([1.0, 2.0]), 2, column([1, 2, 3]), column([1, 1, 1]), grad_mode)
    assert [r.index for r in results] == [0, 1, 2]
    assert [r.output.item() for r in results] == pytest.approx([2.0, 3.8, 4.02])
    assert [r.loss for r in results] == pytest.approx([0.5, 3.92, 4.5602])
    assert trained[0].weight.item() == pytest.approx(w0)
    assert trained[1].weight.item() == pytest.approx(0.434)


def spec_by_hand(weights, xs, ys, grad_mode, lr):
    """SPEC.md's tick rules for scalar stages y = w * x, written out on plain floats.

    Returns the outputs, losses and final weights. Kept apart from partime's own code on purpose.
    """
    depth, n = len(weights), len(xs)
    w = list(weights)
    act = {}  # (stage, sample) -> input of that stage for that sample
    w_at_forward = {}  # (stage, sample) -> weight it went forward with
    newest = [None] * depth
    inbox_grad = [None] * depth  # gradient w.r.t. stage i's output, arriving next tick
    outputs, losses = [None] * n, [None] * n
    for t in range(n + 2 * (depth - 1)):
        next_inbox = [None] * depth
        for i in range(depth):
            s = t - i
            if 0 <= s < n:
                a = xs[s] if i == 0 else act[(i - 1, s)] * w_at_forward[(i - 1, s)]
                act[(i, s)], w_at_forward[(i, s)], newest[i] = a, w[i], a
                if i == depth - 1:
                    out = w[i] * a
                    outputs[s], losses[s] = out, 0.5 * (out - ys[s]) ** 2
                    g = out - ys[s]
                    if i > 0:
                        next_inbox[i - 1] = (s, g * w[i])
                    w[i] -= lr * g * a
            sb = t - 2 * (depth - 1) + i
            if i < depth - 1 and 0 <= sb < n:
                s_, g = inbox_grad[i]
                assert s_ == sb
                a = {"partime": newest[i]}.get(grad_mode, act[(i, sb)])
                w_used = w_at_forward[(i, sb)] if grad_mode == "weight-stash" else w[i]
                if i > 0:
                    next_inbox[i - 1] = (sb, g * w_used)
                w[i] -= lr * g * a
        inbox_grad = next_inbox
    return outputs, losses, w


@pytest.mark.parametrize("grad_mode", ["partime", "stash", "weight-stash", "graph-stash"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_matches_the_spec_written_by_hand(grad_mode, depth):
    gen = torch.Generator().manual_seed(depth)
    weights = (0.5 + torch.rand(depth, generator=gen, dtype=torch.float64)).tolist()
    xs = torch.randn(12, generator=gen, dtype=torch.float64).tolist()
    ys = torch.randn(12, generator=gen, dtype=torch.float64).tolist()
    outputs, losses, w = spec_by_hand(weights, xs, ys, grad_mode, lr=0.05)
    results, trained = run(scalar_chain(weights), depth, column(xs), column(ys), grad_mode, lr=0.05)
    assert [r.output.item() for r in results] == pytest.approx(outputs, rel=1e-12)
    assert [r.loss for r in results] == pytest.approx(losses, rel=1e-12)
    assert [layer.weight.item() for layer in trained] == pytest.approx(w, rel=1e-12)
    if depth == 3:  # the modes really differ where the pipeline is deep enough
        others = {m: spec_by_hand(weights, xs, ys, m, 0.05)[2] for m in ("partime", "stash", "weight-stash")}
        assert len({tuple(v) for v in others.values()}) == 3


@pytest.mark.parametrize(
    "compensation",
    [
        (),
        ("lr-scale",),
        ("weight-prediction",),
        ("delay-correction",),
        ("optimizer-prediction",),
        ("spike",),
        ("long-momentum",),
        ("step-scale",),
        "auto",
    ],
)
@pytest.mark.parametrize("grad_mode", ["partime", "stash", "weight-stash", "graph-stash"])
@pytest.mark.parametrize(
    "make_opt",
    [sgd(0.05), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), lambda p: torch.optim.Adam(p, lr=1e-3)],
    ids=["sgd", "momentum", "adam"],
)
def test_depth_one_is_plain_online_learning(grad_mode, make_opt, compensation):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    plain = copy.deepcopy(model)
    xs, ys = torch.randn(30, 2, 6), torch.randint(0, 3, (30, 2))
    loss_fn = nn.CrossEntropyLoss()
    opt = make_opt(list(plain.parameters()))
    expected = []
    for x, y in zip(xs, ys):
        out = plain(x)
        loss = loss_fn(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append((out.detach(), loss.item()))
    with partime.Pipeline(
        model, 1, executor="inline", loss_fn=loss_fn, optimizer=make_opt, grad_mode=grad_mode, compensation=compensation
    ) as pipe:
        results = list(pipe.stream(xs, ys))
        trained = pipe.module
    for r, (out, loss) in zip(results, expected, strict=True):
        assert torch.equal(r.output, out)
        assert r.loss == loss
    for p, q in zip(trained.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)


def test_inference_equals_the_whole_model():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))
    xs = torch.randn(9, 1, 1, 8, 8)
    with partime.Pipeline(model, [2, 1, 2], executor="inline") as pipe:
        results = list(pipe.stream(xs))
    assert [r.index for r in results] == list(range(9))
    with torch.no_grad():
        for r, x in zip(results, xs):
            assert torch.equal(r.output, model(x))


def test_step_returns_the_result_that_left_this_tick():
    model = scalar_chain([1.0, 1.0, 1.0])
    with partime.Pipeline(model, 3, executor="inline", sample=column([1])[0]) as pipe:
        got = [pipe.step(x) for x in column([1, 2, 3, 4])]
        assert got[:2] == [None, None]
        assert [r.index for r in got[2:]] == [0, 1]
        assert [r.index for r in pipe.flush()] == [2, 3]
        assert pipe.flush() == []
        # a new segment after a flush starts with an empty pipeline; indices keep counting
        assert pipe.step(column([5])[0]) is None
        assert [r.index for r in pipe.flush()] == [4]


FAULTS_PER_TICK = """
import resource, torch
from torch import nn
import partime
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 24, 3, padding=1), *(nn.Conv2d(24, 24, 3, padding=1) for _ in range(3)))
xs = torch.randn(40, 1, 3, 96, 96)  # 884 KB per activation: above glibc's first mmap threshold
with partime.Pipeline(model, [2, 2], executor="inline", threads=1) as pipe:
    results = pipe.stream(iter(xs))
    for _ in range(10):
        next(results)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        next(results)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
    list(results)
"""


@pytest.mark.skipif(not keep_freed_memory(), reason="the C library is not glibc: it has no such thresholds")
def test_the_inline_executor_keeps_freed_memory_for_the_next_tick():
    # a fresh process: every tick maps 4 such blocks afresh (216 pages each) unless freed memory is kept
    run = subprocess.run([sys.executable, "-c", FAULTS_PER_TICK], capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) < 50, run.stdout

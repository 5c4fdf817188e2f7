"""graph-stash: the product of a late gradient runs back through the graph of the sample's own
forward, with the stage's weights as they are when the product runs."""

import pytest
import torch
from torch import nn

import partime
from partime.core.stage.kept_graph import KeptGraph
from partime.errors import StageError

LR = 0.1
N = 7


def two_layer_stage_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 1)).double()


def stream():
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 3, generator=gen, dtype=torch.float64) for _ in range(N)]
    ys = [torch.randn(2, 1, generator=gen, dtype=torch.float64) for _ in range(N)]
    return xs, ys


def by_hand(model, xs, ys):
    """SPEC.md's ticks at D = 2 with stage 0 = Linear, ReLU, Linear and stage 1 = Linear, plain SGD,
    the product of stage 0 written out: its ReLU mask and activations from the sample's own
    forward, its second layer's weight as it is at the product."""
    w1, b1, w2, b2, v, c = (p.detach().clone() for p in model.parameters())
    kept, z0s, arriving = {}, {}, None
    for t in range(N + 2):
        if t < N:  # stage 0, forward of sample t
            h = xs[t] @ w1.T + b1
            r = h.clamp(min=0)
            kept[t] = (xs[t], h, r)
            z0s[t] = r @ w2.T + b2
        sent = None
        if 0 <= t - 1 < N:  # stage 1: forward, loss, backward and step of sample t - 1
            s = t - 1
            out = z0s[s] @ v.T + c
            g = 2 * (out - ys[s]) / out.numel()
            sent = (s, g @ v)
            v, c = v - LR * g.T @ z0s[s], c - LR * g.sum(0)
        if arriving is not None:  # stage 0: the product of the gradient sent last tick
            s, delta = arriving
            x, h, r = kept.pop(s)
            dr = delta @ w2  # the weight now
            dh = dr * (h > 0)  # the mask of the sample's own forward
            w2, b2 = w2 - LR * delta.T @ r, b2 - LR * delta.sum(0)
            w1, b1 = w1 - LR * dh.T @ x, b1 - LR * dh.sum(0)
        arriving = sent
    return [w1, b1, w2, b2, v, c]


def learnt(grad_mode, executor="inline"):
    xs, ys = stream()
    optimizer = lambda params: torch.optim.SGD(params, lr=LR)
    with partime.Pipeline(
        two_layer_stage_model(),
        [3, 1],
        executor=executor,
        loss_fn=nn.MSELoss(),
        optimizer=optimizer,
        grad_mode=grad_mode,
        compensation=(),
    ) as pipe:
        list(pipe.stream(xs, ys))
        return [p.detach().clone() for p in pipe.module.parameters()]


def test_the_product_uses_the_forwards_own_graph_and_the_weights_now():
    xs, ys = stream()
    expected = by_hand(two_layer_stage_model(), xs, ys)
    got = learnt("graph-stash")
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, rtol=1e-12, atol=1e-14)
    # the rule is its own: stash's second forward, with the weights now, gives other weights
    assert not all(torch.allclose(a, b) for a, b in zip(learnt("stash"), expected))


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_every_executor_learns_as_inline(executor):
    for a, b in zip(learnt("graph-stash", executor), learnt("graph-stash"), strict=True):
        assert torch.equal(a, b)


def test_a_dropout_mask_is_the_one_that_made_the_loss():
    torch.manual_seed(0)
    first, mirror = nn.Linear(4, 16), nn.Linear(16, 16)
    with torch.no_grad():  # the last stage shows stage 0's output as it is: zeros where dropped
        mirror.weight.copy_(torch.eye(16))
        mirror.bias.zero_()
    model = nn.Sequential(first, nn.Dropout(0.5), mirror)
    before = first.weight.detach().clone()
    with partime.Pipeline(
        model,
        [2, 1],
        executor="inline",
        loss_fn=lambda out: out.sum(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        grad_mode="graph-stash",
        compensation=(),
    ) as pipe:
        (result,) = pipe.stream([torch.ones(1, 4)])
        after = pipe.module[0].weight.detach()
    dropped = result.output[0] == 0
    assert 0 < int(dropped.sum()) < 16
    assert torch.equal(after[dropped], before[dropped])  # no gradient through a dropped unit
    assert not (after[~dropped] == before[~dropped]).any()


class ChangesItsSavedOutput(nn.Module):
    def forward(self, x):
        y = torch.sigmoid(x)  # sigmoid's backward reads its output
        y.mul_(1.0)
        return y


def test_a_saved_tensor_changed_in_place_is_an_error_naming_the_stage_and_sample():
    model = nn.Sequential(nn.Linear(3, 3), ChangesItsSavedOutput(), nn.Linear(3, 1))
    with partime.Pipeline(
        model,
        [2, 1],
        executor="inline",
        loss_fn=nn.MSELoss(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        grad_mode="graph-stash",
    ) as pipe:
        with pytest.raises(
            StageError, match=r"stage 0: a tensor that the forward of sample 0 saved .* changed in place"
        ):
            list(pipe.stream([torch.ones(2, 3)] * 3, [torch.zeros(2, 1)] * 3))


def test_replaying_a_graph_that_does_not_fit_is_refused():
    layer = nn.Linear(3, 3)
    kept = KeptGraph(0, list(layer.parameters()))
    saved = []
    with kept.keeping(0, saved):
        torch.tanh(layer(torch.ones(2, 3)))
    assert [tuple(t.shape) for t in saved] == [(2, 3), (2, 3)]  # the input, tanh's output; not the weight
    with pytest.raises(ValueError, match=r"stage 0: the checkpoint's graph of sample 0 does not fit .* saved 2"):
        with kept.replaying(0, saved):
            torch.tanh(layer(torch.ones(5, 3)))
    with pytest.raises(ValueError, match=r"it saved 2 tensors, the forward 1"):
        with kept.replaying(0, [t.clone() for t in saved]):
            layer(torch.ones(2, 3))


def normalised_convs(depth=16, channels=8):
    """A chain of Conv, BatchNorm, ReLU: each BatchNorm normalises by statistics of its input."""
    layers = [nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


def normalised_losses(grad_mode, samples=12):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 3, 2, 2, generator=gen) for _ in range(samples)]
    ys = [torch.randint(0, 10, (1,), generator=gen) for _ in range(samples)]
    torch.manual_seed(0)
    model = normalised_convs()
    with partime.Pipeline(
        model,
        [48, 3],
        executor="inline",
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
        grad_mode=grad_mode,
        compensation=(),
        nonfinite="skip",
    ) as pipe:
        return [r.loss for r in pipe.stream(zip(xs, ys))]


def test_a_delayed_stage_with_normalisation_keeps_its_forwards_weights_and_stays_finite():
    """A kept graph's BatchNorm statistics with the weights now scale each late gradient by the
    ratio of spreads now and then, compounded over the chain: this stream reached NaN at sample 5.
    Such a stage forms its products as ``weight-stash`` does."""
    losses = normalised_losses("graph-stash")
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses), losses
    assert losses == normalised_losses("weight-stash")


def test_normalisation_is_named_where_it_uses_its_inputs_statistics():
    from partime.core.stage.kept_graph import normalisation_in

    assert normalisation_in(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) is None
    assert normalisation_in(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))) == "1 (LayerNorm)"
    norm = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    assert normalisation_in(norm) == "1 (BatchNorm2d)"
    assert normalisation_in(norm.eval()) is None  # running statistics: nothing depends on the weights before
    traced = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    assert normalisation_in(traced) is None


def test_a_normalising_stage_resumes_from_a_checkpoint_exactly():
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, 3, 2, 2, generator=gen) for _ in range(10)]
    ys = [torch.randint(0, 10, (1,), generator=gen) for _ in range(10)]

    def pipeline():
        torch.manual_seed(0)
        return partime.Pipeline(
            normalised_convs(depth=4),
            [9, 6],
            executor="inline",
            loss_fn=nn.CrossEntropyLoss(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        )

    with pipeline() as pipe:
        whole = [r.loss for r in pipe.stream(zip(xs, ys))]
    with pipeline() as pipe:
        first = [r.loss for r in (pipe.step(x, y) for x, y in zip(xs[:5], ys[:5])) if r is not None]
        state = pipe.state_dict()
    with pipeline() as pipe:
        pipe.load_state_dict(state)
        rest = [r.loss for r in (pipe.step(x, y) for x, y in zip(xs[5:], ys[5:])) if r is not None]
        rest += [r.loss for r in pipe.flush()]
    assert first + rest == whole

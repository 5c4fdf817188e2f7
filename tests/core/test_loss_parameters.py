"""A loss with parameters is part of the last stage: its parameters learn there (SPEC.md,
"Random and stateful layers")."""

import pytest
import torch
from torch import nn
from torch.nn import functional

import partime


class TemperedCrossEntropy(nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, output, target):
        return functional.cross_entropy(output / self.temperature, target)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def stream(n=20):
    gen = torch.Generator().manual_seed(4)
    return [torch.randn(4, 5, generator=gen) for _ in range(n)], [
        torch.randint(0, 3, (4,), generator=gen) for _ in range(n)
    ]


def adam(params):
    return torch.optim.Adam(params, lr=0.05)


def learnt(executor, depth, loss_fn):
    xs, ys = stream()
    balance = {1: [5], 2: [2, 3], 3: [2, 2, 1]}[depth]
    with partime.Pipeline(model(), balance, executor=executor, loss_fn=loss_fn, optimizer=adam) as pipe:
        losses = [r.loss for r in pipe.stream(xs, ys)]
        return losses, [p.detach().clone() for p in pipe.module.parameters()]


def test_at_depth_one_the_loss_learns_as_in_a_plain_loop():
    xs, ys = stream()
    plain, plain_loss = model(), TemperedCrossEntropy()
    optimizer = adam(list(plain.parameters()) + list(plain_loss.parameters()))
    expected = []
    for x, y in zip(xs, ys):
        loss = plain_loss(plain(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    loss_fn = TemperedCrossEntropy()
    losses, weights = learnt("inline", 1, loss_fn)
    assert losses == expected
    assert torch.equal(loss_fn.temperature, plain_loss.temperature)
    assert all(torch.equal(p, q) for p, q in zip(weights, plain.parameters(), strict=True))


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize("depth", [2, 3])
def test_the_loss_learns_in_the_last_stage_under_every_executor(executor, depth):
    inline_loss, other_loss = TemperedCrossEntropy(), TemperedCrossEntropy()
    reference = learnt("inline", depth, inline_loss)
    other = learnt(executor, depth, other_loss)
    assert other[0] == reference[0]
    assert all(torch.equal(p, q) for p, q in zip(other[1], reference[1], strict=True))
    assert inline_loss.temperature.item() != 1.0  # it learnt, in the caller's own loss
    assert torch.equal(other_loss.temperature, inline_loss.temperature)


def test_a_checkpoint_keeps_the_loss_parameters(tmp_path):
    xs, ys = stream()

    def pipeline(loss_fn):
        return partime.Pipeline(model(), [2, 3], executor="inline", loss_fn=loss_fn, optimizer=adam)

    whole = TemperedCrossEntropy()
    with pipeline(whole) as pipe:
        [pipe.step(x, y) for x, y in zip(xs, ys)]
        pipe.flush()
    first, resumed = TemperedCrossEntropy(), TemperedCrossEntropy()
    with pipeline(first) as pipe:
        [pipe.step(x, y) for x, y in zip(xs[:9], ys[:9])]
        pipe.save(tmp_path / "c.pt")
    with pipeline(resumed) as pipe:
        pipe.load(tmp_path / "c.pt")
        [pipe.step(x, y) for x, y in zip(xs[9:], ys[9:])]
        pipe.flush()
    assert whole.temperature.item() != 1.0
    assert torch.equal(resumed.temperature, whole.temperature)

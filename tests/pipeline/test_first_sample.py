"""What the pipeline runs of a model for itself, as the Pipeline docstring and the tick guide say: at
the first sample, every stage's forward once more on sample 0 (copies, no gradients, none of the
caller's random numbers); a traced model's Python that computes no tensor only when it is traced."""

import pytest
import torch
from models import CountedForward
from torch import nn

import partime

N = 10


NOTES: list[tuple[bool, float]] = []
"""What ``Noted``'s forwards note: a side effect outside the model, which copies of it share."""


class Noted(nn.Module):
    """A linear layer whose forward notes in ``NOTES`` whether gradients are on, and a random number it draws."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        NOTES.append((torch.is_grad_enabled(), torch.rand(()).item()))
        return self.linear(x)


@pytest.mark.parametrize("executor", ["inline", "thread"])
@pytest.mark.parametrize("learning", [False, True])
def test_a_forward_runs_once_a_sample_and_once_more_on_sample_0_without_gradients(executor, learning):
    notes = NOTES
    notes.clear()
    model = nn.Sequential(Noted(), nn.ReLU(), nn.Linear(4, 2))
    xs = [torch.randn(4) for _ in range(N)]
    learn = {"loss_fn": lambda out: out.pow(2).sum(), "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}
    torch.manual_seed(3)
    with partime.Pipeline(model, [1, 2], executor=executor, threads=1, **(learn if learning else {})) as pipe:
        assert notes == []  # nothing runs before the first sample with a balance of layers
        results = list(pipe.stream(xs))
    assert [r.index for r in results] == list(range(N))
    # N + 1 forwards: the first learns the boundaries' layout, without gradients
    assert len(notes) == N + 1
    assert notes[0][0] is False and all(grad is learning for grad, _ in notes[1:])
    # and draws none of the caller's random numbers: stage 0 draws what a plain loop from the seed draws
    torch.manual_seed(3)
    assert [drawn for _, drawn in notes[1:]] == [torch.rand(()).item() for _ in range(N)]


@pytest.mark.parametrize(("sample", "runs"), [(False, 1), (True, 2)])
def test_a_traced_forwards_python_runs_when_it_is_traced_not_per_sample(sample, runs):
    # once as fx traces it, and with sample= once more as the graph is checked against it on the sample
    model = CountedForward()
    xs = [torch.randn(4) for _ in range(N)]
    kw = {"sample": xs[0]} if sample else {}
    before = CountedForward.runs
    with partime.Pipeline(model, [2, 1], executor="inline", **kw) as pipe:
        outputs = [r.output for r in pipe.stream(xs)]
    assert len(outputs) == N and CountedForward.runs - before == runs

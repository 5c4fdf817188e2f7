"""What the caller feeds stays the caller's: a pipeline copies what it keeps (inputs for a late
gradient, targets for the last stage) and computes on contiguous values, so every executor gives
the same results to the bit, whatever buffers the caller reuses and whatever strides its tensors have."""

import pytest
import torch
from models import CONV_BALANCES, conv_net, strided_frames
from torch import nn

import partime

SAMPLES = 12
GRAD_MODES = ["stash", "weight-stash", "partime", "graph-stash"]


def learning(grad_mode):
    return dict(
        loss_fn=nn.CrossEntropyLoss(),
        grad_mode=grad_mode,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    )


def run(executor, xs, ys=None, reuse=False, **kw):
    """Every sample through a pipeline: the results as (index, output, loss), and the weights.
    With ``reuse``, the caller copies each sample and target into one buffer of its own first."""
    with partime.Pipeline(conv_net(), CONV_BALANCES[2], executor=executor, threads=1, **kw) as pipe:
        if reuse:
            x_buffer, y_buffer = torch.empty(1, 3, 8, 8), torch.empty(1, dtype=torch.long)
            results = []
            for s, x in enumerate(xs):
                x_buffer.copy_(x)
                if ys is not None:
                    y_buffer.copy_(ys[s])
                results.append(pipe.step(x_buffer, None if ys is None else y_buffer))
            results = [r for r in results if r is not None] + pipe.flush()
        else:
            results = list(pipe.stream(xs, ys))
        return [(r.index, r.output, r.loss) for r in results], [p.detach().clone() for p in pipe.module.parameters()]


def assert_same(a, b):
    (results_a, params_a), (results_b, params_b) = a, b
    assert [r[0] for r in results_a] == [r[0] for r in results_b] == list(range(SAMPLES))
    for (i, out_a, loss_a), (_, out_b, loss_b) in zip(results_a, results_b):
        assert torch.equal(out_a, out_b), i
        assert loss_a == loss_b, i
    for p, q in zip(params_a, params_b, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("grad_mode", GRAD_MODES)
def test_a_caller_reusing_one_buffer_gets_what_fresh_tensors_give(grad_mode):
    xs, ys = strided_frames(SAMPLES)
    xs = [x.contiguous() for x in xs]
    fresh = run("inline", xs, ys, **learning(grad_mode))
    assert_same(run("inline", xs, ys, reuse=True, **learning(grad_mode)), fresh)


def test_a_caller_reusing_one_buffer_gets_the_same_from_processes():
    xs, ys = strided_frames(SAMPLES)
    assert_same(run("process", xs, ys, reuse=True, **learning("stash")), run("inline", xs, ys, **learning("stash")))


@pytest.mark.parametrize("grad_mode", [None, "stash"], ids=["inference", "learning"])
def test_strided_samples_give_the_same_bits_in_every_executor(grad_mode):
    xs, ys = strided_frames(SAMPLES)
    assert not xs[0].is_contiguous()
    kw = learning(grad_mode) if grad_mode else {}
    targets = ys if grad_mode else None
    inline = run("inline", xs, targets, **kw)
    assert_same(run("process", xs, targets, **kw), inline)
    assert_same(run("inline", [x.contiguous() for x in xs], targets, **kw), inline)  # computed as their copies

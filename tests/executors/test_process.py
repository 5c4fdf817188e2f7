"""The process executor against the inline reference."""

import multiprocessing
import threading

import pytest
import torch
from models import Join, Pair, classification_stream, mlp, reconstruction_loss
from torch import nn

import partime

BALANCES = {1: [7], 2: [3, 4], 3: [2, 3, 2]}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
}


def run(executor, model, balance, xs, ys=None, **kw):
    with partime.Pipeline(model, balance, executor=executor, threads=1, **kw) as pipe:
        results = list(pipe.stream(xs, ys))
        return results, pipe.module


def assert_same(a, b):
    (results_a, model_a), (results_b, model_b) = a, b
    assert [r.index for r in results_a] == [r.index for r in results_b] == list(range(len(results_a)))
    for ra, rb in zip(results_a, results_b):
        assert torch.equal(ra.output, rb.output), ra.index
        assert ra.loss == rb.loss, ra.index
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("executor", ["process", "thread"])
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("grad_mode", ["partime", "stash", "weight-stash", "graph-stash"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_learning_matches_inline(depth, grad_mode, opt, executor):
    xs, ys = classification_stream(120)
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=OPTIMIZERS[opt], grad_mode=grad_mode)
    inline = run("inline", mlp(), BALANCES[depth], xs, ys, **kw)
    other = run(executor, mlp(), BALANCES[depth], xs, ys, **kw)
    assert_same(inline, other)
    # and it learnt something: the weights moved
    assert not torch.equal(next(mlp().parameters()), next(other[1].parameters()))
    assert [t.name for t in threading.enumerate() if t.name.startswith("partime")] == []


def test_inference_equals_the_model_and_leaves_it_untouched():
    model = mlp()
    xs, _ = classification_stream(100)
    results, trained = run("process", model, [2, 2, 3], xs)
    with torch.no_grad():
        for r, x in zip(results, xs, strict=True):
            assert torch.equal(r.output, model(x))
    for p, q in zip(trained.parameters(), mlp().parameters()):
        assert torch.equal(p, q)


def test_tuple_activations_and_unsupervised_loss():
    def model():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 5), Pair(), Join(), nn.Linear(10, 4))

    xs, _ = classification_stream(60)
    kw = dict(loss_fn=reconstruction_loss, optimizer=OPTIMIZERS["sgd"], grad_mode="stash")
    assert_same(run("inline", model(), [2, 2], xs, **kw), run("process", model(), [2, 2], xs, **kw))


def test_step_flush_segments_and_module_between_ticks_match_inline():
    xs, ys = classification_stream(40)
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=OPTIMIZERS["adam"], grad_mode="weight-stash")
    seen = {}
    for executor in ("inline", "process"):
        trace = []
        with partime.Pipeline(mlp(), [2, 3, 2], executor=executor, threads=1, **kw) as pipe:
            for i in range(25):
                r = pipe.step(xs[i], ys[i])
                trace.append(None if r is None else (r.index, r.loss))
                if i in (4, 17):
                    trace.append([p.clone() for p in pipe.module.parameters()])
            trace.append([(r.index, r.loss) for r in pipe.flush()])
            for i in range(25, 40):  # a second segment
                r = pipe.step(xs[i], ys[i])
                trace.append(None if r is None else (r.index, r.loss))
            trace.append([(r.index, r.loss) for r in pipe.flush()])
            trace.append([p.clone() for p in pipe.module.parameters()])
        seen[executor] = trace
    for a, b in zip(seen["inline"], seen["process"], strict=True):
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        else:
            assert a == b


def test_a_failing_stage_raises_with_stage_and_sample_and_stops_every_worker():
    class FailAt(nn.Module):
        def forward(self, x):
            return x

    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3), nn.LogSoftmax(-1))
    xs, _ = classification_stream(30)
    ys = torch.zeros(30, 2, 2, dtype=torch.long)  # per row: the class, and a flag
    ys[13, :, 1] = 1

    def nll(out, y):  # infinite where a flag is set
        return -out.gather(-1, y[:, :1]).mean() / (1 - y[:, 1].max())

    with pytest.raises(partime.StageError, match=r"stage 1, sample 13, loss: .*not finite") as info:
        with partime.Pipeline(model, [2, 2], loss_fn=nll, optimizer=OPTIMIZERS["sgd"], threads=1) as pipe:
            for x, y in zip(xs, ys):
                pipe.step(x, y)
    assert info.value.stage == 1 and info.value.sample == 13
    assert "FloatingPointError" in info.value.traceback
    assert multiprocessing.active_children() == []

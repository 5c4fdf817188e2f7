"""``nonfinite="skip"``: a sample with a non-finite input or loss is dropped from learning and
reported; the inline executor states it, the process executor matches it to the bit."""

import pytest
import torch
from models import mlp, nonfinite_stream, scaled_loss

import partime

BALANCES = {1: [7], 2: [3, 4], 3: [2, 3, 2]}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def run(executor, balance, xs, ys, **kw):
    with partime.Pipeline(
        mlp(), balance, executor=executor, threads=1, loss_fn=scaled_loss, optimizer=sgd, nonfinite="skip", **kw
    ) as pipe:
        return list(pipe.stream(xs, ys)), pipe.module


def test_at_one_stage_a_skipped_sample_is_one_that_was_never_there():
    holes, infinite = (0, 4, 5), (2, 9)
    xs, ys = nonfinite_stream(14, holes, infinite)
    results, trained = run("inline", [7], xs, ys)
    kept = [s for s in range(14) if s not in holes + infinite]
    plain, plain_model = run("inline", [7], [xs[s] for s in kept], [ys[s] for s in kept])
    assert [r.index for r in results] == list(range(14))
    assert [r.index for r in results if r.skipped] == [0, 2, 4, 5, 9]
    for s in holes:
        assert results[s].output is None and results[s].loss is None
    for s in infinite:
        assert results[s].output.shape == (2, 3) and results[s].loss == float("inf")
    assert [results[s].loss for s in kept] == [r.loss for r in plain]
    for p, q in zip(trained.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("grad_mode", ["partime", "stash", "weight-stash", "graph-stash"])
def test_when_every_sample_is_skipped_no_stage_ever_steps(grad_mode):
    xs, ys = nonfinite_stream(8, infinite=range(8))
    results, trained = run("inline", BALANCES[3], xs, ys, grad_mode=grad_mode)
    model = mlp()
    with torch.no_grad():
        assert all(r.skipped and torch.equal(r.output, model(x)) for r, x in zip(results, xs, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), model.parameters()))
    xs, ys = nonfinite_stream(8, holes=range(8))
    results, trained = run("inline", BALANCES[3], xs, ys, grad_mode=grad_mode)
    assert [(r.index, r.output, r.loss, r.skipped) for r in results] == [(s, None, None, True) for s in range(8)]
    assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), model.parameters()))


def test_a_skipped_sample_leaves_the_others_alone_in_inference():
    xs, _ = nonfinite_stream(6, holes=(0, 3))
    with partime.Pipeline(mlp(), BALANCES[3], executor="inline", nonfinite="skip") as pipe:
        results = list(pipe.stream(xs))
    model = mlp()
    assert [r.skipped for r in results] == [True, False, False, True, False, False]
    with torch.no_grad():
        for r, x in zip(results, xs):
            assert r.output is None if r.skipped else torch.equal(r.output, model(x))


@pytest.mark.parametrize("grad_mode", ["partime", "stash", "weight-stash", "graph-stash"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_process_matches_inline_with_skipped_samples(depth, grad_mode):
    xs, ys = nonfinite_stream(30, holes=(0, 7, 8, 21, 29), infinite=(3, 8, 12, 13, 28))
    kw = dict(grad_mode=grad_mode, compensation="weight-prediction" if depth == 3 else ())
    inline, inline_model = run("inline", BALANCES[depth], xs, ys, **kw)
    process, process_model = run("process", BALANCES[depth], xs, ys, **kw)
    assert [r.index for r in process] == list(range(30))
    assert [r.skipped for r in process] == [r.skipped for r in inline]
    assert sum(r.skipped for r in process) == 9
    for a, b in zip(inline, process, strict=True):
        assert a.loss == b.loss, a.index
        assert (a.output is None and b.output is None) or torch.equal(a.output, b.output), a.index
    for (name, p), q in zip(inline_model.named_parameters(), process_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(next(inline_model.parameters()), next(mlp().parameters()))  # it learnt


@pytest.mark.parametrize("executor", ["inline", "process"])
@pytest.mark.parametrize("grad_mode", ["partime", "weight-stash"])
def test_a_checkpoint_with_skipped_samples_in_flight_resumes_exactly(tmp_path, executor, grad_mode):
    # Holes and gradients that will not come are in transit at the stop (samples 5-7 around tick 8),
    # and the targets fed last were used already (the holes that follow them have none).
    xs, ys = nonfinite_stream(14, holes=(6, 7, 9), infinite=(5,))
    kw = dict(loss_fn=scaled_loss, optimizer=sgd, nonfinite="skip", grad_mode=grad_mode, threads=1)

    def play(pipe, samples):
        out = [r for s in samples if (r := pipe.step(xs[s], ys[s])) is not None]
        return out

    with partime.Pipeline(mlp(), [2, 3, 2], executor="inline", **kw) as pipe:
        whole = play(pipe, range(14)) + pipe.flush()
        whole_model = pipe.module
    with partime.Pipeline(mlp(), [2, 3, 2], executor=executor, **kw) as pipe:
        first = play(pipe, range(8))
        pipe.save(tmp_path / "ckpt.pt")
    with partime.Pipeline(mlp(seed=1), [2, 3, 2], executor=executor, **kw) as pipe:
        pipe.load(tmp_path / "ckpt.pt")
        rest = play(pipe, range(pipe.fed, 14)) + pipe.flush()
        model = pipe.module
    results = first + rest
    assert [r.index for r in results] == list(range(14))
    assert [(r.index, r.skipped, r.loss) for r in results] == [(r.index, r.skipped, r.loss) for r in whole]
    for r, w in zip(results, whole):
        assert (r.output is None and w.output is None) or torch.equal(r.output, w.output)
    for p, q in zip(model.parameters(), whole_model.parameters(), strict=True):
        assert torch.equal(p, q)

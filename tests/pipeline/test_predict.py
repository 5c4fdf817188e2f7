"""Predicting without learning inside a learning stream (``Pipeline.predict``, ``step(learn=False)``,
``stream(learn=...)``): a predicted sample goes forward through the weights of its ticks, in its
order among the learnt ones, and is not learnt from. At D = 1 it is a plain loop's
``with torch.no_grad(): model(x)`` between learning steps, to the bit; at D = 2 and 3 every executor
equals inline."""

import itertools
import math

import pytest
import torch
from models import classification_stream, mlp, reconstruction_loss, scaled_loss
from torch import nn

import partime
from partime.metrics import OnlineMetrics

BALANCES = {1: [8], 2: [4, 4], 3: [3, 3, 2]}
MLP_BALANCES = {2: [3, 4], 3: [2, 3, 2]}
GRAD_MODES = ["partime", "stash", "weight-stash", "graph-stash"]
N = 16
LEARN = [s % 4 != 2 and s not in (5, 6) for s in range(N)]  # predicted: 2, 5, 6, 10, 14 (two in a row)


def net(seed=0):
    """Random and stateful layers in the first two stages: dropout, and BatchNorm in training mode."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Dropout(0.25),
        nn.Linear(8, 8),
        nn.ReLU(),
        nn.Dropout(0.25),
        nn.Linear(8, 3),
    )


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def stream():
    xs, ys = classification_stream(N)
    return list(xs), list(ys)


def run(executor, depth, learn=LEARN, model=None, seed=5, **kw):
    """The results and the trained module of ``model`` (``net()``) streamed with ``learn``, made
    right after ``torch.manual_seed(seed)``."""
    xs, ys = stream()
    options = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, threads=1) | kw
    model = net() if model is None else model
    torch.manual_seed(seed)
    with partime.Pipeline(model, BALANCES[depth], executor=executor, **options) as pipe:
        results = list(pipe.stream(xs, ys, learn=learn))
        return results, pipe.module


def assert_same(a, b):
    (results_a, model_a), (results_b, model_b) = a, b
    assert [(r.index, r.predicted, r.loss) for r in results_a] == [(r.index, r.predicted, r.loss) for r in results_b]
    for r, q in zip(results_a, results_b, strict=True):
        assert torch.equal(r.output, q.output), r.index
    for (name, p), q in zip(model_a.state_dict().items(), model_b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_at_one_stage_it_is_the_plain_loop_with_no_grad_forwards_between_learning_steps():
    results, trained = run("inline", 1)
    xs, ys = stream()
    model = net()
    optimizer, loss_fn = sgd(model.parameters()), nn.CrossEntropyLoss()
    torch.manual_seed(5)  # as the pipeline was made: its stage continues this random state
    expected = []
    for x, y, learn in zip(xs, ys, LEARN):
        if learn:
            out = model(x)
            loss = loss_fn(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            expected.append((out.detach(), loss.item()))
        else:
            with torch.no_grad():
                expected.append((model(x), None))
    assert [r.index for r in results] == list(range(N))
    assert [r.predicted for r in results] == [not learn for learn in LEARN]
    for r, (out, loss), y in zip(results, expected, ys):
        assert torch.equal(r.output, out), r.index
        assert r.loss == loss, r.index
        assert torch.equal(r.target, y)  # a predicted sample's target is kept for its result
    for (name, p), q in zip(trained.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name  # weights, and BatchNorm's statistics: each forward counted once
    assert trained[1].num_batches_tracked == N


@pytest.mark.parametrize("grad_mode", GRAD_MODES)
@pytest.mark.parametrize("depth", [2, 3])
def test_every_executor_predicts_and_learns_as_inline(depth, grad_mode):
    kw = dict(grad_mode=grad_mode)
    if depth == 3 and grad_mode == "partime":
        kw["compensation"] = ("weight-prediction", "delay-correction")
    inline = run("inline", depth, **kw)
    assert [r.predicted for r in inline[0]] == [not learn for learn in LEARN]
    assert all((r.loss is None) == r.predicted for r in inline[0])
    assert not torch.equal(inline[1][0].weight, net()[0].weight)  # it learnt
    for executor in ("thread", "process"):
        assert_same(run(executor, depth, **kw), inline)


@pytest.mark.parametrize("grad_mode", ["stash", "weight-stash", "graph-stash"])
@pytest.mark.parametrize("depth", [2, 3])
def test_a_predicted_sample_is_what_a_learnt_one_with_no_gradient_would_give(depth, grad_mode):
    # With plain SGD (and no compensation, whose predicted weights a learnt forward would run with) a
    # zero loss moves no weight: the same sample learnt with a zero loss goes forward through the very
    # weights a predicted one does, at every stage, and changes nothing. (Not under "partime", whose
    # products use the stage's newest learnt input: a predicted sample's is kept for none.)
    xs, ys = classification_stream(N)
    scales = [torch.ones(1) if learn else torch.zeros(1) for learn in LEARN]
    targets = list(zip(ys, scales))
    kw = dict(loss_fn=scaled_loss, optimizer=plain_sgd, grad_mode=grad_mode, compensation=(), threads=1)
    with partime.Pipeline(mlp(), MLP_BALANCES[depth], executor="inline", **kw) as pipe:
        zero = list(pipe.stream(list(xs), targets))
        zero_model = pipe.module
    with partime.Pipeline(mlp(), MLP_BALANCES[depth], executor="inline", **kw) as pipe:
        stepped = [pipe.step(x, t, learn=learn) for x, t, learn in zip(xs, targets, LEARN)] + pipe.flush()
        predicted_model = pipe.module
    predicted = [r for r in stepped if r is not None]
    assert [r.index for r in predicted] == list(range(N))
    assert [r.predicted for r in predicted] == [not learn for learn in LEARN]
    for r, z in zip(predicted, zero, strict=True):
        assert torch.equal(r.output, z.output), r.index
        assert r.loss == (None if r.predicted else z.loss), r.index
    for p, q in zip(predicted_model.parameters(), zero_model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(predicted_model[0].weight, mlp()[0].weight)  # it learnt


def test_a_stream_of_predictions_alone_is_the_model_under_no_grad_and_learns_nothing():
    xs, _ = stream()
    results, trained = run("inline", 3, learn=itertools.repeat(False), model=net().eval())
    with torch.no_grad():
        for r, x in zip(results, xs, strict=True):
            assert r.predicted and r.loss is None and torch.equal(r.output, net().eval()(x)), r.index
    for (name, p), q in zip(trained.state_dict().items(), net().state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    # in training mode, a forward under no_grad updates BatchNorm's statistics, as a plain loop's does
    results, trained = run("inline", 3, learn=itertools.repeat(False))
    assert all(r.predicted and r.loss is None for r in results)
    for p, q in zip(trained.parameters(), net().parameters(), strict=True):
        assert torch.equal(p, q)  # no stage stepped
    assert trained[1].num_batches_tracked == N
    assert not torch.equal(trained[1].running_mean, net()[1].running_mean)


def test_in_a_pipeline_that_does_not_learn_predict_is_step():
    xs, _ = stream()
    outs = []
    for verb in ("step", "predict"):
        torch.manual_seed(3)
        with partime.Pipeline(net(), BALANCES[3], executor="inline") as pipe:
            call = getattr(pipe, verb)
            results = [call(x) for x in xs] + pipe.flush()
        outs.append([r for r in results if r is not None])
    for a, b in zip(*outs, strict=True):
        assert (a.index, a.loss, a.predicted) == (b.index, b.loss, b.predicted) == (a.index, None, False)
        assert torch.equal(a.output, b.output)


def test_a_target_given_with_a_prediction_is_kept_for_its_result_and_not_learnt_from():
    xs, ys = stream()
    kw = dict(executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, threads=1)
    seen = []
    for with_target in (True, False):
        torch.manual_seed(5)
        with partime.Pipeline(net(), BALANCES[2], **kw) as pipe:
            out = [pipe.step(xs[0], ys[0])]
            for s in range(1, N):
                out.append(pipe.predict(xs[s], ys[s] if with_target else None) if s % 3 else pipe.step(xs[s], ys[s]))
            results = [r for r in out + pipe.flush() if r is not None]
            seen.append((results, pipe.module))
    (given, given_model), (bare, bare_model) = seen
    assert [r.index for r in given] == list(range(N))
    for r, b, y in zip(given, bare, ys, strict=True):
        assert r.predicted == b.predicted == bool(r.index % 3)
        assert torch.equal(r.output, b.output) and r.loss == b.loss
        assert torch.equal(r.target, y)
        assert b.target is None if b.predicted else torch.equal(b.target, y)
    for p, q in zip(given_model.parameters(), bare_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_first_prediction_without_a_target_needs_the_targets_layout():
    xs, ys = stream()
    kw = dict(executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    with partime.Pipeline(net(), BALANCES[2], **kw) as pipe:
        with pytest.raises(ValueError, match=r"sample 0 is to be predicted without a target.*predict\(x, y\)"):
            pipe.predict(xs[0])
        assert pipe.fed == 1  # its index is used up
        pipe.start(xs[0], ys[0])
        assert pipe.predict(xs[1]) is None
        results = [pipe.step(xs[2], ys[2])] + pipe.flush()
    assert [(r.index, r.predicted, r.loss is None) for r in results] == [(1, True, True), (2, False, False)]
    # a loss that takes no target: nothing to learn the layout of
    with partime.Pipeline(net(), BALANCES[2], executor="inline", loss_fn=reconstruction_loss, optimizer=sgd) as pipe:
        assert pipe.predict(xs[0]) is None
        with pytest.raises(ValueError, match="sample 1 came with a target, but loss_fn takes no target"):
            pipe.predict(xs[1], ys[1])
        assert [(r.index, r.predicted) for r in pipe.flush()] == [(0, True)]


def test_learn_flags_are_checked():
    xs, ys = stream()
    kw = dict(executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    with partime.Pipeline(net(), BALANCES[2], **kw) as pipe:
        with pytest.raises(TypeError, match=r"learn must be True or False, got 0 \(int\)"):
            pipe.step(xs[0], ys[0], learn=0)
        assert pipe.fed == 0  # nothing was fed
        with pytest.raises(ValueError, match="learn ended before xs: there is no flag for sample 2"):
            list(pipe.stream(xs[:4], ys[:4], learn=[True, False]))
    with partime.Pipeline(net(), BALANCES[2], **kw) as pipe:
        with pytest.raises(TypeError, match=r"learn's flag for sample 1 must be True or False, got None"):
            list(pipe.stream(xs[:4], ys[:4], learn=[True, None, True, True]))


def test_a_prediction_under_no_grad_is_refused_as_a_step_is():
    xs, ys = stream()
    with partime.Pipeline(net(), BALANCES[2], executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd) as pipe:
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"predict\(\) was called under torch.no_grad"):
            pipe.predict(xs[0], ys[0])
        assert pipe.fed == 0  # nothing was fed


def test_pairs_and_dropped_samples_take_their_flags_in_order():
    from partime.sources import FakeClock, at_rate

    clock = FakeClock()

    class Slow(nn.Module):  # each forward takes 0.15 s of the fake clock: a 10 fps source is too fast
        def forward(self, x):
            clock.advance(0.15)
            return x

    xs, ys = stream()
    model = nn.Sequential(Slow(), *net())
    flags = [s % 3 != 1 for s in range(N)]
    pairs = [(x, y if learn else None) for x, y, learn in zip(xs, ys, flags)]  # a prediction without its target
    kw = dict(executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    with partime.Pipeline(model, [4, 5], **kw) as pipe:
        results = list(pipe.stream(at_rate(pairs, 10, clock=clock), when_behind="drop", learn=flags))
    assert [r.index for r in results] == list(range(N))
    kept = [r for r in results if not r.dropped]
    assert 0 < len(kept) < N
    assert [r.predicted for r in kept] == [not flags[r.index] for r in kept]
    assert all((r.loss is None) == r.predicted and (r.target is None) == r.predicted for r in kept)


@pytest.mark.parametrize("executor", ["inline", "process"])
@pytest.mark.parametrize("grad_mode", ["partime", "graph-stash"])
def test_a_checkpoint_with_predictions_in_flight_resumes_exactly(tmp_path, executor, grad_mode):
    # D = 3: stopped inside a stream after the result of sample 8, with sample 9's result held (a
    # prediction), predicted activations and their gradients that will not come in transit (5, 6, 10).
    xs, ys = stream()
    learn = [s not in (5, 6, 9, 10) for s in range(N)]
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, grad_mode=grad_mode, threads=1)
    with partime.Pipeline(net(), BALANCES[3], executor="inline", **kw) as pipe:
        whole = list(pipe.stream(xs, ys, learn=learn))
        whole_model = pipe.module
    first = []
    with partime.Pipeline(net(), BALANCES[3], executor=executor, **kw) as pipe:
        for r in pipe.stream(xs, ys, learn=learn):
            first.append(r)
            if r.index == 8:
                state = pipe.state_dict()
                pipe.save(tmp_path / "ckpt.pt")
                break
    (held,) = state["held"]
    assert (held["index"], held["loss"], held["predicted"]) == (9, None, True)
    assert torch.equal(held["output"][0], whole[9].output)
    acts, grads = state["transit"]["acts"], state["transit"]["grads"]
    assert [(a["sample"], a.get("predicted", False)) for a in acts[1:]] == [(11, False), (10, True)]
    assert grads[1] == {"sample": 9, "tensors": None}  # the gradient that will not come
    with partime.Pipeline(net(seed=1), BALANCES[3], executor=executor, **kw) as pipe:
        pipe.load(tmp_path / "ckpt.pt")
        fed = pipe.fed
        rest = list(pipe.stream(xs[fed:], ys[fed:], learn=learn[fed:]))
        model = pipe.module
    results = first + rest
    assert_same((results, model), (whole, whole_model))
    assert [r.index for r in results if r.predicted] == [5, 6, 9, 10]


def test_online_metrics_score_predictions_by_their_targets_and_count_them():
    xs, ys = stream()
    learn = [s % 2 == 0 for s in range(N)]
    labelled = [y if learn[s] or s % 4 == 1 else None for s, y in enumerate(ys)]  # 3, 7, 11, 15: no target
    every, held_out = OnlineMetrics(), OnlineMetrics()
    kw = dict(executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    with partime.Pipeline(net(), BALANCES[2], **kw) as pipe:
        results = []
        for r in pipe.stream(xs, labelled, learn=learn):
            every.update(r.output, r.target, loss=r.loss, predicted=r.predicted)
            if r.predicted:  # the held-out samples apart
                held_out.update(r.output, r.target, predicted=True)
            results.append(r)
    assert (every.count, every.predicted, every.unscored, every.rows) == (N, 8, 4, 2 * 12)  # 2 rows a sample
    learnt = [r.loss for r in results if not r.predicted]
    assert len(learnt) == 8 and every.loss == pytest.approx(sum(learnt) / 8)  # the learnt samples' alone
    scored = [r for r in results if r.predicted and r.target is not None]
    hits = sum(int((r.output.argmax(-1) == r.target).sum()) for r in scored)
    assert (held_out.count, held_out.predicted, held_out.unscored, held_out.rows) == (8, 8, 4, 8)
    assert held_out.accuracy == hits / 8 and math.isnan(held_out.loss)
    assert "unscored=4, predicted=8" in repr(every)
    with pytest.raises(ValueError, match=r"for a predicted result.*pass predicted=r.predicted"):
        OnlineMetrics().update(results[3].output, results[3].target, loss=results[3].loss)

"""Frozen layers and named parameters: a stage with nothing to train before it takes no gradient
and runs no backward, fine-tuning a head through a pipeline is the plain loop at every depth, and
each stage's optimizer factory is handed its parameters by the model's own names."""

import collections

import pytest
import torch
from models import mlp
from torch import nn
from traced_models import make, samples

import partime
from partime.core.stage import Stage

MSE = nn.MSELoss()
BALANCES = {1: [7], 2: [3, 4], 3: [2, 3, 2]}
HEAD = 6  # mlp()'s last Linear


def stream(n=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, generator=gen), torch.randn(n, 2, 3, generator=gen)


XS, YS = stream()


def adam(named):
    return torch.optim.Adam(named, lr=1e-2)


def adamw_by_name(named):
    """The usual recipe: weight decay on the weights, none on the biases, chosen by name."""
    named = list(named)
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def sgd(named):
    return torch.optim.SGD(named, lr=0.05, momentum=0.9)


def head_only(model):
    for k, layer in enumerate(model):
        layer.requires_grad_(k == HEAD)
    return model


def middle_frozen(model):
    model[2].requires_grad_(False)  # all of stage 1 at D = 3: the stages on either side train
    model[4].requires_grad_(False)
    return model


def plain_loop(freeze, optimizer):
    model = freeze(mlp())
    opt = optimizer((n, p) for n, p in model.named_parameters() if p.requires_grad)
    losses = []
    for x, y in zip(XS, YS):
        loss = MSE(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def piped(depth, freeze, optimizer, executor="inline"):
    model = freeze(mlp())
    with partime.Pipeline(model, BALANCES[depth], executor=executor, threads=1, loss_fn=MSE, optimizer=optimizer) as p:
        losses = [r.loss for r in p.stream(XS, YS)]
        return losses, [q.detach().clone() for q in p.module.parameters()]


def same(a, b):
    (losses_a, weights_a), (losses_b, weights_b) = a, b
    return losses_a == losses_b and all(torch.equal(p, q) for p, q in zip(weights_a, weights_b, strict=True))


# -- a frozen backbone ----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", [sgd, adam, adamw_by_name], ids=["sgd", "adam", "adamw-by-name"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_fine_tuning_the_head_is_the_plain_loop_to_the_bit_at_every_depth(depth, optimizer):
    # the last stage steps for the sample it has just run: a head alone learns without delay
    reference = plain_loop(head_only, optimizer)
    assert same(piped(depth, head_only, optimizer), reference)
    if depth > 1:
        assert same(piped(depth, head_only, optimizer, "thread"), reference)


def test_fine_tuning_the_head_is_the_plain_loop_in_stage_processes():
    assert same(piped(3, head_only, adamw_by_name, "process"), plain_loop(head_only, adamw_by_name))


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_stage_before_every_trained_one_runs_no_backward_and_is_sent_no_gradient(executor, monkeypatch):
    backwards = collections.Counter()
    graphs = collections.Counter()  # forwards of a stage's layers run with autograd on
    real_backward = Stage.backward

    def counted(stage, sample, grad):
        backwards[stage.index] += 1
        return real_backward(stage, sample, grad)

    monkeypatch.setattr(Stage, "backward", counted)
    model = head_only(mlp())
    for k, layer in enumerate(model):
        layer.register_forward_hook(lambda module, args, out, k=k: graphs.update([k] * torch.is_grad_enabled()))
    with partime.Pipeline(model, BALANCES[3], executor=executor, threads=1, loss_fn=MSE, optimizer=adam) as pipe:
        results = list(pipe.stream(XS, YS))
    assert len(results) == len(XS)
    assert backwards == {}  # stages 0 and 1 take no gradient; the last one learns in its forward half
    assert set(graphs) == {5, 6}  # only the last stage's layers ran with a graph
    assert graphs[6] == len(XS)


@pytest.mark.parametrize("depth", [2, 3])
def test_a_frozen_stage_between_trained_ones_passes_the_gradient_on_alike_under_every_executor(depth):
    reference = piped(depth, middle_frozen, adamw_by_name)
    for executor in ("thread", "process"):
        assert same(piped(depth, middle_frozen, adamw_by_name, executor), reference), executor
    untouched = middle_frozen(mlp())
    _, weights = reference
    assert torch.equal(weights[2], untouched[2].weight) and torch.equal(weights[4], untouched[4].weight)
    assert not torch.equal(weights[0], untouched[0].weight)  # the gradient reached stage 0 through them


def test_a_frozen_stage_between_trained_ones_at_depth_one_is_the_plain_loop_to_the_bit():
    assert same(piped(1, middle_frozen, adamw_by_name), plain_loop(middle_frozen, adamw_by_name))


def test_a_head_being_fine_tuned_resumes_exactly_from_a_checkpoint(tmp_path):
    def pipeline(executor="inline"):
        model = head_only(mlp())
        return partime.Pipeline(model, BALANCES[3], executor=executor, threads=1, loss_fn=MSE, optimizer=adam)

    with pipeline() as pipe:
        reference = [r.loss for r in pipe.stream(XS, YS)]
        final = [p.detach().clone() for p in pipe.module.parameters()]
    with pipeline() as pipe:
        before = [r for x, y in zip(XS[:5], YS[:5]) if (r := pipe.step(x, y)) is not None]
        pipe.save(tmp_path / "head.pt")
    with pipeline("process") as pipe:
        pipe.load(tmp_path / "head.pt")
        after = [r for x, y in zip(XS[5:], YS[5:]) if (r := pipe.step(x, y)) is not None] + pipe.flush()
        assert [r.loss for r in before + after] == reference
        assert all(torch.equal(p, q) for p, q in zip(pipe.module.parameters(), final, strict=True))


# -- named parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_factory_grouping_by_name_is_the_plain_loop_at_depth_one_and_alike_under_every_executor(depth):
    reference = piped(depth, lambda m: m, adamw_by_name)
    if depth == 1:
        assert same(reference, plain_loop(lambda m: m, adamw_by_name))
    else:
        for executor in ("thread", "process"):
            assert same(piped(depth, lambda m: m, adamw_by_name, executor), reference), executor
    assert not same(piped(depth, lambda m: m, lambda named: torch.optim.AdamW(named, lr=1e-2)), reference)


def test_each_stage_s_factory_is_handed_its_parameters_by_the_model_s_own_names():
    calls = []

    def recording(named):
        named = list(named)
        calls.append([n for n, _ in named])
        return adamw_by_name(named)

    model = head_only(mlp())
    model[0].requires_grad_(True)
    with partime.Pipeline(model, BALANCES[3], executor="inline", loss_fn=MSE, optimizer=recording) as pipe:
        list(pipe.stream(XS[:2], YS[:2]))
    trial, *stages = calls  # the pipeline first tries the factory on copies of every trainable parameter
    assert trial == ["0.weight", "0.bias", "6.weight", "6.bias"]
    assert stages == [["0.weight", "0.bias"], ["6.weight", "6.bias"]]  # stage 1 has nothing to train


def test_a_traced_model_s_stages_hand_their_factory_the_model_s_own_names():
    calls = []

    def recording(named):
        named = list(named)
        calls.append([n for n, _ in named])
        return torch.optim.SGD(named, lr=0.01)

    model = make("resnet")
    xs, ys = samples("resnet", 3)
    loss = nn.CrossEntropyLoss()
    with partime.Pipeline(model, 3, executor="inline", loss_fn=loss, optimizer=recording, sample=xs[0]) as pipe:
        list(pipe.stream(xs, ys))
    trial, *stages = calls
    own = [n for n, _ in model.named_parameters()]
    assert trial == own
    handed = [n for names in stages for n in names]  # in the order the graph uses them
    assert len(stages) == 3 and sorted(handed) == sorted(own) and len(set(handed)) == len(own)

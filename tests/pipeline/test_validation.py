"""A loss or an optimizer that cannot learn is refused with a clear error, never a silent run."""

import itertools
import logging
import re

import pytest
import torch
from torch import nn

import partime
from partime.core.stage import Stage, StageConfig, check_loss_fn

MSE = nn.MSELoss()
EXECUTORS = ["inline", "process"]
CALLABLE_LOSS = "loss_fn must be a callable such as nn.MSELoss() or a function (output, target) -> scalar tensor"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def stream(n=5):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(3, 4, generator=gen) for _ in range(n)], [torch.randn(3, 2, generator=gen) for _ in range(n)]


def run(executor="inline", n=5, **kw):
    """The losses of ``n`` samples through ``model()`` cut [2, 1], and the model after them."""
    kw = dict(loss_fn=MSE, optimizer=sgd) | kw
    xs, ys = stream(n)
    with partime.Pipeline(model(), [2, 1], executor=executor, threads=1, **kw) as pipe:
        losses = [r.loss for r in pipe.stream(xs, ys)]
        return losses, pipe.module


# -- loss_fn and optimizer that are not what they must be, refused when the pipeline is made ----


@pytest.mark.parametrize(
    "loss_fn, message",
    [
        ("mse", CALLABLE_LOSS + ", got str 'mse'"),
        (3, CALLABLE_LOSS + ", got int 3"),
        (nn.MSELoss, "got the class MSELoss; pass an instance: MSELoss()"),
    ],
)
def test_check_loss_fn_refuses_what_cannot_be_called(loss_fn, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        check_loss_fn(loss_fn)


def test_check_loss_fn_takes_a_loss_a_function_or_none():
    for loss_fn in (MSE, lambda out, y: ((out - y) ** 2).mean(), None):
        check_loss_fn(loss_fn)


# check_optimizer_factory's own tests: tests/learning/test_optimizer_state.py


def forgets_to_return(params):
    torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize(
    "kw, error, message",
    [
        (dict(optimizer="sgd"), TypeError, "optimizer must be a factory params -> Optimizer"),
        (dict(optimizer=torch.optim.SGD(model().parameters(), lr=0.1)), TypeError, "got an instance of SGD"),
        (dict(optimizer=forgets_to_return), TypeError, "returned None, not a torch.optim.Optimizer"),
        (
            dict(optimizer=lambda params: torch.optim.SGD(model().parameters(), lr=0.1)),
            ValueError,
            "the optimizer factory must optimise the params it is given",
        ),
    ],
)
def test_the_pipeline_refuses_an_optimizer_that_cannot_learn_when_it_is_made(kw, error, message):
    with pytest.raises(error, match=re.escape(message)):
        partime.Pipeline(model(), [2, 1], executor="inline", loss_fn=MSE, **kw)


# needs Pipeline to call check_loss_fn
@pytest.mark.parametrize(
    "loss_fn, message",
    [
        ("mse", CALLABLE_LOSS + ", got str 'mse'"),
        (nn.MSELoss, "got the class MSELoss; pass an instance: MSELoss()"),
    ],
)
def test_the_pipeline_refuses_a_loss_fn_that_cannot_be_called_when_it_is_made(loss_fn, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        partime.Pipeline(model(), [2, 1], executor="inline", loss_fn=loss_fn, optimizer=sgd)


# -- an optimizer that holds none of its stage's parameters, refused when the stage is made -------


def test_a_stage_refuses_a_factory_that_makes_no_optimizer():
    config = StageConfig(depth=2, loss_fn=MSE, optimizer=forgets_to_return)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "stage 1: the optimizer factory, called on its 2 trainable parameters (weight, bias), returned None, "
            "not a torch.optim.Optimizer: stage 1 would never learn"
        ),
    ):
        Stage(1, nn.Linear(8, 2), config)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_an_optimizer_holding_none_of_its_stages_parameters_is_refused(executor):
    made = []

    def one_optimizer(params):  # the mistake: one optimizer, made at the first call, for every call
        if not made:
            made.append(torch.optim.SGD(params, lr=0.1))
        return made[0]

    message = (
        r"stage (0|1): the optimizer factory, called on its 2 trainable parameters \((0|2)\.weight, (0|2)\.bias\), "
        r"returned SGD holding none of them \(it holds 4 other parameters\): stage (0|1) would never learn; "
        r"the optimizer factory must optimise the params it is given"
    )
    # inline makes its stages in the caller, where the error is raised as it is; a stage's process
    # reports its error as a StageError: the message is the same
    with pytest.raises((ValueError, partime.StageError), match=message):
        run(executor, optimizer=one_optimizer)


def test_an_optimizer_leaving_out_some_of_its_stages_parameters_is_a_warning(caplog):
    def no_biases(named):
        return torch.optim.SGD([p for _, p in named if p.dim() > 1], lr=0.1)

    with caplog.at_level(logging.WARNING, logger="partime.core.stage"):
        _, trained = run(optimizer=no_biases)
    assert [r.getMessage() for r in caplog.records] == [
        "stage 0: the optimizer leaves out 1 of its 2 trainable parameters, which will not learn: 0.bias",
        "stage 1: the optimizer leaves out 1 of its 2 trainable parameters, which will not learn: 2.bias",
    ]
    before = model()
    assert torch.equal(trained[0].bias, before[0].bias) and torch.equal(trained[2].bias, before[2].bias)
    assert not torch.equal(trained[0].weight, before[0].weight)


# -- a loss with no gradient, refused at its sample ----------------------------------------------


def detached(out, y):
    return ((out - y) ** 2).mean().detach()


def from_item(out, y):
    return torch.tensor(((out - y) ** 2).mean().item())


@pytest.mark.parametrize("loss_fn", [detached, from_item])
def test_a_loss_with_no_gradient_is_refused(loss_fn):
    with pytest.raises(
        partime.StageError,
        match=re.escape(
            "stage 1, sample 0, loss: ValueError: loss_fn returned a tensor with no gradient (requires_grad=False) "
            "for sample 0: do not detach it or rebuild it from .item(); stage 1 would never learn"
        ),
    ):
        run(loss_fn=loss_fn)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_loss_with_no_gradient_is_refused_at_its_sample(executor):
    calls = itertools.count()

    def detached_at_3(out, y):
        loss = MSE(out, y)
        return loss.detach() if next(calls) == 3 else loss

    with pytest.raises(
        partime.StageError,
        match=re.escape(
            "stage 1, sample 3, loss: ValueError: loss_fn returned a tensor with no gradient (requires_grad=False) "
            "for sample 3: do not detach it or rebuild it from .item(); stage 1 would never learn"
        ),
    ):
        run(executor, loss_fn=detached_at_3)


def constant(out, y):
    return torch.tensor(1.0, requires_grad=True)


@pytest.mark.parametrize(
    "executor, grad_mode",
    [("inline", "stash"), ("inline", "weight-stash"), ("inline", "partime"), ("process", "stash")],
)
def test_a_loss_with_no_path_to_the_last_stages_parameters_is_refused(executor, grad_mode):
    with pytest.raises(
        partime.StageError,
        match=re.escape(
            "stage 1, sample 0, backward: ValueError: the loss of sample 0 has no gradient path to any parameter "
            "of stage 1: loss_fn must compute it from the output it is given, not return a constant or a tensor "
            "made apart from it; stage 1 would never learn"
        ),
    ):
        run(executor, loss_fn=constant, grad_mode=grad_mode)


def test_a_loss_with_no_path_is_refused_in_a_single_stage():
    pipe = partime.Pipeline(model(), 1, executor="inline", loss_fn=constant, optimizer=sgd)
    with (
        pytest.raises(partime.StageError, match="stage 0, sample 0, backward: .*no gradient path to any parameter"),
        pipe,
    ):
        list(pipe.stream(*stream(2)))


def test_a_loss_whose_gradient_is_zero_is_a_path():
    losses, trained = run(loss_fn=lambda out, y: (out * 0).sum())
    assert losses == [0.0] * 5
    assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), model().parameters(), strict=True))


def test_a_frozen_model_with_an_optimizer_is_refused_as_nothing_to_learn():
    frozen = model()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError) as info:
        partime.Pipeline(frozen, [2, 1], executor="inline", loss_fn=detached, optimizer=sgd)
    message = str(info.value)
    assert message.startswith("optimizer= was given, but nothing would learn: every parameter of the model")
    assert "requires_grad_(True)" in message and "leave out loss_fn= and optimizer=" in message
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):  # as a plain loop is
        sgd([p for p in frozen.parameters() if p.requires_grad])


def test_a_frozen_last_stage_takes_any_loss():
    partly = model()
    partly[2].requires_grad_(False)
    xs, ys = stream()
    with partime.Pipeline(partly, [2, 1], executor="inline", loss_fn=constant, optimizer=sgd) as pipe:
        assert len(list(pipe.stream(xs, ys))) == 5


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
@pytest.mark.parametrize("off", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_learning_under_no_grad_is_refused_in_the_caller_naming_it_not_the_loss(executor, off):
    where = {torch.no_grad: r"torch.no_grad\(\)", torch.inference_mode: r"torch.inference_mode\(\)"}[off]
    refused = rf"this pipeline learns, but {{}} was called under {where} .*nothing was fed.*metric code only"
    xs, ys = stream(4)
    with partime.Pipeline(model(), [2, 1], executor=executor, threads=1, loss_fn=MSE, optimizer=sgd) as pipe:
        with off():
            with pytest.raises(RuntimeError, match=refused.format(r"step\(\)")):
                pipe.step(xs[0], ys[0])
            items = iter(zip(xs, ys))
            with pytest.raises(RuntimeError, match=refused.format(r"stream\(\)")):
                list(pipe.stream(items))
        assert next(items)[0] is xs[0]  # the stream took no item
        assert pipe.step(xs[0], ys[0]) is None
        with off():
            with pytest.raises(RuntimeError, match=refused.format(r"flush\(\)")):
                pipe.flush()  # its ticks would run the backward of the sample in flight
        results = [pipe.step(x, y) for x, y in zip(xs[1:], ys[1:])] + pipe.flush()
    assert [r.index for r in results if r is not None] == [0, 1, 2, 3]  # the refused calls used up no index
    assert [r.loss for r in results if r is not None] == run(n=4)[0]

"""Compensation that reads the optimizer's state: hand-computed steps, errors, and in a pipeline."""

import math

import pytest
import torch
from models import classification_stream, mlp
from torch import nn

import partime
from partime.learning.compensation import AUTOMATIC, chosen_compensation, optimizer_kind
from partime.learning.optimizer_state import LONG_MOMENTUM, OptimizerPrediction, SpikeCompensation, lengthen_momentum


def scalar(value=1.0):
    return nn.Parameter(torch.tensor([value], dtype=torch.float64))


def step(opt, param, grad):
    param.grad = torch.tensor([grad], dtype=torch.float64)
    opt.step()


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_prediction_is_the_optimizer_run_on_with_no_new_gradient(nesterov):
    param = scalar()
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9, nesterov=nesterov)
    for g in (2.0, -0.5):
        step(opt, param, g)
    predicted = OptimizerPrediction(opt, [param], delay=3).predict()[0]
    assert predicted.requires_grad and predicted.data_ptr() != param.data_ptr()
    # by hand: buf = 0.9 * 2 - 0.5 = 1.3; the next three steps with g = 0 move by lr * 0.9^k * buf
    # (Nesterov: lr * 0.9^(k+1) * buf)
    powers = (2, 3, 4) if nesterov else (1, 2, 3)
    assert predicted.item() == pytest.approx(param.item() - 0.1 * 1.3 * sum(0.9**k for k in powers), rel=1e-12)
    for _ in range(3):  # and it is where the optimizer itself goes
        step(opt, param, 0.0)
    assert predicted.item() == pytest.approx(param.item(), rel=1e-12)


def test_plain_sgd_predicts_its_weights_as_they_are():
    param = scalar()
    opt = torch.optim.SGD([param], lr=0.1)
    step(opt, param, 2.0)
    assert OptimizerPrediction(opt, [param], delay=4).predict()[0].item() == param.item()


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_prediction_by_hand(decoupled):
    param = scalar()
    make = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = make([param], lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1 if decoupled else 0.0)
    for g in (2.0, 1.0):
        step(opt, param, g)
    m = 0.8 * (0.2 * 2.0) + 0.2 * 1.0
    v = 0.9 * (0.1 * 4.0) + 0.1 * 1.0
    expected = param.item()
    for k in (1, 2):  # t = 2 steps taken
        expected -= 0.01 * 0.8**k / (1 - 0.8 ** (2 + k)) * m / (math.sqrt(v / (1 - 0.9 ** (2 + k))) + 1e-6)
    if decoupled:
        expected -= 2 * 0.01 * 0.1 * param.item()
    assert OptimizerPrediction(opt, [param], delay=2).predict()[0].item() == pytest.approx(expected, rel=1e-12)


def test_adam_predicts_each_parameter_of_a_group_from_its_own_step_count():
    # the group's parameters are shifted together; one that missed a step has its own bias correction
    taken, missed = scalar(1.0), scalar(-1.0)
    opt = torch.optim.Adam([taken, missed], lr=0.01, betas=(0.8, 0.9), eps=1e-6)
    for g in (2.0, 1.0, -3.0):
        taken.grad = torch.tensor([g], dtype=torch.float64)
        missed.grad = None if g == 1.0 else torch.tensor([g], dtype=torch.float64)
        opt.step()
    predicted = OptimizerPrediction(opt, [taken, missed], delay=2).predict()
    for param, got in zip((taken, missed), predicted):
        alone = torch.optim.Adam([param], lr=0.01, betas=(0.8, 0.9), eps=1e-6)
        alone.state[param] = opt.state[param]  # the same parameter, alone in a group of its own
        assert got.item() == OptimizerPrediction(alone, [param], delay=2).predict()[0].item()
    assert float(opt.state[taken]["step"]) == 3 and float(opt.state[missed]["step"]) == 2


def test_spike_compensation_of_momentum_by_hand():
    param, tau, lr, mu = scalar(), 2, 0.1, 0.9
    opt = torch.optim.SGD([param], lr=lr, momentum=mu)
    spike = SpikeCompensation(opt, [param], tau)
    a, b = mu**tau, (1 - mu**tau) / (1 - mu)
    expected, buf = param.item(), 0.0
    for g in (2.0, -0.5, 1.0):
        buf = mu * buf + g
        expected -= lr * (a * buf + b * g)  # Kosson et al.: the momentum discounted, the missed steps at once
        param.grad = torch.tensor([g], dtype=torch.float64)
        spike.before_step()
        opt.step()
        spike.after_step()
        assert param.item() == pytest.approx(expected, rel=1e-12)


def test_spike_compensation_of_adam_by_hand():
    param, tau, lr, b1, b2, eps = scalar(), 3, 0.01, 0.9, 0.99, 1e-8
    opt = torch.optim.Adam([param], lr=lr, betas=(b1, b2), eps=eps)
    spike = SpikeCompensation(opt, [param], tau)
    expected, m, v = param.item(), 0.0, 0.0
    for t, g in enumerate((2.0, -0.5, 1.0), start=1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        wanted = b1**tau * m + (1 - b1**tau) * g  # the average, as late as the gradient is
        expected -= lr * wanted / (1 - b1**t) / (math.sqrt(v / (1 - b2**t)) + eps)
        param.grad = torch.tensor([g], dtype=torch.float64)
        spike.before_step()
        opt.step()
        spike.after_step()
        assert param.item() == pytest.approx(expected, rel=1e-12)


def test_long_momentum_keeps_the_steady_step_of_sgd_and_lengthens_adams_average():
    sgd = torch.optim.SGD([scalar()], lr=0.1, momentum=0.9)
    lengthen_momentum(sgd)
    group = sgd.param_groups[0]
    assert group["momentum"] == LONG_MOMENTUM
    assert (1 - group["dampening"]) / (1 - group["momentum"]) == pytest.approx(1 / (1 - 0.9))
    adam = torch.optim.Adam([scalar()], betas=(0.9, 0.999))
    lengthen_momentum(adam)
    assert adam.param_groups[0]["betas"] == (LONG_MOMENTUM, 0.999)
    plain = torch.optim.SGD([scalar()], lr=0.1)
    lengthen_momentum(plain)
    assert plain.param_groups[0]["momentum"] == 0


@pytest.mark.parametrize("compensation", ["optimizer-prediction", "spike", "long-momentum"])
def test_an_optimizer_they_do_not_know_is_refused_when_the_pipeline_is_made(compensation):
    with pytest.raises(TypeError, match=f"compensation '{compensation}' .* supports torch.optim.SGD .*got RMSprop"):
        partime.Pipeline(
            mlp(),
            [3, 4],
            executor="inline",
            loss_fn=nn.CrossEntropyLoss(),
            optimizer=lambda p: torch.optim.RMSprop(p),
            compensation=compensation,
        )


def test_spike_refuses_nesterov():
    with pytest.raises(ValueError, match="nesterov=True"):
        partime.Pipeline(
            mlp(),
            [3, 4],
            executor="inline",
            loss_fn=nn.CrossEntropyLoss(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
            compensation="spike",
        )


def test_the_two_predictions_do_not_go_together():
    with pytest.raises(ValueError, match="give one of them"):
        partime.Pipeline(mlp(), 2, compensation=["weight-prediction", "optimizer-prediction"])


@pytest.mark.parametrize(
    "make_opt, kind",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), "sgd"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "momentum"),
        (lambda p: torch.optim.Adam(p), "adam"),
        (lambda p: torch.optim.AdamW(p), "adam"),
    ],
)
def test_auto_chooses_by_the_kind_of_optimizer(make_opt, kind):
    opt = make_opt([scalar()])
    assert optimizer_kind(opt) == kind
    assert chosen_compensation(("auto",), opt) == AUTOMATIC[kind]
    assert chosen_compensation(("spike",), opt) == ("spike",)


def test_auto_leaves_an_optimizer_it_does_not_know_alone():
    xs, ys = classification_stream(20)
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.RMSprop(p, lr=1e-3), grad_mode="stash")
    runs = []
    for comp in ((), "auto"):
        with partime.Pipeline(mlp(), [3, 4], executor="inline", compensation=comp, **kw) as pipe:
            runs.append([r.loss for r in pipe.stream(xs, ys)])
    assert runs[0] == runs[1]


def test_auto_goes_alone():
    with pytest.raises(ValueError, match="give it alone, not with 'spike'"):
        partime.Pipeline(mlp(), 2, compensation=["auto", "spike"])

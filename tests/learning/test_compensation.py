"""Staleness compensation: its schedules on hand-computed values, its effect in a pipeline."""

import dataclasses

import pytest
import torch
from models import classification_stream, mlp
from torch import nn

import partime
from partime.core.schedule import delay
from partime.core.stage import Stage, StageConfig
from partime.core.stage.learning import make_learning, step
from partime.learning.compensation import (
    DELAY_CORRECTION_FLOOR,
    DelayCorrection,
    StepSizeScale,
    WeightPredictor,
    check_compensation,
    output_units,
    step_scale,
)
from partime.learning.optimizer_state import OptimizerPrediction


def test_delays_of_the_stages():
    assert [delay(i, 4) for i in range(4)] == [6, 4, 2, 0]


def test_step_size_scale_anneals_from_one_over_one_plus_delay_to_one():
    scale = StepSizeScale(delay=3, anneal_steps=4)
    factors = [scale.next_factor() for _ in range(6)]
    # (1 + 3) ** -(1 - k / 4) for k = 0, 1, 2, 3, then 1
    assert factors == pytest.approx([1 / 4, 1 / 4**0.75, 1 / 2, 1 / 4**0.25, 1, 1])


def test_step_scale_is_one_over_one_plus_the_delay():
    assert step_scale(4) == pytest.approx(1 / 5)
    assert step_scale(3, power=0.5) == pytest.approx(1 / 2)


# -- step sizes and lr schedules --------------------------------------------------------------------


def scheduled(make_schedule, lr=0.3, momentum=0.0):
    """A factory of SGD whose lr follows ``make_schedule(optimizer)``, stepped after every optimizer
    step by a step hook: how a schedule lives inside the factory of a pipeline."""

    def factory(params):
        optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
        schedule = make_schedule(optimizer)
        optimizer.register_step_post_hook(lambda *_: schedule.step())
        return optimizer

    return factory


def constant(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def halved_every_two(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def plain_sgd(params):
    return torch.optim.SGD(params, lr=0.3)


@pytest.mark.parametrize(
    "executor, compensation",
    [("inline", ("step-scale",)), ("inline", ("lr-scale",)), ("inline", "auto"), ("process", ("step-scale",))],
)
def test_a_constant_schedule_in_the_factory_changes_nothing(executor, compensation):
    xs, ys = classification_stream(20)
    runs = []
    for factory in (plain_sgd, scheduled(constant)):
        kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=factory, compensation=compensation, threads=1)
        with partime.Pipeline(mlp(), [3, 4], executor=executor, **kw) as pipe:
            runs.append(([r.loss for r in pipe.stream(xs, ys)], list(pipe.module.parameters())))
    (losses, weights), (scheduled_losses, scheduled_weights) = runs
    assert scheduled_losses == losses
    assert all(torch.equal(p, q) for p, q in zip(weights, scheduled_weights, strict=True))


def stepped(compensation, factory, steps=6, depth=2):
    """Stage 0 (delay 2 at ``depth`` 2) of one parameter at 0, stepped ``steps`` times with gradient 1;
    the parameter and the lr its optimizer holds after."""
    param = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    config = StageConfig(depth=depth, optimizer=factory, compensation=compensation)
    learning = make_learning(0, config, [("w", param)])
    for _ in range(steps):
        step(learning, [param], [torch.ones(1, dtype=torch.float64)], None)
    return param.item(), learning.optimizer.param_groups[0]["lr"]


def test_step_scale_scales_each_step_of_a_schedule():
    # StepLR halves the lr every 2 steps: 0.3, 0.3, 0.15, 0.15, 0.075, 0.075; step-scale takes a third of each
    moved, lr = stepped(("step-scale",), scheduled(halved_every_two))
    assert moved == pytest.approx(-(0.3 + 0.3 + 0.15 + 0.15 + 0.075 + 0.075) / 3, rel=1e-12)
    assert lr == pytest.approx(0.3 / 8)  # the schedule's lr, unscaled: what a user reads back


def test_lr_scale_scales_each_step_of_a_schedule():
    lrs = [0.3, 0.3, 0.15, 0.15, 0.075, 0.075]
    anneal = StepSizeScale(delay=2)
    expected = -sum(lr * anneal.next_factor() for lr in lrs)
    moved, lr = stepped(("lr-scale",), scheduled(halved_every_two))
    assert moved == pytest.approx(expected, rel=1e-12)
    assert lr == pytest.approx(0.3 / 8)


def test_optimizer_prediction_foresees_the_scaled_steps_of_the_scheduled_lr():
    param = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    half = scheduled(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 0.5), lr=0.3, momentum=0.5)
    config = StageConfig(depth=2, optimizer=half, compensation=("step-scale", "optimizer-prediction"))
    learning = make_learning(0, config, [("w", param)])
    assert isinstance(learning.predictor, OptimizerPrediction)
    step(learning, [param], [torch.ones(1, dtype=torch.float64)], None)  # buf = 1, lr 0.15, a third of it
    assert param.item() == pytest.approx(-0.05, rel=1e-12)
    predicted = learning.predictor.predict()[0].item()
    # two steps ahead, each a third of lr 0.15 along the momentum: 0.5 and 0.25 of buf
    assert predicted == pytest.approx(-0.05 - 0.15 / 3 * (0.5 + 0.25), rel=1e-12)


def test_weight_predictor_extrapolates_along_the_velocity():
    param = nn.Parameter(torch.tensor([1.0]))
    predictor = WeightPredictor([param], delay=2, momentum=0.5)
    with torch.no_grad():
        param += 1.0  # a step of +1
    predictor.after_step()  # velocity 0.5 * 0 + 0.5 * 1 = 0.5
    assert predictor.predict()[0].item() == pytest.approx(2.0 + 2 * 0.5)
    with torch.no_grad():
        param += 1.0
    predictor.after_step()  # velocity 0.5 * 0.5 + 0.5 * 1 = 0.75
    assert predictor.predict()[0].item() == pytest.approx(3.0 + 2 * 0.75)
    assert predictor.predict()[0].requires_grad


@pytest.mark.parametrize(
    "moved, grad, factor",
    [
        ([-0.5, 0.5], [1.0, 0.2], 1 - 1.5 * 0.4),  # the steps since went -0.4 along g: 1 + λ (-0.4)
        ([0.5, 0.0], [1.0, 0.2], 1.0),  # they went against g: never enlarged
        ([-2.0, 0.0], [1.0, 0.2], DELAY_CORRECTION_FLOOR),  # more than g asks: the least share is kept
    ],
)
def test_delay_correction_shrinks_a_late_gradient_by_the_steps_taken_since(moved, grad, factor):
    param = nn.Parameter(torch.tensor([[1.0, 2.0]]))  # one output unit
    correction = DelayCorrection([("weight", param)], strength=1.5)
    anchor = correction.anchor()
    with torch.no_grad():
        param += torch.tensor([moved])
    param.grad = torch.tensor([grad])
    [factors] = correction.correct(anchor)
    assert factors.tolist() == pytest.approx([factor])
    assert param.grad[0].tolist() == pytest.approx([factor * g for g in grad])
    assert anchor[0].tolist() == [[1.0, 2.0]]


def test_delay_correction_has_one_factor_per_output_unit_shared_by_its_weights_and_bias():
    layer = nn.Linear(2, 3)
    correction = DelayCorrection(list(layer.named_parameters()), strength=1.0)
    anchor = correction.anchor()
    with torch.no_grad():  # unit 0 moved along its gradient, unit 1 against it, unit 2 not at all
        layer.weight += torch.tensor([[-0.1, -0.1], [0.3, 0.0], [0.0, 0.0]])
        layer.bias += torch.tensor([-0.2, 0.0, 0.0])
    layer.weight.grad = torch.ones(3, 2)
    layer.bias.grad = torch.ones(3)
    [factors] = correction.correct(anchor)
    assert factors.tolist() == pytest.approx([1 - 0.4, 1.0, 1.0])  # unit 0: gᵀΔθ = -0.1 - 0.1 - 0.2
    assert layer.weight.grad.flatten().tolist() == pytest.approx([0.6, 0.6, 1.0, 1.0, 1.0, 1.0])
    assert layer.bias.grad.tolist() == pytest.approx([0.6, 1.0, 1.0])


def test_output_units_group_a_layers_parameters_by_their_first_dimension():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Linear(4, 2))
    named = list(model.named_parameters()) + [("scale", nn.Parameter(torch.tensor(1.0)))]
    assert output_units(named) == [[0, 1], [2, 3], [4]]


def test_delay_correction_scales_a_scalar_parameter_too():
    scale = nn.Parameter(torch.tensor(1.0))
    correction = DelayCorrection([("scale", scale)], strength=1.0)
    anchor = correction.anchor()
    with torch.no_grad():
        scale -= 0.5
    scale.grad = torch.tensor(1.0)
    [factors] = correction.correct(anchor)
    assert factors.tolist() == [0.5] and scale.grad.item() == 0.5


def test_unknown_compensation():
    assert check_compensation("lr-scale") == ("lr-scale",)
    expected = (
        "unknown compensation .magic.; choose 'auto' or any of step-scale, delay-correction, optimizer-prediction"
    )
    with pytest.raises(ValueError, match=expected):
        partime.Pipeline(mlp(), 2, compensation=["magic"])


@pytest.mark.parametrize(
    "compensation",
    [
        ("lr-scale",),
        ("weight-prediction",),
        ("delay-correction",),
        ("lr-scale", "weight-prediction", "delay-correction"),
        ("step-scale",),
        ("optimizer-prediction",),
        ("spike",),
        ("optimizer-prediction", "long-momentum"),
        "auto",
    ],
)
@pytest.mark.parametrize(
    "make_opt",
    [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5), lambda p: torch.optim.Adam(p, lr=1e-2)],
    ids=["momentum", "adam"],
)
def test_compensation_changes_learning_only_where_there_is_delay_and_matches_in_processes(compensation, make_opt):
    xs, ys = classification_stream(60)
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=make_opt, grad_mode="stash")
    runs = {}
    for name, executor, comp in [
        ("plain", "inline", ()),
        ("inline", "inline", compensation),
        ("process", "process", compensation),
    ]:
        with partime.Pipeline(mlp(), [3, 4], executor=executor, threads=1, compensation=comp, **kw) as pipe:
            runs[name] = [r.loss for r in pipe.stream(xs, ys)], list(pipe.module.parameters())
    assert runs["inline"][0] == runs["process"][0]
    assert all(torch.equal(p, q) for p, q in zip(runs["inline"][1], runs["process"][1]))
    assert runs["inline"][0] != runs["plain"][0]
    # the last stage has no delay: its first step is the plain one; stage 0's is not
    assert runs["inline"][0][:2] == runs["plain"][0][:2]


@pytest.mark.parametrize("grad_mode", ["stash", "weight-stash"])
def test_delay_correction_keeps_one_copy_of_the_weights_per_sample_in_flight(grad_mode):
    config = StageConfig(
        depth=2,
        loss_fn=nn.MSELoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        grad_mode=grad_mode,
        compensation=("delay-correction",),
    )
    stage = Stage(0, nn.Linear(3, 2), config)  # delay 2
    for sample in range(3):
        stage.forward(sample, torch.randn(1, 3))
    assert sorted(stage._learning.anchors) == [0, 1, 2]
    anchor, weight = stage._learning.anchors[0][0], stage.module.weight
    assert torch.equal(anchor, weight) and anchor.data_ptr() != weight.data_ptr()
    stashed = stage._pending[0].weights
    assert bool(stashed) == (grad_mode == "weight-stash")
    if stashed:  # weight-stash keeps a copy already: the anchor is that copy
        assert anchor.data_ptr() == stashed[0].data_ptr()
    stage.backward(0, torch.ones(1, 2))
    assert sorted(stage._learning.anchors) == [1, 2]
    stage.drop(1)
    assert sorted(stage._learning.anchors) == [2]


@pytest.mark.parametrize(
    "compensation, make_opt",
    [
        (("delay-correction",), lambda p, **kw: torch.optim.SGD(p, lr=0.1, **kw)),
        (("step-scale",), lambda p, **kw: torch.optim.SGD(p, lr=0.1, **kw)),
        (("lr-scale",), lambda p, **kw: torch.optim.SGD(p, lr=0.1, **kw)),
        (("weight-prediction",), lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.5, **kw)),
        (("optimizer-prediction",), lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.5, **kw)),
        (("optimizer-prediction", "long-momentum"), lambda p, **kw: torch.optim.Adam(p, lr=1e-2, **kw)),
        (("spike",), lambda p, **kw: torch.optim.SGD(p, lr=0.1, momentum=0.5, weight_decay=0.01, **kw)),
        (("spike",), lambda p, **kw: torch.optim.AdamW(p, lr=1e-2, **kw)),
        ("auto", lambda p, **kw: torch.optim.SGD(p, lr=0.1, **kw)),
        ("auto", lambda p, **kw: torch.optim.Adam(p, lr=1e-2, **kw)),
    ],
    ids=[
        "delay-correction",
        "step-scale",
        "lr-scale",
        "weight-prediction",
        "optimizer-prediction-momentum",
        "optimizer-prediction-long-momentum-adam",
        "spike-momentum-weight-decay",
        "spike-adamw",
        "auto-sgd",
        "auto-adam",
    ],
)
def test_maximizing_the_negated_loss_learns_exactly_as_minimizing_the_loss(compensation, make_opt):
    xs, ys = classification_stream(12)
    cross_entropy = nn.CrossEntropyLoss()
    runs = []
    for loss_fn, maximize in [(cross_entropy, False), (lambda out, y: -cross_entropy(out, y), True)]:
        optimizer = lambda params, maximize=maximize: make_opt(params, maximize=maximize)
        kw = dict(loss_fn=loss_fn, optimizer=optimizer, compensation=compensation)
        with partime.Pipeline(mlp(), [3, 4], executor="inline", **kw) as pipe:
            losses = [r.loss for r in pipe.stream(xs, ys)]
            runs.append((losses, list(pipe.module.parameters())))
    (minimized, weights), (maximized, maximized_weights) = runs
    assert maximized == [-loss for loss in minimized]
    assert all(torch.equal(p, q) for p, q in zip(weights, maximized_weights))


def test_delay_correction_reads_which_way_the_optimizer_goes():
    param = nn.Parameter(torch.tensor([[1.0, 2.0]]))
    optimizer = torch.optim.SGD([param], lr=0.1, maximize=True)
    correction = DelayCorrection([("weight", param)], strength=1.5, optimizer=optimizer)
    anchor = correction.anchor()
    with torch.no_grad():
        param += torch.tensor([[0.5, -0.5]])
    param.grad = torch.tensor([[1.0, 0.2]])  # maximizing: the steps since went +0.4 along g, the way it asks
    [factors] = correction.correct(anchor)
    assert factors.tolist() == pytest.approx([1 - 1.5 * 0.4])


def corrected_per_unit(named, grads, anchor, maximizing, strength):
    """Delay correction computed plainly, layer by layer and unit by unit, in float64: the
    corrected gradients by name (None where there is none) and the factors of each layer's units."""
    corrected, factors = dict(grads), []
    for group in output_units(named):
        layer = [(n, p.detach()) for n, p in (named[i] for i in group) if grads[n] is not None]
        if not layer:
            continue
        units = layer[0][1].shape[0] if layer[0][1].dim() else 1
        factor = torch.ones(units, dtype=torch.float64)
        for u in range(units):
            moved = 0.0
            for n, p in layer:
                product = grads[n].double() * (p.double() - anchor[n].double())
                moved += (-1.0 if n in maximizing else 1.0) * product.reshape(units, -1)[u].sum().item()
            factor[u] = min(max(1.0 + strength * moved, DELAY_CORRECTION_FLOOR), 1.0)
        for n, _ in layer:
            corrected[n] = (grads[n].double().reshape(units, -1) * factor[:, None]).reshape(grads[n].shape)
        factors.append(factor)
    return corrected, factors


def test_delay_correction_of_a_whole_stage_is_the_plain_correction_unit_by_unit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Flatten(), nn.Linear(20, 4), nn.Linear(4, 3))
    named = list(model.named_parameters()) + [("scale", nn.Parameter(torch.tensor(0.7)))]
    maximizing = {"3.weight", "3.bias"}
    optimizer = torch.optim.SGD(
        [
            {"params": [p for n, p in named if n not in maximizing]},
            {"params": [p for n, p in named if n in maximizing], "maximize": True},
        ],
        lr=0.1,
    )
    correction = DelayCorrection(named, strength=4.0, optimizer=optimizer)
    anchor = correction.anchor()
    assert [a.shape for a in anchor] == [p.shape for _, p in named]
    assert all(torch.equal(a, p) for a, (_, p) in zip(anchor, named))
    with torch.no_grad():
        for _, p in named:
            p.add_(torch.randn_like(p), alpha=0.05)
    grads = {n: torch.randn_like(p) for n, p in named}
    grads["4.bias"] = None  # a parameter without a gradient: left without, out of its unit's factor
    for n, p in named:
        p.grad = None if grads[n] is None else grads[n].clone()
    anchors = {n: a for (n, _), a in zip(named, anchor)}
    expected, expected_factors = corrected_per_unit(named, grads, anchors, maximizing, 4.0)

    factors = correction.correct(anchor)

    assert len(factors) == len(expected_factors) == 4  # conv, linear, linear, scale
    for got, want in zip(factors, expected_factors):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert any(0.3 < f < 1 for f in torch.cat(factors).tolist())  # some units shrunk, not all clipped
    assert any(f == DELAY_CORRECTION_FLOOR for f in torch.cat(factors).tolist())
    assert dict(named)["4.bias"].grad is None
    for n, p in named:
        if expected[n] is not None:
            torch.testing.assert_close(p.grad.double(), expected[n], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "make_opt, along",
    [
        (lambda p: torch.optim.SGD(p, lr=0.3), True),
        (lambda p: torch.optim.SGD(p, lr=0.3, maximize=True), True),
        (lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.5), False),
        (lambda p: torch.optim.SGD(p, lr=0.3, weight_decay=0.1), False),
        (lambda p: torch.optim.Adam(p, lr=0.1), False),
    ],
    ids=["sgd", "sgd-maximize", "momentum", "weight-decay", "adam"],
)
def test_step_scale_scales_the_gradient_where_the_step_is_lr_times_the_gradient_and_the_step_elsewhere(make_opt, along):
    start = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    runs = []
    for scale_gradients in (True, False):
        param = nn.Parameter(start.clone())
        config = StageConfig(depth=2, optimizer=make_opt, compensation=("step-scale",))
        learning = make_learning(0, config, [("w", param)])
        assert learning.scales_gradients == along and bool(learning.before) != along
        if not scale_gradients:  # the general rule: the step taken, then shortened
            learning = dataclasses.replace(learning, scales_gradients=False, before=(torch.empty_like(param),))
        plain = nn.Parameter(param.detach().clone())
        plain_optimizer = make_opt([plain])
        for k in range(4):
            grad = torch.full((3, 2), 1.0 + k, dtype=torch.float64)
            step(learning, [param], [grad.clone()], None)
            plain.grad = grad.clone()
            before = plain.detach().clone()
            plain_optimizer.step()
            with torch.no_grad():  # a third of each step: delay 2
                plain.copy_(before + (plain - before) / 3)
        runs.append(param.detach())
        torch.testing.assert_close(param.detach(), plain.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-12, atol=1e-12)

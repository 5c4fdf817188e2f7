"""lr schedules and gradient clipping inside each stage: at D = 1 a plain online loop to the bit,
alike under every executor, exact across a checkpoint, refused when they cannot work."""

import math

import pytest
import torch
from models import mlp
from torch import nn
from torch.optim import lr_scheduler as schedules

import partime
from partime import CheckpointError
from partime.core.stage import Stage, StageConfig

MSE = nn.MSELoss()
BALANCES = {1: [7], 2: [3, 4], 3: [2, 3, 2]}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def step_lr(opt):
    return schedules.StepLR(opt, step_size=3, gamma=0.5)


def cosine(opt):
    return schedules.CosineAnnealingLR(opt, T_max=10)


def inverse(opt):
    return schedules.LambdaLR(opt, lambda k: 1.0 / (1.0 + k))


def stream(n=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, generator=gen), torch.randn(n, 2, 3, generator=gen)


XS, YS = stream()


def plain_loop(optimizer, lr_scheduler=None, max_grad_norm=None):
    """Forward, loss, backward, [clip], step, scheduler.step per sample: the losses, the model and
    the gradient norms clipping saw."""
    model = mlp()
    opt = optimizer(model.parameters())
    scheduler = None if lr_scheduler is None else lr_scheduler(opt)
    losses, norms = [], []
    for x, y in zip(XS, YS):
        loss = MSE(model(x), y)
        opt.zero_grad()
        loss.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], norms


def piped(depth, executor="inline", **kw):
    """The losses and final weights of a pipeline of ``mlp()`` cut into ``depth`` stages."""
    with partime.Pipeline(mlp(), BALANCES[depth], executor=executor, threads=1, loss_fn=MSE, **kw) as pipe:
        losses = [r.loss for r in pipe.stream(XS, YS)]
        return losses, [p.detach().clone() for p in pipe.module.parameters()]


def same(a, b):
    (losses_a, weights_a), (losses_b, weights_b) = a, b
    return losses_a == losses_b and all(torch.equal(p, q) for p, q in zip(weights_a, weights_b, strict=True))


@pytest.mark.parametrize(
    ("optimizer", "lr_scheduler"), [(sgd, step_lr), (adam, cosine), (adamw, inverse)], ids=["sgd", "adam", "adamw"]
)
def test_a_schedule_at_depth_one_is_the_plain_loop_to_the_bit(optimizer, lr_scheduler):
    losses, weights, _ = plain_loop(optimizer, lr_scheduler)
    assert same(piped(1, optimizer=optimizer, lr_scheduler=lr_scheduler), (losses, weights))
    assert not same(piped(1, optimizer=optimizer), (losses, weights))  # the schedule changed the run


@pytest.mark.parametrize("optimizer", [sgd, adam], ids=["sgd", "adam"])
def test_clipping_at_depth_one_is_the_plain_loop_to_the_bit(optimizer):
    losses, weights, norms = plain_loop(optimizer, max_grad_norm=0.05)
    assert max(norms) > 0.05  # it clipped
    assert same(piped(1, optimizer=optimizer, max_grad_norm=0.05), (losses, weights))
    assert not same(piped(1, optimizer=optimizer), (losses, weights))


@pytest.mark.parametrize("depth", [2, 3])
def test_a_schedule_with_clipping_is_alike_under_every_executor(depth):
    kw = dict(optimizer=sgd, lr_scheduler=step_lr, max_grad_norm=0.05)
    reference = piped(depth, **kw)
    for executor in ("thread", "process"):
        assert same(piped(depth, executor, **kw), reference), executor
    assert not same(piped(depth, optimizer=sgd, lr_scheduler=step_lr), reference)  # clipping acted
    assert not same(piped(depth, optimizer=sgd, max_grad_norm=0.05), reference)  # so did the schedule


class Shift(nn.Module):
    """``x + b``, shapes alike: autograd gives one tensor as the gradient of ``x`` and of ``b``."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(2, 3))

    def forward(self, x):
        return x + self.b


def test_clipping_leaves_the_gradient_sent_back_alone():
    config = StageConfig(3, MSE, lambda params: torch.optim.SGD(params, lr=1.0), "stash", max_grad_norm=0.1)
    stage = Stage(1, Shift(), config)  # a middle stage: it sends its input's gradient back
    stage.forward(0, torch.ones(2, 3))
    grad = torch.full((2, 3), 3.0)
    sent = stage.backward(0, grad)
    assert torch.equal(sent, torch.full((2, 3), 3.0))  # d(x + b)/dx, unclipped
    assert torch.equal(grad, torch.full((2, 3), 3.0))
    assert math.isclose(stage.module.b.norm().item(), 0.1, rel_tol=1e-5)  # b stepped by the clipped gradient


# -- checkpoints ----------------------------------------------------------------------------------

ACTIONS = ["step"] * 8 + ["flush"] + ["step"] * 6 + ["flush"]
LEARNING = dict(loss_fn=MSE, optimizer=adam, lr_scheduler=step_lr, max_grad_norm=0.05)


def play(pipe, actions):
    results = []
    for action in actions:
        if action == "flush":
            results.extend(r.loss for r in pipe.flush())
            continue
        r = pipe.step(XS[pipe.fed], YS[pipe.fed])
        if r is not None:
            results.append(r.loss)
    return results


def pipeline(executor="inline", seed=0, depth=3, **kw):
    return partime.Pipeline(mlp(seed=seed), BALANCES[depth], executor=executor, threads=1, **kw)


def weights(pipe):
    return [p.detach().clone() for p in pipe.module.parameters()]


def uninterrupted(**kw):
    with pipeline(**kw) as pipe:
        return play(pipe, ACTIONS), weights(pipe)


def resumed(stop, path, executor="inline", change=None, **kw):
    """Stopped after ``ACTIONS[:stop]``, saved (``change`` applied to each stage's state), loaded
    into a fresh pipeline under ``executor``, finished."""
    with pipeline(**kw) as pipe:
        before = play(pipe, ACTIONS[:stop])
        state = pipe.state_dict()
    if change is not None:
        for stage in state["stages"]:
            change(stage)
    torch.save(state, path)
    with pipeline(executor, seed=1, **kw) as pipe:
        pipe.load(path)
        return before + play(pipe, ACTIONS[stop:]), weights(pipe)


def test_a_schedule_resumes_exactly_with_samples_in_flight(tmp_path):
    reference = uninterrupted(**LEARNING)
    assert not same(uninterrupted(loss_fn=MSE, optimizer=adam, max_grad_norm=0.05), reference)
    for stop in (1, 6, 9, 12):  # warm-up, steady state, right after a flush, second segment
        assert same(resumed(stop, tmp_path / f"{stop}.pt", **LEARNING), reference), stop
    assert same(resumed(6, tmp_path / "process.pt", "process", **LEARNING), reference)


def test_a_checkpoint_written_before_schedules_loads_where_there_is_none(tmp_path):
    def written_before(stage):
        del stage["lr_scheduler"], stage["lr_scheduler_class"]

    kw = dict(loss_fn=MSE, optimizer=adam)
    assert same(resumed(6, tmp_path / "old.pt", change=written_before, **kw), uninterrupted(**kw))


@pytest.mark.parametrize(
    ("written", "loaded", "message"),
    [
        (LEARNING, dict(loss_fn=MSE, optimizer=adam), "with 'StepLR', this pipeline's with no lr_scheduler"),
        (dict(loss_fn=MSE, optimizer=adam), LEARNING, "with no lr_scheduler, this pipeline's with 'StepLR'"),
        (LEARNING, dict(LEARNING, lr_scheduler=cosine), "with 'StepLR', this pipeline's with 'CosineAnnealingLR'"),
    ],
    ids=["scheduled-into-none", "none-into-scheduled", "another-schedule"],
)
def test_a_checkpoint_of_another_schedule_is_refused_naming_both_and_changes_nothing(written, loaded, message):
    with pipeline(**written) as pipe:
        play(pipe, ACTIONS[:5])
        state = pipe.state_dict()
    with pipeline(**loaded) as pipe:
        play(pipe, ACTIONS[:4])
        before = weights(pipe)
        with pytest.raises(CheckpointError, match="its stage 0 schedules its lr " + message):
            pipe.load_state_dict(state)
        assert all(torch.equal(p, q) for p, q in zip(weights(pipe), before, strict=True))
        assert pipe.fed == 4


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lr_scheduler", "max_grad_norm"])
def test_a_schedule_or_clipping_without_an_optimizer_is_refused(name):
    value = step_lr if name == "lr_scheduler" else 1.0
    with pytest.raises(ValueError, match=f"{name} was given without optimizer .*give loss_fn= and optimizer="):
        pipeline(**{name: value})


def test_a_scheduler_where_a_factory_is_meant_is_refused():
    made = step_lr(sgd(mlp().parameters()))
    wanted = "lr_scheduler must be a factory optimizer -> LRScheduler"
    with pytest.raises(TypeError, match=f"{wanted}.*an instance of StepLR"):
        pipeline(loss_fn=MSE, optimizer=sgd, lr_scheduler=made)
    with pytest.raises(TypeError, match=f"{wanted}.*got str 'StepLR'"):
        pipeline(loss_fn=MSE, optimizer=sgd, lr_scheduler="StepLR")


def test_a_factory_that_makes_no_scheduler_of_its_optimizer_is_refused_when_the_pipeline_is_made():
    with pytest.raises(TypeError, match=r"returned SGD, not a torch.optim.lr_scheduler.LRScheduler"):
        pipeline(loss_fn=MSE, optimizer=sgd, lr_scheduler=lambda opt: opt)
    other = sgd(mlp().parameters())
    with pytest.raises(TypeError, match="returned a StepLR of another optimizer"):
        pipeline(loss_fn=MSE, optimizer=sgd, lr_scheduler=lambda opt: step_lr(other))
    with pytest.raises(TypeError, match=r"failed: TypeError: .*step_size"):
        pipeline(loss_fn=MSE, optimizer=sgd, lr_scheduler=lambda opt: schedules.StepLR(opt))


def test_each_stage_checks_the_scheduler_of_its_own_optimizer():
    config = StageConfig(2, MSE, sgd, lr_scheduler=lambda opt: None)
    with pytest.raises(TypeError, match="stage 1: the lr_scheduler factory, called on its SGD, returned None"):
        Stage(1, nn.Linear(3, 3), config)


def test_reduce_on_plateau_is_refused_with_what_to_use_instead():
    wanted = "made ReduceLROnPlateau, whose step needs the loss.*use a schedule of the step count"
    with pytest.raises(ValueError, match=wanted):
        pipeline(loss_fn=MSE, optimizer=sgd, lr_scheduler=schedules.ReduceLROnPlateau)


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "1"])
def test_a_max_grad_norm_that_is_no_positive_finite_number_is_refused(value):
    with pytest.raises(ValueError, match=r"max_grad_norm must be a finite number above 0 .*max_grad_norm=1\.0"):
        pipeline(loss_fn=MSE, optimizer=sgd, max_grad_norm=value)


def test_a_schedule_steps_once_per_step_of_each_stage():
    config = StageConfig(1, MSE, sgd, supervised=True, lr_scheduler=step_lr)
    stage = Stage(0, mlp(), config)
    for k in range(7):
        stage.forward(k, XS[k])
        stage.learn(k, YS[k])
    assert stage.lr_scheduler is not None and stage.lr_scheduler.last_epoch == 7
    assert stage.optimizer is not None and stage.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.25)

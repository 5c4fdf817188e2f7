"""How a learning stage steps: its optimizer and its delay compensation.

``make_learning`` builds, for stage ``index`` of a pipeline, the optimizer of its trainable
parameters (the factory is handed them as ``(name, parameter)`` pairs, under the model's own names,
as ``model.named_parameters()`` gives them) and the compensation objects that ``config.compensation`` chooses for its delay.
It checks the optimizer: a TypeError if the factory returns anything but a
``torch.optim.Optimizer`` or one whose ``step`` needs a closure (LBFGS), a ValueError if it holds
none of the stage's trainable parameters, an error of the factory's kind naming the stage and its
parameters with their shapes if the factory fails on them; a warning (on the
``partime.core.stage`` logger) names those it leaves out. With ``config.lr_scheduler`` it makes
the stage's scheduler of that optimizer (``make_scheduler``: a TypeError unless the factory
returns an ``LRScheduler`` of it, a ValueError for ``ReduceLROnPlateau``, whose step needs a loss
that stages before the last never see); ``check_scheduler_factory`` tries the factory so when the
pipeline is made, on an optimizer of copies of the model's parameters.
``step`` takes one compensated step, its gradient clipped to ``config.max_grad_norm`` first and
the scheduler stepped after; ``compensation_state`` and ``load_compensation_state``
copy the state of the compensation that a stage checkpoint keeps besides the optimizer's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LRScheduler

from ...learning.compensation import (
    DelayCorrection,
    StepSizeScale,
    WeightPredictor,
    chosen_compensation,
    scale_steps,
    step_scale,
    steps_along_the_gradient,
)
from ...learning.optimizer_state import (
    OptimizerPrediction,
    SpikeCompensation,
    call_factory,
    check_holds,
    check_steps_alone,
    lengthen_momentum,
    shapes_listed,
)
from ..boundary_values import copy_tensors
from ..schedule import delay
from .config import SCHEDULER_EXAMPLE, OptimizerFactory, SchedulerFactory, StageConfig

# The stage's logger, not this module's: the warning is about a stage, and is filtered as one.
log = logging.getLogger("partime.core.stage")


@dataclass(frozen=True)
class Learning:
    """A stage's optimizer (None: it does not learn) and its compensation objects (None: not
    chosen), and what the stage asks of them, in one place: ``forward_weights`` when a sample goes
    forward, ``step_for`` when its gradient is applied, ``forget`` when it will bring none.

    ``scale`` is ``"step-scale"``'s scale of every step (1.0: not chosen, or no delay); ``given_lrs``
    each group's lr as the factory made it, for a checkpoint written when step scales were kept in
    the lr (``load_compensation_state``). ``own``: how many of the parameters ``step`` is given
    are the stage's, whose steps are scaled (the rest, a loss's, step plainly); ``scales_gradients``
    whether a step is scaled by scaling its gradients (an optimizer whose step is ``lr`` times the
    gradient: ``steps_along_the_gradient``), else by keeping the weights before it in ``before``.
    ``anchors``: with delay correction, the weights each sample in flight went forward with.
    ``scheduler``: the lr scheduler of ``optimizer``, stepped after each of its steps (None: none);
    ``max_grad_norm``: the norm each step's gradient is clipped to first (None: not clipped);
    ``measures``: whether ``step`` measures the norm of each gradient when it does not clip (the
    pipeline keeps statistics: ``StageConfig.stats``).
    """

    optimizer: torch.optim.Optimizer | None = None
    step_size: StepSizeScale | None = None
    predictor: WeightPredictor | OptimizerPrediction | None = None
    corrector: DelayCorrection | None = None
    spike: SpikeCompensation | None = None
    scale: float = 1.0
    given_lrs: tuple[Any, ...] = ()
    before: tuple[Tensor, ...] = ()  # where ``step`` keeps the weights before a scaled step, made once
    own: int = 0
    scales_gradients: bool = False
    anchors: dict[int, list[Tensor]] = field(default_factory=dict)
    scheduler: LRScheduler | None = None
    max_grad_norm: float | None = None
    measures: bool = False

    @property
    def changes_gradients(self) -> bool:
        """Whether ``step`` may change the gradients it is given in place (clipping, or a scale
        applied to the gradient): a gradient that is also another tensor must then be a copy."""
        return self.max_grad_norm is not None or (self.scales_gradients and self.scale_varies)

    @property
    def scale_varies(self) -> bool:
        """Whether some step of the stage's own parameters is scaled by a factor other than 1."""
        return self.scale != 1.0 or self.step_size is not None

    def forward_weights(self, sample: int, stash: Callable[[], list[Tensor]] | None) -> list[Tensor]:
        """The weights the forward of ``sample`` runs with (leaves; empty: the module's own): the
        predicted ones with weight prediction, else ``stash()`` where the grad mode keeps a copy.
        With delay correction, the weights now are noted for its gradient."""
        weights: list[Tensor] = []
        now: list[Tensor] = []
        if self.predictor is not None:
            weights = self.predictor.predict()
        elif stash is not None:
            weights = stash()
            now = [w.detach() for w in weights]
        if self.corrector is not None:
            self.anchors[sample] = now or self.corrector.anchor()
        return weights

    def step_for(self, sample: int, params: list[nn.Parameter], grads: Sequence[Tensor | None]) -> Tensor | None:
        """The compensated step of ``sample``'s gradient ``grads`` of ``params`` (``step``); its norm, if measured."""
        return step(self, params, grads, self.anchors.pop(sample) if self.corrector is not None else None)

    def forget(self, sample: int) -> None:
        """``sample`` brings no gradient: nothing of it is kept."""
        self.anchors.pop(sample, None)


def make_learning(
    index: int,
    config: StageConfig,
    named: list[tuple[str, nn.Parameter]],
    extra: Sequence[tuple[str, nn.Parameter]] = (),
) -> Learning:
    """How stage ``index`` learns, given its trainable ``named`` parameters (see the module);
    ``extra`` parameters (the loss's, at the last stage) are handed to the optimizer factory with
    them, after them, and step plainly: no compensation reads or changes them."""
    if config.optimizer is None or not (named or extra):  # config.learning, in a form mypy narrows
        return Learning()
    params = [p for _, p in named]
    every = list(named) + list(extra)
    names = [config.model_name(index, n) for n, _ in named] + [n for n, _ in extra]
    optimizer = _make_optimizer(index, config.optimizer, names, [p for _, p in every])
    given_lrs = tuple(group["lr"] for group in optimizer.param_groups)
    tau = delay(index, config.depth)
    chosen = chosen_compensation(config.compensation, optimizer)
    scale = step_scale(tau) if "step-scale" in chosen and tau > 0 else 1.0
    step_size: StepSizeScale | None = None
    predictor: WeightPredictor | OptimizerPrediction | None = None
    corrector: DelayCorrection | None = None
    spike: SpikeCompensation | None = None
    if "lr-scale" in chosen:
        step_size = StepSizeScale(tau)
    if "weight-prediction" in chosen:
        predictor = WeightPredictor(params, tau)
    if "long-momentum" in chosen and tau > 0:
        lengthen_momentum(optimizer)
    if "optimizer-prediction" in chosen:
        lr_scale = step_size

        def coming() -> float:  # it foresees the steps the stage will take: scaled as step() scales them
            return scale * (1.0 if lr_scale is None else lr_scale.factor())

        predictor = OptimizerPrediction(optimizer, params, tau, scale=coming)
    if "delay-correction" in chosen and tau > 0:
        corrector = DelayCorrection(named, optimizer=optimizer)  # it reads which way each group goes
    if "spike" in chosen and tau > 0:
        spike = SpikeCompensation(optimizer, params, tau)
    scaled = scale != 1.0 or step_size is not None
    # a step that is lr times the gradient is scaled with its gradient: no copy of the weights
    along = scaled and steps_along_the_gradient(optimizer)
    before = tuple(torch.empty_like(p, requires_grad=False) for p in params) if scaled and not along else ()
    schedule = config.lr_scheduler
    scheduler = None if schedule is None else make_scheduler(f"stage {index}", schedule, optimizer)
    return Learning(
        optimizer,
        step_size,
        predictor,
        corrector,
        spike,
        scale,
        given_lrs,
        before,
        len(params),
        along,
        scheduler=scheduler,
        max_grad_norm=config.max_grad_norm,
        measures=config.stats,
    )


def _make_optimizer(
    index: int, factory: OptimizerFactory, names: list[str], params: list[nn.Parameter]
) -> torch.optim.Optimizer:
    """``factory``'s optimizer of stage ``index``'s trainable parameters, handed to it as
    ``(name, parameter)`` pairs under the model's own ``names``, checked (see the module)."""
    named = list(zip(names, params))
    optimizer = call_factory(
        factory,
        named,
        f"stage {index}: the optimizer factory, called on its {len(params)} trainable parameters "
        f"({shapes_listed(named)}),",
        f"stage {index} cannot learn",
    )
    source = (
        f"stage {index}: the optimizer factory, called on its {len(params)} trainable parameters ({_listed(names)}),"
    )
    left_out = check_holds(optimizer, params, source, f"stage {index} would never learn")
    check_steps_alone(optimizer, source)
    if left_out:
        log.warning(
            "stage %d: the optimizer leaves out %d of its %d trainable parameters, which will not learn: %s",
            index,
            len(left_out),
            len(params),
            _listed([names[k] for k in left_out]),
        )
    return optimizer


def make_scheduler(where: str, factory: SchedulerFactory, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """``factory(optimizer)``, checked: a TypeError unless it is an ``LRScheduler`` of ``optimizer``,
    a ValueError for a ``ReduceLROnPlateau``; an error of the factory's kind (a RuntimeError for
    kinds other than TypeError and ValueError) chained to it if the call fails. ``where`` begins
    each message (the stage, or the trial when the pipeline is made)."""
    source = f"{where}: the lr_scheduler factory, called on its {type(optimizer).__name__},"
    try:
        scheduler = factory(optimizer)
    except Exception as exc:
        kind = type(exc) if type(exc) in (TypeError, ValueError) else RuntimeError
        raise kind(
            f"{source} failed: {type(exc).__name__}: {exc}; each stage calls it with its own optimizer, "
            f"as a plain loop calls it with its one, e.g. {SCHEDULER_EXAMPLE}"
        ) from exc
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        # a scheduler of the right type, whose use a pipeline cannot give it: a value error
        raise ValueError(  # noqa: TRY004
            f"{source} made ReduceLROnPlateau, whose step needs the loss: in a pipeline only the last "
            "stage sees the loss, and stage i steps for a sample 2(D - 1 - i) ticks after it; use a "
            "schedule of the step count (StepLR, CosineAnnealingLR, LambdaLR, OneCycleLR, ...), each "
            "stepped once per step of its stage"
        )
    if not isinstance(scheduler, LRScheduler):
        raise TypeError(
            f"{source} returned {'None' if scheduler is None else type(scheduler).__name__}, not a "
            "torch.optim.lr_scheduler.LRScheduler; "
            f"return a scheduler of the optimizer it is given, e.g. {SCHEDULER_EXAMPLE}"
        )
    if scheduler.optimizer is not optimizer:
        raise TypeError(
            f"{source} returned a {type(scheduler).__name__} of another optimizer: it would set the lr "
            f"of an optimizer that never steps; make it of the optimizer it is given, e.g. {SCHEDULER_EXAMPLE}"
        )
    return scheduler


def check_scheduler_factory(
    factory: SchedulerFactory | None, optimizer: OptimizerFactory | None, named: Sequence[tuple[str, Tensor]]
) -> None:
    """That ``factory`` (None: no schedule) makes a scheduler that ``make_scheduler`` accepts, of
    ``optimizer``'s optimizer (a factory that ``check_optimizer_factory`` passed) of copies of the
    model's trainable parameters ``named``; its errors. With no trainable parameter nothing is called."""
    if factory is None or optimizer is None or not named:
        return
    # Copies, so that nothing either factory does (an lr set, a hook) reaches the model.
    copies = [(name, nn.Parameter(p.detach().clone())) for name, p in named]
    make_scheduler("the pipeline's trial", factory, optimizer(copies))


def step(
    learning: Learning, params: list[nn.Parameter], grads: Sequence[Tensor | None], anchor: list[Tensor] | None
) -> Tensor | None:
    """One step of ``learning.optimizer`` on ``params`` with ``grads`` (None: no gradient),
    compensated as chosen; ``anchor``: the weights the sample went forward with (delay correction).

    With ``max_grad_norm`` the gradient is clipped to that norm over ``params`` (the stage's own:
    no moment in a pipeline holds one sample's gradients of every stage) after delay correction
    corrects it and before the step is scaled: what the optimizer takes is clipped. The
    scheduler steps after the optimizer, as a plain loop steps it.

    Returns the gradient's 2-norm over ``params`` at that point, before clipping (a 0-dim tensor on
    the stage's device, what ``clip_grad_norm_`` returns), when clipping or ``measures``; else None."""
    assert learning.optimizer is not None  # a stage steps only if it learns
    for p, g in zip(params, grads):
        p.grad = g
    if learning.corrector is not None:
        assert anchor is not None
        learning.corrector.correct(anchor)
    norm: Tensor | None = None
    if learning.max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, learning.max_grad_norm)
    elif learning.measures:
        norm = total_norm([p.grad for p in params if p.grad is not None])
    factor = learning.scale * (1.0 if learning.step_size is None else learning.step_size.next_factor())
    # The step is scaled, not the lr: a schedule may set the lr during the step (a step hook),
    # and neither undoes the other. At factor 1 (no delay) nothing is copied: the plain step.
    # Only the stage's own parameters have a scale other than 1 (a loss's learn at the last stage).
    scaled: list[Tensor] = list(params[: learning.own]) if factor != 1.0 and learning.before else []
    if factor != 1.0 and learning.scales_gradients:
        present = [p.grad for p in params[: learning.own] if p.grad is not None]
        if present:
            with torch.no_grad():
                torch._foreach_mul_(present, factor)
    if scaled:
        with torch.no_grad():
            torch._foreach_copy_(list(learning.before), scaled)
    if learning.spike is not None:
        learning.spike.before_step()
    learning.optimizer.step()
    if learning.spike is not None:
        learning.spike.after_step()
    if scaled:
        scale_steps(scaled, learning.before, factor)
    for p in params:
        p.grad = None
    if isinstance(learning.predictor, WeightPredictor):
        learning.predictor.after_step()
    if learning.scheduler is not None:
        learning.scheduler.step()
    return norm


def total_norm(grads: list[Tensor]) -> Tensor:
    """The 2-norm of ``grads`` together, computed as ``clip_grad_norm_`` computes it (its value to the bit)."""
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: the function clip_grad_norm_ calls
        return torch.nn.utils.get_total_norm(grads)
    if not grads:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def unshared(grads: Sequence[Tensor | None], others: Sequence[Tensor | None]) -> tuple[Tensor | None, ...]:
    """``grads``, each that shares its memory with one before it or with one of ``others`` copied.

    autograd may give one tensor as the gradient of several (``x + b``, shapes alike: the same
    tensor for ``x`` and ``b``), where ``loss.backward()`` would have copied it into ``b.grad``;
    a step that changes its gradients in place (``Learning.changes_gradients``) would change the
    others with it."""
    seen = {t.untyped_storage().data_ptr() for t in others if t is not None}
    kept: list[Tensor | None] = []
    for g in grads:
        if g is not None:
            where = g.untyped_storage().data_ptr()
            if where in seen:
                g = g.clone()
            else:
                seen.add(where)
        kept.append(g)
    return tuple(kept)


def compensation_state(learning: Learning) -> dict[str, Any]:
    """Copies of the state of a stage's step-size scale, weight predictor and delay correction
    (the weights each sample in flight went forward with), in plain values."""
    step_size, predictor = learning.step_size, learning.predictor
    state: dict[str, Any] = {
        "lr_scale_steps": None if step_size is None else step_size.steps,
        "prediction": None,
        # the optimizer's lr is as given (by the factory or a schedule): the steps are scaled instead
        "lr_as_given": True,
        "anchors": [(sample, copy_tensors(anchor)) for sample, anchor in learning.anchors.items()],
    }
    if isinstance(predictor, WeightPredictor):
        state["prediction"] = {
            "previous": copy_tensors(predictor.previous),
            "velocity": copy_tensors(predictor.velocity),
        }
    return state


def load_compensation_state(learning: Learning, state: dict[str, Any], device: torch.device) -> None:
    """Give ``learning``'s step-size scale, weight predictor and delay correction the state that
    ``compensation_state`` copied (its anchors onto ``device``)."""
    step_size, predictor = learning.step_size, learning.predictor
    learning.anchors.clear()
    learning.anchors.update((sample, [t.to(device) for t in anchor]) for sample, anchor in state.get("anchors", ()))
    if step_size is not None:
        step_size.steps = state["lr_scale_steps"]
    if (
        not state.get("lr_as_given")
        and learning.optimizer is not None
        and (learning.scale != 1.0 or step_size is not None)
    ):
        # Written when step-scale and lr-scale were kept in the lr: its optimizer state holds the
        # scaled lr, which the steps would be scaled by again. A schedule then undid the scale, so
        # such a run is taken to have had none: its lr was the factory's.
        for group, lr in zip(learning.optimizer.param_groups, learning.given_lrs):
            group["lr"] = lr
    if isinstance(predictor, WeightPredictor):
        with torch.no_grad():
            for dst, src in zip(
                predictor.previous + predictor.velocity,
                state["prediction"]["previous"] + state["prediction"]["velocity"],
            ):
                dst.copy_(src)


def _listed(names: list[str], most: int = 6) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"

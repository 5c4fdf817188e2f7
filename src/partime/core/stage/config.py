"""What configures a pipeline's stages, and the checks of it.

``StageConfig`` is what every stage of one pipeline shares; ``GRAD_MODES`` and ``NONFINITE``
are the values its ``grad_mode`` and ``nonfinite`` may take (``GradMode`` and ``NonfinitePolicy``
their types), ``DEFAULT_GRAD_MODE`` the grad mode
of a pipeline that chooses none. ``check_loss_fn`` and
``takes_target`` judge a loss function before any sample runs; ``check_schedule_and_clipping``
judges ``lr_scheduler`` and ``max_grad_norm``. ``first_trained`` and ``model_names`` say, once the
model is cut, which stages take gradients and by what names a stage's optimizer is handed its
parameters. All are re-exported by ``partime.core.stage``.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ...learning.optimizer_state import described, trainable

GradMode = Literal["partime", "stash", "weight-stash", "graph-stash"]
"""A grad mode, for a type checker: what ``Pipeline(grad_mode=...)`` takes, the values of ``GRAD_MODES``."""
GRAD_MODES: tuple[GradMode, ...] = ("partime", "stash", "weight-stash", "graph-stash")
DEFAULT_GRAD_MODE: GradMode = "graph-stash"
"""What a pipeline learns with when no grad mode is chosen: one forward per sample, no weight copy."""
NonfinitePolicy = Literal["raise", "skip"]
"""What becomes of a non-finite sample, for a type checker: what ``Pipeline(nonfinite=...)`` takes,
the values of ``NONFINITE``."""
NONFINITE: tuple[NonfinitePolicy, ...] = ("raise", "skip")
SCHEDULER_EXAMPLE = "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)"

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
"""What ``optimizer=`` takes: called once per stage with the stage's trainable parameters, a list
of ``(name, parameter)`` pairs under the model's own names (as ``model.named_parameters()`` gives them)."""
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
LossFn = Callable[..., Tensor]


@dataclass
class StageConfig:
    """What every stage of one pipeline shares: how it learns, if it learns."""

    depth: int
    loss_fn: LossFn | None = None
    optimizer: OptimizerFactory | None = None
    grad_mode: str = DEFAULT_GRAD_MODE
    supervised: bool = False
    compensation: tuple[str, ...] = ()
    nonfinite: str = "raise"  # a non-finite loss: "raise", or "skip" (no gradient, no step)
    random_state: Tensor | None = None  # the caller's random state when the pipeline was made
    lr_scheduler: SchedulerFactory | None = None  # optimizer -> LRScheduler, stepped after each step
    max_grad_norm: float | None = None  # each stage clips its gradient to this norm before it steps
    autocast: torch.dtype | None = None  # every stage's forward (and the loss) under torch.autocast of this dtype
    # the first stage with something to train (``first_trained``): those before it take no gradient
    first_trained: int = 0
    # for each stage, the model's own name of each of its parameters by the stage's name (``model_names``);
    # empty: the stage's names are the model's
    parameter_names: tuple[dict[str, str], ...] = ()
    compile: dict[str, Any] | None = None  # torch.compile's keyword arguments for each stage's forward; None: eager
    stats: bool = False  # each stage keeps statistics (a gradient norm per step): Pipeline.stats

    @property
    def learning(self) -> bool:
        return self.optimizer is not None

    def takes_gradient(self, index: int) -> bool:
        """Whether stage ``index`` applies gradients: the pipeline learns and the stage, or one
        before it, has something to train (a stage before every trained one runs its forwards
        without a graph, and no gradient is sent to it)."""
        return self.learning and index >= self.first_trained

    def sends_gradient(self, index: int) -> bool:
        """Whether stage ``index`` sends the gradient w.r.t. its input back: some stage before it
        has something to train."""
        return self.learning and index > self.first_trained

    def model_name(self, index: int, name: str) -> str:
        """The model's own name of stage ``index``'s parameter ``name`` (``name`` itself if none is known)."""
        return self.parameter_names[index].get(name, name) if index < len(self.parameter_names) else name


def first_trained(stages: Sequence[nn.Module], loss_fn: Any) -> int:
    """The index of the first of ``stages`` with a trainable parameter; the last stage's if only
    ``loss_fn`` (a loss module, which learns at the last stage) has some; ``len(stages)`` if
    nothing trains."""
    for index, module in enumerate(stages):
        if trainable(module):
            return index
    return len(stages) - 1 if trainable(loss_fn) else len(stages)


def model_names(stages: Sequence[nn.Module], model: nn.Module) -> tuple[dict[str, str], ...]:
    """For each of ``stages`` (cut from ``model``: they hold its very parameters), the name
    ``model.named_parameters()`` gives each of the stage's parameters, by the stage's own name of
    it; only those whose names differ (a traced model's stages, fused, name them otherwise)."""
    own = {id(p): name for name, p in model.named_parameters()}
    return tuple(
        {name: own[id(p)] for name, p in stage.named_parameters() if own.get(id(p), name) != name} for stage in stages
    )


def check_loss_fn(loss_fn: Any) -> None:
    """A TypeError unless ``loss_fn`` is callable (or None: no learning), and not a loss class
    where an instance of it is meant."""
    wanted = "loss_fn must be a callable such as nn.MSELoss() or a function (output, target) -> scalar tensor"
    if isinstance(loss_fn, type) and issubclass(loss_fn, nn.Module):
        raise TypeError(f"{wanted}, got the class {loss_fn.__name__}; pass an instance: {loss_fn.__name__}()")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{wanted}, got {described(loss_fn)}")


def check_schedule_and_clipping(optimizer: Any, lr_scheduler: Any, max_grad_norm: Any) -> None:
    """A ValueError if ``lr_scheduler`` or ``max_grad_norm`` is given without ``optimizer`` (they
    act on a stage's steps), or ``max_grad_norm`` is not a positive finite number; a TypeError if
    ``lr_scheduler`` is not callable (an LRScheduler instance, where a factory is meant)."""
    for name, value in (("lr_scheduler", lr_scheduler), ("max_grad_norm", max_grad_norm)):
        if value is not None and optimizer is None:
            raise ValueError(
                f"{name} was given without optimizer ({name}={described(value)}): it acts on the steps of each "
                "stage's optimizer, and a pipeline without one does not learn; give loss_fn= and optimizer= "
                f"too, or leave {name} out"
            )
    wanted = "lr_scheduler must be a factory optimizer -> LRScheduler, e.g. " + SCHEDULER_EXAMPLE
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            f"{wanted}; got an instance of {type(lr_scheduler).__name__} (each stage makes its own optimizer, "
            "and its own scheduler of it)"
        )
    if lr_scheduler is not None and (isinstance(lr_scheduler, str) or not callable(lr_scheduler)):
        raise TypeError(f"{wanted}; got {described(lr_scheduler)}")
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, numbers.Real)
        or not math.isfinite(max_grad_norm)
        or max_grad_norm <= 0
    ):
        raise ValueError(
            f"max_grad_norm must be a finite number above 0 (the largest norm each stage's gradient is "
            f"clipped to, e.g. max_grad_norm=1.0), or None not to clip; got {described(max_grad_norm)}"
        )


def takes_target(loss_fn: LossFn) -> bool | None:
    """Whether ``loss_fn`` is called as ``loss_fn(output, target)`` (True) or ``loss_fn(output)``.

    None when its signature does not say (``*args``): then the stream decides.
    """
    target = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return sum(p.default is p.empty for p in positional) >= 2

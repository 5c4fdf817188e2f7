"""What configures a pipeline's stages, and the checks of it.

``StageConfig`` is what every stage of one pipeline shares; ``GRAD_MODES`` and ``NONFINITE``
are the values its ``grad_mode`` and ``nonfinite`` may take, ``DEFAULT_GRAD_MODE`` the grad mode
of a pipeline that chooses none. ``check_loss_fn`` and
``takes_target`` judge a loss function before any sample runs. All are re-exported by
``partime.core.stage``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...learning.optimizer_state import described

GRAD_MODES = ("partime", "stash", "weight-stash", "graph-stash")
DEFAULT_GRAD_MODE = "graph-stash"
"""What a pipeline learns with when no grad mode is chosen: one forward per sample, no weight copy."""
NONFINITE = ("raise", "skip")

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
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

    @property
    def learning(self) -> bool:
        return self.optimizer is not None


def check_loss_fn(loss_fn: Any) -> None:
    """A TypeError unless ``loss_fn`` is callable (or None: no learning), and not a loss class
    where an instance of it is meant."""
    wanted = "loss_fn must be a callable such as nn.MSELoss() or a function (output, target) -> scalar tensor"
    if isinstance(loss_fn, type) and issubclass(loss_fn, nn.Module):
        raise TypeError(f"{wanted}, got the class {loss_fn.__name__}; pass an instance: {loss_fn.__name__}()")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{wanted}, got {described(loss_fn)}")


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

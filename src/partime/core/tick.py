"""What one stage does in one tick, written once for every executor (SPEC.md, "A tick").

A tick of stage i has two halves, in this order:

- **forward half**, when the schedule gives the stage a sample at this tick
  (``schedule.forward_sample``): it takes the message from the stage before (the sample itself,
  at stage 0). ``Data``: the stage runs it forward and sends the output on; the last stage instead
  hands out the result and, when learning, takes the sample's target, computes the loss, its
  backward and step, and sends the gradient back. ``Skip`` (a hole: a sample skipped under
  ``nonfinite="skip"``): nothing is computed, a ``Skip`` goes on, and the last stage hands out a
  result without output and, when learning, sends back a ``Skip``: the gradient that will not come.
  A skipped loss sends back a ``Skip`` too. A ``Data`` marked ``predicted`` (a sample offered to be
  predicted, not learnt from) runs forward under ``torch.no_grad()`` keeping nothing for a gradient
  and goes on marked; the last stage hands out its result with the output and no loss, and, when
  learning, sends back a ``Skip``: no stage steps for it, and the schedule is the same.
- **backward half**, when learning, for every stage but the last, when the schedule gives it a
  gradient at this tick (``schedule.backward_sample``): ``Data``: the stage applies it (backward and
  step) and sends the gradient w.r.t. its input back; ``Skip``: it forgets that sample's forward,
  takes no step, and passes the ``Skip`` back.

Stage 0 sends no gradient back, nor does any stage before which nothing trains (a frozen
backbone's last stage); a stage before every one that trains takes none (``Stage.takes_gradient``). The inline executor runs both halves of every stage in order within
a tick and delivers what they send at the next tick; a worker (``worker_loop.run_segment``) wraps them
with the blocking receives and sends of its links. Neither restates this rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..result import Result
from .stage import Stage


@dataclass(frozen=True, slots=True)
class Data:
    """A value for sample ``sample``: an activation (a tensor or a flat tuple of them) going
    forward, or the gradient w.r.t. one going back; ``predicted``: an activation of a sample that
    is only predicted, not learnt from."""

    sample: int
    value: Any
    predicted: bool = False


@dataclass(frozen=True, slots=True)
class Skip:
    """Sample ``sample`` was skipped: a hole going forward, or a gradient that will not come back."""

    sample: int


Passed = Data | Skip
"""What a stage passes a neighbour in a tick: a value, or the hole of a skipped sample."""


@dataclass(frozen=True, slots=True)
class Forwarded:
    """What a forward half sends: to the next stage, back to the one before, and out of the pipeline."""

    activation: Passed | None = None  # to the next stage; None at the last
    gradient: Passed | None = None  # back, from the last stage's loss; None elsewhere and at stage 0
    result: Result | None = None  # from the last stage


def forward_half(stage: Stage, message: Passed, last: bool, target: Callable[[], Any]) -> Forwarded:
    """Stage ``stage``'s forward half on ``message`` (see the module docstring); ``last`` if it is
    the last stage, and ``target()`` gives the sample's target (called once, only by a last stage
    that learns from a ``Data``)."""
    s = message.sample
    learning, sends = stage.config.learning, stage.sends_gradient
    if isinstance(message, Skip):
        if not last:
            return Forwarded(activation=message)
        return Forwarded(gradient=message if sends else None, result=Result(s, None, skipped=True))
    out = stage.forward(s, message.value, learn=not message.predicted)
    if not last:
        return Forwarded(activation=Data(s, out, message.predicted))
    if not learning:
        return Forwarded(result=Result(s, out))
    if message.predicted:  # no loss, and the gradient that will not come
        return Forwarded(gradient=Skip(s) if sends else None, result=Result(s, out, predicted=True))
    learnt = stage.learn(s, target())
    back: Passed | None = None
    if sends:
        back = Skip(s) if learnt.skipped else Data(s, learnt.gradient)
    return Forwarded(gradient=back, result=Result(s, out, learnt.loss, skipped=learnt.skipped))


def backward_half(stage: Stage, message: Passed) -> Passed | None:
    """Stage ``stage``'s backward half on the gradient ``message``: what goes back to the stage
    before (None at stage 0)."""
    s = message.sample
    if isinstance(message, Skip):
        stage.drop(s)
        return message if stage.sends_gradient else None
    grad = stage.backward(s, message.value)
    return Data(s, grad) if stage.sends_gradient else None

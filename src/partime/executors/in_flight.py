"""What a stage sent during its last tick, in a checkpoint and back.

At a tick boundary the values in transit are what each stage sent its neighbours during the tick
before (``worker_loop.Sent``), which they take at the next one. ``stage_answer`` is one stage's part of
a checkpoint (its state and those values), ``executor_state`` puts every stage's part together in
the format every executor shares (``executors/base.py``), and ``stage_resume`` and ``resume``
give a stage back its part: its state, and its links with those values waiting on them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import Tensor

from ..checkpoint.files import message as transit_message
from ..core.stage import Stage
from .messages import KIND_DATA, KIND_PREDICT, KIND_SKIP, Message
from .worker_loop import Links, Sent


def stage_answer(stage: Stage, sent: Sent) -> dict[str, Any]:
    """One stage's part of a checkpoint: its state and what it sent during the tick before it."""

    def value(v: tuple[int, tuple[Tensor, ...] | None, bool] | None) -> dict[str, Any] | None:
        return None if v is None else transit_message(*v)

    return {"stage": stage.state_dict(), "activation": value(sent.activation), "gradient": value(sent.gradient)}


def executor_state(answers: list[dict[str, Any]], tick: int, targets: list[dict[str, Any]]) -> dict[str, Any]:
    """An executor's ``state_dict`` (``executors/base.py``) from every stage's ``stage_answer``, taken
    ``tick`` ticks into the segment (0: between two segments), and the targets in transit."""
    transit = None
    if tick:
        transit = {
            "tick": tick,
            "acts": [None] + [a["activation"] for a in answers[:-1]],
            "grads": [a["gradient"] for a in answers[1:]] + [None],
            "targets": targets,
        }
    return {"stages": [a["stage"] for a in answers], "transit": transit}


def stage_resume(state: dict[str, Any], i: int) -> dict[str, Any]:
    """What stage ``i`` resumes from, out of an executor's state: for ``resume``."""
    transit = state["transit"]
    return {
        "stage": state["stages"][i],
        "tick": transit["tick"] if transit else 0,
        "activation": transit["acts"][i] if transit else None,
        "gradient": transit["grads"][i] if transit else None,
    }


def resume(stage: Stage, links: Links, state: dict[str, Any]) -> tuple[Links, int]:
    """Make ``stage`` the one ``state`` (``stage_resume``) describes; the links and tick its first
    ``run_segment`` starts with."""
    stage.load_state_dict(state["stage"])
    return resumed_links(links, state["activation"], state["gradient"]), state["tick"]


class _Primed:
    """A link whose ``get`` first returns ``messages``, then what ``link`` returns."""

    def __init__(self, link: Any, messages: list[Message]):
        self.link = link
        self.messages = deque(messages)

    def get(self, *, check: Callable[[], None] | None = None) -> Message:
        return self.messages.popleft() if self.messages else self.link.get(check=check)

    def put(self, *args: Any, **kwargs: Any) -> None:
        self.link.put(*args, **kwargs)


def resumed_links(links: Links, activation: dict[str, Any] | None, gradient: dict[str, Any] | None) -> Links:
    """``links`` with the values in transit of a checkpoint (``checkpoint.message`` dicts, or None)
    waiting on them: the activation for this stage's next forward, the gradient for its next product
    (a value without tensors is a SKIP; one marked ``predicted`` a PREDICT)."""

    def primed(link: Any, value: dict[str, Any] | None) -> Any:
        if value is None:
            return link
        if value["tensors"] is None:
            return _Primed(link, [Message(KIND_SKIP, value["sample"], 0.0, ())])
        kind = KIND_PREDICT if value.get("predicted", False) else KIND_DATA
        return _Primed(link, [Message(kind, value["sample"], 0.0, tuple(value["tensors"]))])

    return replace(links, act_in=primed(links.act_in, activation), grad_in=primed(links.grad_in, gradient))

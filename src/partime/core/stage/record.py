"""What a stage keeps of one forward, and its copy in a checkpoint.

A ``ForwardRecord`` holds what the later product of a sample's gradient needs: its inputs (leaves),
the weights it went forward with where the grad mode keeps them, and its graph while valid
(in ``graph-stash`` mode, until the product, with the tensors it saved). ``record_state``
copies one into plain values; ``record_from`` makes it again, without its graph. ``value_of`` (re-exported by ``partime.core.stage``) and ``to_device`` handle the values
that cross a stage boundary: a tensor or a tuple of tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..boundary_values import copy_tensors


@dataclass
class ForwardRecord:
    """What a stage keeps of one forward, for a later backward."""

    sample: int
    inputs: tuple[Tensor, ...]  # leaves: the gradient w.r.t. them goes to the previous stage
    is_tuple: bool  # whether the input value was a tuple
    weights: list[Tensor] = field(default_factory=list)  # weight-stash: the weights it went with
    outputs: tuple[Tensor, ...] | None = None  # with their graph, while it is valid
    saved: list[Tensor] | None = None  # graph-stash: what its kept graph saved, parameters aside
    random: Tensor | None = None  # the random state its forward started from, to run it again


def record_state(record: ForwardRecord) -> dict[str, Any]:
    """Copies of ``record``, in plain values, and whether its graph was still valid."""
    return {
        "sample": record.sample,
        "inputs": copy_tensors(list(record.inputs)),
        "is_tuple": record.is_tuple,
        "weights": copy_tensors(record.weights),
        "graph": record.outputs is not None,
        "saved": None if record.saved is None else copy_tensors(record.saved),
        "random": None if record.random is None else record.random.clone(),
    }


def record_from(state: dict[str, Any], leaf: Callable[[Tensor], Tensor], device: torch.device) -> ForwardRecord:
    """A kept forward from ``record_state``, on ``device``, its inputs made leaves by ``leaf``,
    without its graph."""
    inputs = tuple(leaf(t.to(device)) for t in state["inputs"])
    weights = [w.detach().to(device).requires_grad_() for w in state["weights"]]
    saved = state.get("saved")  # a checkpoint made before graph-stash has none
    return ForwardRecord(
        state["sample"],
        inputs,
        state["is_tuple"],
        weights,
        saved=None if saved is None else [t.to(device) for t in saved],
        random=state.get("random"),  # likewise
    )


def value_of(tensors: tuple[Tensor, ...], is_tuple: bool) -> Any:
    """A boundary value made of ``tensors``: the tuple itself, or its one tensor."""
    return tuple(tensors) if is_tuple else tensors[0]


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (None, a tensor or a tuple of tensors) on ``device``."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        return value if value.device == device else value.to(device)
    return tuple(t if t.device == device else t.to(device) for t in value)

"""What rank 0 of the distributed executor tells every rank, and the links that follows from it.

``Plan`` is published in the store at the first sample; from it every rank derives the same
list of links, in the same order (``wires``), and checks that it was given the same pipeline.
``local_channel`` makes a channel between two threads of rank 0, where a link would join two ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from torch import nn

from ...core.boundary_values import TensorSpec
from ...core.stage import StageConfig
from ..base import Layout
from ..messages import KIND_DATA, KIND_STATE
from ..process.shared_memory import Channel
from .ranks import Wire


@dataclass(frozen=True)
class Plan:
    """What rank 0 tells every rank at the first sample."""

    balance: tuple[int, ...]
    layout: Layout
    config: dict[str, Any]  # learning, supervised, grad_mode, compensation
    states: tuple[tuple[tuple[str, TensorSpec], ...], ...]  # every stage's state_dict: names and layouts
    resumed: bool = False  # each rank's ``stage_resume`` is in the store, under "resume <rank>"
    random_state: bytes | None = None  # rank 0's random state when its pipeline was made: every stage's origin
    modes: tuple[tuple[tuple[str, bool], ...], ...] = ()  # every stage's modules: names and train() or eval()
    first_trained: int = 0  # the first stage with something to train (``StageConfig.first_trained``)
    parameter_names: tuple[dict[str, str], ...] = ()  # the model's names of every stage's parameters


def state_specs(module: nn.Module) -> tuple[tuple[str, TensorSpec], ...]:
    return tuple((k, TensorSpec(tuple(v.shape), v.dtype)) for k, v in module.state_dict().items())


def modes_of(module: nn.Module) -> tuple[tuple[str, bool], ...]:
    """Every module of ``module`` by name, with its ``training`` flag."""
    return tuple((name, m.training) for name, m in module.named_modules())


def config_key(config: StageConfig) -> dict[str, Any]:
    return dict(
        learning=config.learning,
        supervised=bool(config.supervised),
        grad_mode=config.grad_mode,
        compensation=tuple(config.compensation),
    )


def wires(plan: Plan, depth: int) -> list[Wire]:
    """Every link of the pipeline ``plan`` describes, in the order every rank makes them."""
    layout, learning, supervised = plan.layout, plan.config["learning"], plan.config["supervised"]
    acts = layout.activations
    wires = [Wire(f"activation {i}->{i + 1}", i, i + 1, {KIND_DATA: acts[i].tensors}) for i in range(depth - 1)]
    if learning:
        wires += [Wire(f"gradient {i + 1}->{i}", i + 1, i, {KIND_DATA: acts[i].tensors}) for i in range(depth - 1)]
    if depth > 1:
        wires.append(Wire("result", depth - 1, 0, {KIND_DATA: layout.output.tensors}))
        if supervised:
            if layout.target is None:
                raise RuntimeError("a pipeline whose loss takes a target has a layout with no target")
            wires.append(Wire("target", 0, depth - 1, {KIND_DATA: layout.target.tensors}))
    for r in range(1, depth):
        state = {KIND_STATE: tuple(spec for _, spec in plan.states[r])}
        wires += [Wire(f"control 0->{r}", 0, r, state), Wire(f"reply {r}->0", r, 0, state)]
    return wires


def local_channel(specs: Sequence[TensorSpec], capacity: int, name: str) -> Channel:
    """A ``shared_memory.Channel`` between two threads of rank 0 (threads share the GIL: no spinning)."""
    return Channel(SimpleNamespace(Semaphore=threading.Semaphore), specs, capacity, name=name, spin_s=0)

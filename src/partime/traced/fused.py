"""A stage of a traced model, its segments fused into one fx ``GraphModule``.

The ``Segment`` layers of a traced model (``segment.py``) are what the balancer times and
cuts: one per node, each taking and giving the values live across it. Run one after another they
would interpret their nodes one by one, packing and unpacking those values at every node: tens of
microseconds per node, more than many a node computes. Once the cut is fixed, ``fused`` turns each
stage's run of segments into one ``GraphModule``: the same nodes, in the same order (so the same
bits), as plain Python code that fx generates, which takes the values live across the stage's
first cut and gives those live across its last.

The graph module holds the very modules and tensors the segments hold, under the model's own
names (``layer1.0.conv1.weight``), so training the stage trains the model, and each buffer stays
with its module.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

from torch import Tensor, fx, nn

from .segment import Segment, fill


class Fused(nn.Module):
    """The segments ``segments`` (consecutive, of one traced model) as one module: what they compute
    one after another, without their per-node bookkeeping; from the model's first node, it refuses
    a sample that does not fit the traced forward as the first segment does (``check_sample``)."""

    def __init__(self, segments: Sequence[Segment]):
        super().__init__()
        graph = fx.Graph()
        held: dict[str, Any] = {}
        first = segments[0].program
        value = graph.placeholder("value")
        env: dict[str, Any] = {}
        if first.unpack:
            for k, name in enumerate(first.takes):
                env[name] = graph.call_function(operator.getitem, (value, k))
        else:
            env[first.takes[0]] = value
        for segment in segments:
            for step in segment.program.steps:
                if step.name in env:  # a shape recomputed by each segment that uses it: once here
                    continue
                if step.op == "constant":
                    env[step.name] = step.target
                    continue
                if step.op in ("call_module", "get_attr"):
                    held[step.target] = functools.reduce(getattr, step.target.split("."), segment)
                if step.op == "get_attr":
                    env[step.name] = graph.get_attr(step.target)
                else:
                    args, kwargs = fill(step.args, env), fill(step.kwargs, env)
                    env[step.name] = graph.create_node(step.op, step.target, args, kwargs, name=step.name)
        last = segments[-1]
        graph.output(fill(last.program.gives, env))
        self.graph_module = fx.GraphModule(held, graph, class_name="FusedStage")
        self._first: Segment | None
        self._last: Segment
        # for its checks and messages, and to travel: not children of this module
        object.__setattr__(self, "_first", segments[0] if first.first else None)
        object.__setattr__(self, "_last", last)
        object.__setattr__(self, "_segments", tuple(segments))
        self.nodes = tuple(segment.node for segment in segments)

    def __reduce__(self) -> tuple[Any, ...]:
        """Travel (to a worker process, a rank, a deep copy) as the segments it was made from, and
        be made again from them there: fx would pickle the graph module as its generated code and
        trace that code again, which fails where the code calls a function that partime's trace
        kept whole but fx's own would trace through (control flow on shapes, as in Swin's window
        attention). The segments hold the very modules and tensors the graph module holds, each
        module with its own ``training`` flag (a BatchNorm in ``eval()`` stays so); the two made
        here again take theirs as they are now."""
        return (_remade, (self._segments, self.training, self.graph_module.training))

    def forward(self, value: Any) -> Any:
        if self._first is not None:  # the model's first nodes: a sample that does not fit is refused by name
            self._first.check_sample(value)
        out = self.graph_module(value)
        gives = self._last.program.gives
        values = out if type(gives) is tuple or (self._last.program.last and type(out) is tuple) else (out,)
        for k, v in enumerate(values):
            if not isinstance(v, Tensor):
                ref = gives[k] if type(gives) is tuple else gives
                raise TypeError(self._last._not_a_tensor(ref, v, out))
        return out

    def __len__(self) -> int:
        """How many nodes (layers of the traced model) it holds."""
        return len(self.nodes)

    def extra_repr(self) -> str:
        return f"nodes={list(self.nodes)}"


def _remade(segments: Sequence[Segment], training: bool, graph_training: bool) -> Fused:
    """A ``Fused`` made again from ``segments`` where it traveled to, it and its graph module with
    the ``training`` flags given. Not ``train()``: that would set every module inside to one mode,
    and each keeps the one it traveled with."""
    remade = Fused(segments)
    remade.training, remade.graph_module.training = training, graph_training
    return remade


def fused(stages: Sequence[nn.Module]) -> list[nn.Module]:
    """``stages`` (from ``partition.split``) with each run of a traced model's segments fused
    (``Fused``); the stages of any other model as they are."""
    out: list[nn.Module] = []
    for stage in stages:
        children = list(stage.children())
        segments = [c for c in children if isinstance(c, Segment)]
        out.append(Fused(segments) if segments and len(segments) == len(children) else stage)
    return out

"""Any module whose forward can be traced, as layers that partime cuts (internal module).

An ``nn.Sequential`` is cut between its children, as it is. Any other module is traced with
torch.fx's symbolic tracer (``Tracer``): it needs no sample, it keeps the model's own submodules
(torch's own layers are leaves: ``nn.Conv2d``, ``nn.BatchNorm2d``, ``nn.MultiheadAttention``; an
``nn.Sequential`` inside is traced through), so parameters and buffers stay with their modules
and BatchNorm's statistics are the module's own, and it gives a graph in topological order.
``torch.export`` would not do: it decomposes the model into aten ops and turns buffers into
inputs and outputs of a functional graph, which loses the modules (and the identity of their
tensors) that stages train, tie and hand back. ``traced_graph.build`` then makes the graph an
``nn.Sequential`` of ``traced_segment.Segment`` layers, one per computing node, so that every
executor, grad mode, checkpoint and the balancer work on it as on any ``nn.Sequential``; running
them one after another runs the graph's own ops in its order, so the outputs are the model's to the
bit on CPU (what crosses a cut between stages arrives as a contiguous copy: a view of another
layout, a transpose, crossing one may compute in other bits after it).

``layers_of(model)`` promises those layers or a TypeError, raised when a Pipeline is made, naming
what cannot be cut and, where fx gives it, the source line, with the fix:

- a forward fx cannot trace (``if``/``for`` on a tensor's values: fx's ``TraceError``; ``len`` or
  iteration over a tensor; ``*args``/``**kwargs``);
- a forward that writes into its input in place (``x.add_(1)``, ``ReLU(inplace=True)`` on it, or
  on a view of it): partime hands each input on and may run it forward again;
- an output that is not a tensor or a flat tuple of tensors;
- one of torch's own layers as the model (it is kept whole: wrap it in an ``nn.Sequential``).

The fix for a part that cannot be traced is to keep it whole, as a leaf: trace the model with a
``torch.fx.Tracer`` whose ``is_leaf_module`` is True for that part and give partime the
``torch.fx.GraphModule``; its graph is taken as it is. A value that is not a tensor and that a cut
would have to carry (an int returned by a call that fx records) is refused by the segment that
makes it, at its first forward: when the pipeline is made if it is given ``sample=``
(``boundary_specs``), else at the first sample.

The arguments of ``forward`` that have a default are left at it (fx's ``concrete_args``); the
sample gives the others: one tensor, or a tuple with one per argument.
"""

from __future__ import annotations

import copy
import inspect
import operator
import os
import re
import traceback
from typing import Any

import torch
from torch import fx, nn

from .traced_graph import build, inline_nodes
from .values import ValueSpec, as_tensors, spec_of

LEAF_FIX = (
    "keep the part that cannot be traced whole, as a leaf: trace the model with a torch.fx.Tracer subclass "
    "whose is_leaf_module(module, name) is True for it and give partime "
    "torch.fx.GraphModule(model, tracer.trace(model)); or wrap the model's parts in an nn.Sequential, "
    "which partime cuts between its children without tracing"
)

VIEWS = frozenset(
    {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "narrow", "select", "squeeze"}
    | {"unsqueeze", "expand", "expand_as", "flatten", "unflatten", "unbind", "split", "chunk", "as_strided"}
    | {"diagonal", "detach", "contiguous", "unfold", "movedim", "swapaxes", "swapdims", "getitem", "T", "mT"}
)
"""Ops whose result may share the memory of their first argument (so writing into it writes there)."""


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class Tracer(fx.Tracer):
    """fx's symbolic tracer, recording each node's source line (``node.stack_trace``)."""

    record_stack_traces = True


def layers_of(model: nn.Module) -> nn.Sequential:
    """``model`` itself if it is an ``nn.Sequential``; else its traced graph as segments (see the
    module), which hold ``model``'s own submodules and tensors. A TypeError for what cannot be cut."""
    if isinstance(model, nn.Sequential):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module (an nn.Sequential, or a module whose forward can be traced), "
            f"got {type(model).__name__}"
        )
    name = type(model).__name__
    if not isinstance(model, fx.GraphModule) and Tracer().is_leaf_module(model, ""):
        raise TypeError(
            f"model must be an nn.Sequential, got {name}, or a module of your own whose forward can be traced: "
            f"{name} is one of torch's own layers, which partime keeps whole (it cuts between layers); "
            "wrap it: nn.Sequential(model)"
        )
    graph = model.graph if isinstance(model, fx.GraphModule) else trace(model)
    _check(graph, model)
    return build(model, graph, where)


def trace(model: nn.Module) -> fx.Graph:
    """The fx graph of ``model.forward``, its arguments with defaults left at them."""
    name = type(model).__name__
    parameters = inspect.signature(model.forward).parameters.values()
    variadic = [("*" if p.kind is p.VAR_POSITIONAL else "**") + p.name for p in parameters if p.kind in _VARIADIC]
    if variadic:
        raise TypeError(
            f"cannot trace {name}.forward: it takes {variadic[0]}, and a traced forward takes named arguments; "
            f"give it one argument per input (a sample is one tensor, or a tuple with one per argument), or {LEAF_FIX}"
        )
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
    try:
        return Tracer().trace(model, concrete_args=defaults or None)
    except Exception as exc:
        raise TypeError(
            f"cannot trace {name}.forward with torch.fx{_line_of(exc)}: {type(exc).__name__}: {exc}. partime cuts "
            "a module that is not an nn.Sequential between the nodes of its traced graph, so its forward must run "
            "the same ops whatever the values of its input (no if or loop on a tensor's values, no iterating over "
            f"a tensor, no len() of one). To pipeline it, {LEAF_FIX}"
        ) from exc


def where(node: fx.Node) -> str:
    """The source line of ``node`` in words ("model.py:12, in forward: x = self.conv(x)"), or ""."""
    lines = (node.stack_trace or "").splitlines()
    torch_dir = os.path.dirname(torch.__file__)
    found = ""
    for i, line in enumerate(lines):
        frame = _FRAME.match(line)
        if frame is None or frame["path"].startswith(torch_dir):  # the model's code, not fx's
            continue
        after = lines[i + 1] if i + 1 < len(lines) else ""
        code = "" if _FRAME.match(after) else after.strip()
        found = f"{os.path.basename(frame['path'])}:{frame['line']}, in {frame['function']}"
        found += f": {code}" if code else ""
    return found


_FRAME = re.compile(r'\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


def boundary_specs(layers: nn.Sequential, sample: Any) -> tuple[ValueSpec, ...]:
    """What crosses each cut position of ``layers`` (a traced model's) on ``sample``, from one forward
    of a copy without gradients (the model and the random state stay as they were); a segment's
    TypeError for a value that is not a tensor."""
    as_tensors(sample, "sample")
    specs = []
    value = sample
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for key, layer in copy.deepcopy(layers)._modules.items():
            value = layer(value)
            specs.append(spec_of(value, f"the values after node {key}"))
    return tuple(specs[:-1])


# -- the checks ---------------------------------------------------------------------------------


def _check(graph: fx.Graph, model: nn.Module) -> None:
    """A TypeError unless ``graph`` has an input, writes into none of its inputs (nor into views of
    them) and returns a tensor or a flat tuple of tensors that it computes."""
    name = type(model).__name__
    inputs = [n for n in graph.nodes if n.op == "placeholder" and not n.args]
    if not inputs:
        raise TypeError(f"{name}.forward takes no input: there is nothing to stream through it")
    aliases = set(inputs)
    for node in graph.nodes:
        written = _written(node, model)
        if isinstance(written, fx.Node) and written in aliases:
            raise TypeError(_in_place(node, written, inputs, name))
        first = node.args[0] if node.args else None
        if isinstance(first, fx.Node) and first in aliases and _op_name(node) in VIEWS:
            aliases.add(node)
    _check_output(graph, name)


def _op_name(node: fx.Node) -> str:
    """The name of what ``node`` calls: a method's or a function's name (getattr: the attribute's)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    if node.target is getattr and len(node.args) > 1:
        return str(node.args[1])
    return str(getattr(node.target, "__name__", ""))


def _written(node: fx.Node, model: nn.Module) -> Any:
    """What ``node`` writes into in place, if it does: its first argument, or its ``out=``."""
    first = node.args[0] if node.args else None
    if "out" in node.kwargs:
        return node.kwargs["out"]
    if node.op == "call_module":
        return first if getattr(model.get_submodule(str(node.target)), "inplace", False) is True else None
    name = _op_name(node)
    if node.op == "call_method" and name.endswith("_") and not name.startswith("_"):
        return first
    if node.op == "call_function" and node.target is not getattr:
        if (name.endswith("_") and not name.startswith("_")) or name in _OPERATORS_IN_PLACE:
            return first
        if node.kwargs.get("inplace") is True:
            return first
    return None


_OPERATORS_IN_PLACE = frozenset(
    f.__name__
    for f in (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow)
)
"""Python's in-place operators (fx records ``x += 1`` as ``x + 1``; a graph made by hand may hold them)."""


def _in_place(node: fx.Node, written: fx.Node, inputs: list[fx.Node], name: str) -> str:
    at = where(node)
    source = next((i for i in inputs if i is written), None)
    what = f"input {source.name}" if source is not None else f"input (through {written.name}, a view of it)"
    return (
        f"node {node.name} of {name}.forward{f' ({at})' if at else ''} writes into its {what} in place: "
        "partime hands each input on unchanged and may run it forward again, so a traced forward must not "
        "change its input. Compute out of place (x = x.add(1) for x.add_(1); ReLU() for ReLU(inplace=True) "
        f"on the input), or {LEAF_FIX}"
    )


def _check_output(graph: fx.Graph, name: str) -> None:
    output = next(n for n in graph.nodes if n.op == "output")
    value = output.args[0]
    reads, python = inline_nodes(graph)
    parts = value if type(value) is tuple else (value,)
    for part in parts:
        if isinstance(part, fx.Node) and part not in reads and part not in python:
            continue
        if isinstance(part, fx.Node):
            kind = "a parameter or buffer" if part in reads else "a Python value (a shape, a constant)"
            found = f"node {part.name}{f' ({where(part)})' if where(part) else ''}, {kind}"
        else:
            found = f"{'a part that is ' if type(value) is tuple else ''}{_describe(part)}"
        raise TypeError(
            f"{name}.forward returns {found}: partime streams outputs that are a tensor or a flat tuple of "
            "tensors computed from the input; return those (e.g. return a, b rather than a dict or a list)"
        )
    if all(isinstance(p, fx.Node) and p.op == "placeholder" for p in parts):
        raise TypeError(f"{name}.forward returns its input as it is: there is nothing to compute in stages")


def _describe(value: Any) -> str:
    if isinstance(value, (list, dict)):  # fx's immutable_list and immutable_dict among them
        return "a list" if isinstance(value, list) else "a dict"
    if isinstance(value, tuple):
        return "a nested tuple"
    return f"the constant {value!r}"


def _line_of(exc: BaseException) -> str:
    """Where in the model's code ``exc`` was raised: its last frame outside torch, in words, or ""."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
    frames = [f for f in frames if f.filename != __file__]
    if not frames:
        return ""
    frame = frames[-1]
    return f" ({os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name}: {(frame.line or '').strip()})"


__all__ = ["Tracer", "boundary_specs", "layers_of", "trace", "where"]

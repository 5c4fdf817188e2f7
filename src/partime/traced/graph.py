"""From a model's fx graph to an ``nn.Sequential`` of ``Segment`` layers.

Every node of the graph is one of:

- an *input*: a placeholder without a default, one per argument of ``forward`` (the sample);
- *inline*: what is not worth a cut and must never cross one, computed again inside each segment
  that uses it: a parameter or buffer read (``get_attr``; the segment holds the tensor), an
  argument left at its default, and the Python values of a tensor's shape (``x.size(0)``,
  ``x.shape[1]``, ``x.dim()``, arithmetic on them, ``torch._assert`` on them); so an int computed
  from a tensor's shape is computed again where it is used, and the tensor travels to there;
- *computing* (``call_module``, ``call_function``, ``call_method``): each one segment, in the
  graph's order, named after its node; except that where every use of a node's value is a
  ``value[i]`` (a tuple unpacked: ``out, weights = attention(q, k, v)``, ``a, b = x.chunk(2)``),
  those ``getitem`` nodes run in the node's own segment, so that no tuple crosses a cut.

``liveness`` says which values cross each cut position (see ``build``).
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from .segment import Forward, Ref, Segment, Step

SHAPE_METHODS = frozenset(
    {"size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "storage_offset"}
    | {"is_contiguous", "is_floating_point", "is_complex", "get_device"}
)
"""Tensor methods whose result is a Python value of the tensor's shape or kind, never its data."""

SHAPE_ATTRIBUTES = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_sparse", "is_quantized"}
)
"""Tensor attributes of the same kind (``getattr(x, "shape")`` in fx's graph)."""

_PYTHON_MODULES = frozenset({"_operator", "operator", "math", "builtins"})


def inline_nodes(graph: fx.Graph) -> tuple[set[fx.Node], set[fx.Node]]:
    """The inline nodes of ``graph`` (see the module): its tensor reads (``get_attr``), and the rest
    (defaults, and Python values of shapes and what is computed from them alone)."""
    reads: set[fx.Node] = set()
    python: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            reads.add(node)
        elif _python_value(node, python):
            python.add(node)
    return reads, python


def _python_value(node: fx.Node, python: set[fx.Node]) -> bool:
    """Whether ``node`` computes a Python value of the kind inline nodes are (``python``: those so far)."""
    if node.op == "placeholder":
        return bool(node.args)  # an argument left at its default
    if node.op == "call_method":
        return node.target in SHAPE_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr and len(node.args) > 1:
        return node.args[1] in SHAPE_ATTRIBUTES or node.args[0] in python
    inputs = node.all_input_nodes
    return _python_op(node.target) and bool(inputs) and all(n in python for n in inputs)


def _python_op(fn: object) -> bool:
    """Whether ``fn`` is Python's own arithmetic (``operator``, ``math``, builtins) or an assertion."""
    if fn is torch._assert or getattr(fn, "__name__", None) == "_assert_is_none":
        return True
    return getattr(fn, "__module__", None) in _PYTHON_MODULES


def groups_of(graph: fx.Graph, inline: set[fx.Node]) -> list[list[fx.Node]]:
    """The computing nodes of ``graph`` in segments: one per node, in order, with the ``getitem``
    nodes that unpack its value (and theirs) in its own."""
    owner: dict[fx.Node, int] = {}
    groups: list[list[fx.Node]] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output") or node in inline:
            continue
        source = node.args[0] if node.op == "call_function" and node.target is operator.getitem else None
        if isinstance(source, fx.Node) and source in owner and _only_unpacked(source):
            owner[node] = owner[source]
        else:
            owner[node] = len(groups)
            groups.append([])
        groups[owner[node]].append(node)
    return groups


def _only_unpacked(node: fx.Node) -> bool:
    return all(u.op == "call_function" and u.target is operator.getitem and u.args[0] is node for u in node.users)


def liveness(
    inputs: list[fx.Node], groups: list[list[fx.Node]], inline: set[fx.Node], outputs: list[fx.Node]
) -> tuple[list[list[fx.Node]], list[list[fx.Node]]]:
    """What each segment must run inline (its inline nodes, and theirs, in the graph's order), and
    what crosses each cut position k from 0 to ``len(groups)`` (before segment k; position 0 is the
    sample, the inputs): every value made before k and used at or after it, or an output."""
    order = {node: i for i, node in enumerate(inputs[0].graph.nodes)}
    made: dict[fx.Node, int] = dict.fromkeys(inputs, -1)
    made.update((node, i) for i, group in enumerate(groups) for node in group)
    last_use = dict.fromkeys(outputs, len(groups))
    runs: list[list[fx.Node]] = []
    for i, group in enumerate(groups):
        mine, run = set(group), set()
        pending = [n for node in group for n in node.all_input_nodes]
        while pending:
            n = pending.pop()
            if n in inline:
                if n not in run:
                    run.add(n)
                    pending.extend(n.all_input_nodes)
            elif n not in mine:
                last_use[n] = max(last_use.get(n, i), i)
        runs.append(sorted(run, key=order.__getitem__))
    values = sorted(made, key=order.__getitem__)
    crossing = [[v for v in values if made[v] < k <= last_use.get(v, -1)] for k in range(len(groups))]
    crossing[0] = list(inputs)
    return runs, crossing


def build(
    model: nn.Module, graph: fx.Graph, where: Callable[[fx.Node], str], forward: Forward | None = None
) -> nn.Sequential:
    """The segments of ``graph`` (traced from ``model``) as an ``nn.Sequential``: each is given the
    values that cross the cut position before it and gives those that cross the one after it (the
    last gives the model's output); ``where(node)`` is its source line and ``forward`` the model's
    forward, for messages. A TypeError if no value would cross a cut (what comes after it does not
    depend on the input)."""
    inputs = [n for n in graph.nodes if n.op == "placeholder" and not n.args]
    output = next(n for n in graph.nodes if n.op == "output")
    reads, python = inline_nodes(graph)
    inline = reads | python
    groups = groups_of(graph, inline)
    runs, crossing = liveness(inputs, groups, inline, output.all_input_nodes)
    order = {node: i for i, node in enumerate(graph.nodes)}
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, group in enumerate(groups):
        last = i == len(groups) - 1
        if not last and not crossing[i + 1]:
            after = groups[i + 1][0].name
            raise TypeError(
                f"nothing the model computes before node {after} is used from there on, so nothing would cross a "
                f"cut before it: what {type(model).__name__}.forward returns does not depend on its input there "
                "(a constant?); return what is computed from the input"
            )
        nodes = sorted([*runs[i], *group], key=order.__getitem__)
        takes = tuple(n.name for n in crossing[i])
        gives = _template(output.args[0]) if last else _refs(crossing[i + 1])
        unpack = len(takes) != 1
        segment = Segment(
            group[0].name,
            tuple(_step(n) for n in nodes),
            takes,
            gives,
            unpack=unpack,
            first=i == 0,
            last=last,
            where={n.name: text for n in nodes if (text := where(n))},
            forward=forward,
        )
        held = sorted({str(n.target) for n in nodes if n.op in ("call_module", "get_attr")}, key=lambda t: t.count("."))
        for target in held:  # a module before what is inside it
            _hold(segment, model, target)
        layers[_layer_name(group[0].name, layers)] = segment
    return nn.Sequential(layers)


def _refs(values: list[fx.Node]) -> Any:
    refs = tuple(Ref(v.name) for v in values)
    return refs[0] if len(refs) == 1 else refs


def _template(arg: Any) -> Any:
    """An argument of a node with each node in it replaced by its ``Ref``."""
    if isinstance(arg, fx.Node):
        return Ref(arg.name)
    if type(arg) is tuple:
        return tuple(_template(a) for a in arg)
    if isinstance(arg, list):
        return [_template(a) for a in arg]
    if isinstance(arg, dict):
        return {k: _template(v) for k, v in arg.items()}
    if isinstance(arg, slice):
        return slice(_template(arg.start), _template(arg.stop), _template(arg.step))
    return arg


def _step(node: fx.Node) -> Step:
    if node.op == "placeholder":  # an argument left at its default
        return Step(node.name, "constant", node.args[0], (), {})
    return Step(node.name, node.op, node.target, _template(node.args), _template(dict(node.kwargs)))


def _hold(segment: Segment, model: nn.Module, target: str) -> None:
    """Give ``segment`` the module or tensor ``target`` of ``model``, as the model holds it."""
    *path, field = target.split(".")
    owner = functools.reduce(getattr, path, model)
    obj = getattr(owner, field)
    persistent = field in owner._buffers and field not in owner._non_persistent_buffers_set
    segment.hold(target, obj, persistent=persistent)


def _layer_name(name: str, taken: OrderedDict[str, nn.Module]) -> str:
    """The node's name as a layer's, unless an ``nn.Sequential`` has an attribute of that name (``to``,
    ``float``: a method's node is named after it); then with ``_node`` after it."""
    while hasattr(nn.Sequential, name) or name in taken:
        name += "_node"
    return name

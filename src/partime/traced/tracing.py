"""Any module whose forward can be traced, as layers that partime cuts.

An ``nn.Sequential`` is cut between its children, as it is. Any other module is traced with
torch.fx's symbolic tracer (``Tracer``): it needs no sample, it keeps the model's own submodules
(torch's own layers are leaves: ``nn.Conv2d``, ``nn.BatchNorm2d``, ``nn.MultiheadAttention``; an
``nn.Sequential`` inside is traced through), so parameters and buffers stay with their modules
and BatchNorm's statistics are the module's own, and it gives a graph in topological order.
``torch.export`` is the second choice only: its graph is of ATen ops, without the model's
modules, and fixed to the mode and the shapes it was exported with; fx's keeps the modules, so a
Dropout or a BatchNorm follows ``train()`` and ``eval()``. A forward fx cannot trace without values
(control flow on shapes or dtypes, ``**kwargs``: transformers models) is exported on the
pipeline's ``sample=`` (``traced.exporting``), and its ops are cut as fx's nodes are. ``traced.graph.build`` then makes the graph an
``nn.Sequential`` of ``traced.segment.Segment`` layers, one per computing node, so that every
executor, grad mode, checkpoint and the balancer work on it as on any ``nn.Sequential``; running
them one after another runs the graph's own ops in its order, so the outputs are the model's to the
bit on CPU (what crosses a cut between stages arrives in the strides it left with, a
``channels_last`` or transposed value as it is; only a view with gaps, a slice, arrives as a dense
copy, on which what follows the cut may compute other bits).

``layers_of(model)`` promises those layers or a TypeError, raised when a Pipeline is made, naming
what cannot be cut and, where fx gives it, the source line, with the fix:

- a forward fx cannot trace (``if``/``for`` on a tensor's values: fx's ``TraceError``; ``len`` or
  iteration over a tensor; ``*args``/``**kwargs``);
- a forward that writes into its input in place (``x.add_(1)``, ``ReLU(inplace=True)`` on it, or
  on a view of it): partime hands each input on and may run it forward again;
- a write in place that another name of the same memory would see in Python and not in the
  traced graph (``check_writes``): an augmented assignment (``a += b``), which Python runs in place
  on a tensor and fx records as ``a + b`` into a new tensor, where the old tensor (``keep = a``
  before it, a list that holds it, a view of it) is used after it; and an explicit in-place op
  (``a.mul_(2)``, ``ReLU(inplace=True)``) on a tensor that another node's value shares (a view of
  it, made before) and that is used after it, since each value that crosses a cut reaches the next
  stage as a copy of its own, and the write would not reach the other's. An in-place op whose
  tensor has no other name used after it is computed as it is: ``out += identity`` and
  ``ReLU(inplace=True)`` in torchvision's ResNet, ``q *= scale`` on a chunk of a projection;
- an output that is not a tensor or a flat tuple of tensors;
- hooks (forward, forward-pre, backward) on the model itself or on a module the trace goes through
  (``check_hooks``; an ``nn.Sequential``'s own too): partime never calls that module's forward, so
  they would never run. Hooks on the modules the layers call run with them, in any executor;
- one of torch's own layers as the model (it is kept whole: wrap it in an ``nn.Sequential``).

The fix for a part that cannot be traced is to keep it whole, as a leaf: trace the model with a
``torch.fx.Tracer`` whose ``is_leaf_module`` is True for that part and give partime the
``torch.fx.GraphModule``; its graph is taken as it is. A value that is not a tensor and that a cut
would have to carry (an int returned by a call that fx records) is refused by the segment that
makes it, at its first forward: when the pipeline is made if it is given ``sample=``
(``boundary_specs``), else at the first sample.

The arguments of ``forward`` that have a default are left at it (fx's ``concrete_args``); the
sample gives the others: one tensor, a tuple with one per argument, or a dict of them by name. A sample that does not fit
is refused, naming the forward's inputs and how to give them (``Segment.check_sample``).

What the graph cannot show is checked on a sample: ``boundary_specs(layers, sample, model)`` runs
the traced layers and ``model`` itself on it and refuses, with a TypeError, a graph that computes
other values than the forward (to the bit on CPU). That catches what no look at the graph can:
what fx does not record (a Python side effect, such as a counter on the module read back as a
constant; a write through a name fx cannot follow); the look at the graph (``check_writes``) is
what needs no sample, and names the node and the line.
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

from ..core.boundary_values import ValueSpec, as_tensors, spec_of
from .exporting import export_graph, exported_output
from .graph import build, inline_nodes
from .segment import Forward, Segment

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
    | {"tensor_split", "hsplit", "vsplit", "view_as_real", "view_as_complex", "real", "imag", "data"}
    | {"to", "type", "type_as", "float", "double", "half", "bfloat16", "cpu", "cuda"}  # self, where nothing changes
    | {"slice", "alias", "_unsafe_view", "split_with_sizes", "unsafe_split", "_reshape_alias"}  # ATen's own
)
"""Ops whose result may share the memory of their first argument (so writing into it writes there)."""

AUGMENTED = "partime_augmented"
"""The key of ``node.meta`` that marks the node of an augmented assignment; its value is the
operator as written (``"+="``)."""

_AUGMENTED_OPERATORS = {
    "add": "+=",
    "sub": "-=",
    "mul": "*=",
    "truediv": "/=",
    "floordiv": "//=",
    "mod": "%=",
    "pow": "**=",
    "matmul": "@=",
    "lshift": "<<=",
    "rshift": ">>=",
    "and_": "&=",
    "or_": "|=",
    "xor": "^=",
}


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class Tracer(fx.Tracer):
    """fx's symbolic tracer, recording each node's source line (``node.stack_trace``) and which
    nodes are augmented assignments (``a += b``: ``node.meta[AUGMENTED] == "+="``). fx records
    these as the operator that makes a new tensor (``a + b``), and so does this tracer: the graph is
    fx's own; the mark says that Python would have written into ``a``."""

    record_stack_traces = True

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return AugmentedProxy(node, self)


class AugmentedProxy(fx.Proxy):
    """fx's ``Proxy``, whose augmented assignments (``__iadd__`` and the rest) mark their node.

    fx's own has none, so Python falls back to ``__add__``; these record the same node."""


def _augmented(name: str, symbol: str) -> Any:
    op = getattr(operator, name)

    def augmented(self: fx.Proxy, other: Any) -> fx.Proxy:
        proxy = self.tracer.create_proxy("call_function", op, (self, other), {})
        proxy.node.meta[AUGMENTED] = symbol
        return proxy

    augmented.__name__ = f"__i{name.rstrip('_')}__"
    return augmented


for _name, _symbol in _AUGMENTED_OPERATORS.items():
    setattr(AugmentedProxy, f"__i{_name.rstrip('_')}__", _augmented(_name, _symbol))


def layers_of(model: nn.Module, sample: Any = None) -> nn.Sequential:
    """``model`` itself if it is an ``nn.Sequential``; else its traced graph as segments (see the
    module), which hold ``model``'s own submodules and tensors. A TypeError for what cannot be cut.

    A forward that fx cannot trace symbolically (control flow on shapes or dtypes, ``**kwargs``)
    is traced by torch.export on ``sample``, where one is given (``traced.exporting``): its
    segments hold the model's own tensors, and the graph its shapes."""
    if isinstance(model, nn.Sequential):
        check_hooks(model, [name for name, _ in model.named_children()])
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
    source, forward = model, _forward_of(model)  # source: what holds the graph's modules and tensors
    if isinstance(model, fx.GraphModule):
        graph = model.graph
    else:
        try:
            graph = trace(model)
        except TypeError as exc:
            if sample is None:
                raise TypeError(f"{exc}; {EXPORT_HINT}") from exc.__cause__
            source, forward = export_graph(model, sample)
            graph = source.graph
    _check(graph, model)
    check_writes(graph, model)
    if source is model:  # an exported graph ran each module's hooks as it was traced: they are in it
        check_hooks(model, [str(n.target) for n in graph.nodes if n.op == "call_module"])
    return build(source, graph, where, forward)


def check_hooks(model: nn.Module, called: list[str]) -> None:
    """A TypeError naming a module of ``model`` that has hooks (forward, forward-pre or backward)
    but whose forward the layers never call, so that its hooks would never run: ``model`` itself,
    or a module that the trace went through. ``called`` names the modules the layers call, whose
    submodules run inside them."""
    for name, module in model.named_modules():
        kinds = [kind for kind, hooks in _hooks(module) if hooks]
        if not kinds or any(name == c or name.startswith(c + ".") for c in called):
            continue
        whose = f"{name}'s" if name else "its"
        what = f"{type(model).__name__} itself" if not name else f"its module {name} ({type(module).__name__})"
        fix = (
            "register them on its layers (a pre-hook on the first, a hook on the last)"
            if not name
            else f"register them on the modules inside it, or {LEAF_FIX}"
        )
        raise TypeError(
            f"the model has {' and '.join(kinds)} hooks on {what}, which would never run: partime runs the "
            f"model's layers (an nn.Sequential's children, the modules a trace calls), never {whose} "
            f"forward as a whole. To keep them, {fix}"
        )


def check_copied_hooks(model: nn.Module, copied: nn.Module) -> None:
    """A TypeError naming a module of ``model`` whose hooks its deep copy ``copied`` (the pipeline's
    own) lost: ``torch.fx.GraphModule``'s copy drops its own forward hooks, which would then never run."""
    copies = dict(copied.named_modules())
    for name, module in model.named_modules():
        twin = copies.get(name)
        lost = (
            [kind for (kind, hooks), (_, kept) in zip(_hooks(module), _hooks(twin)) if len(hooks) != len(kept)]
            if twin
            else []
        )
        if lost:
            raise TypeError(
                f"the model's {'module ' + name if name else 'root'} ({type(module).__name__}) loses its "
                f"{' and '.join(lost)} hooks when copied (copy.deepcopy, as partime copies the model it is given: "
                "torch.fx.GraphModule drops them), so they would never run: register them on the modules inside it"
            )


def _hooks(module: nn.Module) -> list[tuple[str, Any]]:
    """The hooks ``module`` holds, by kind (torch keeps them in dicts of the module)."""
    return [
        ("forward", module._forward_hooks),
        ("forward-pre", module._forward_pre_hooks),
        ("backward", module._backward_hooks),
        ("backward-pre", module._backward_pre_hooks),
    ]


EXPORT_HINT = (
    "or give the Pipeline sample= (one sample as the model takes it: a tensor, a tuple, or a dict of named tensors "
    "such as input_ids and attention_mask), and partime traces the forward with torch.export on it, specialised to "
    "its shapes"
)


def traced_forward(layers: nn.Sequential) -> Forward:
    """The traced model's ``Forward`` if ``layers`` are its segments; else an empty one, which
    takes samples as they are and gives outputs as they are."""
    first = next(iter(layers._modules.values()), None)
    return first.traced_forward if isinstance(first, Segment) else Forward()


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
        if frame is None or frame["path"].startswith(torch_dir) or frame["path"] == __file__:  # the model's code
            continue
        after = lines[i + 1] if i + 1 < len(lines) else ""
        code = "" if _FRAME.match(after) else after.strip()
        found = f"{os.path.basename(frame['path'])}:{frame['line']}, in {frame['function']}"
        found += f": {code}" if code else ""
    return found


_FRAME = re.compile(r'\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


def boundary_specs(layers: nn.Sequential, sample: Any, model: nn.Module | None = None) -> tuple[ValueSpec, ...]:
    """What crosses each cut position of ``layers`` (a traced model's) on ``sample``, from one forward
    of a copy without gradients (the model and the random state stay as they were); a segment's
    TypeError for a value that is not a tensor, or for a sample that does not fit the traced forward.

    With ``model``, the module whose traced graph ``layers`` are, a copy of it runs on a copy of
    ``sample`` too, from the same random state, and a TypeError refuses layers whose output differs
    from its output: to the bit where both are on the CPU (the same ops in the same order, with the
    same threads), within a thousandth elsewhere (a GPU may choose other kernels from call to call)."""
    as_tensors(sample, "sample")
    specs = []
    value = sample
    first = next(iter(layers._modules.values()), None)
    if isinstance(first, Segment):
        first.check_sample(sample)
    devices = _cuda_devices(sample, layers)
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for key, layer in copy.deepcopy(layers)._modules.items():
            value = layer(value)
            specs.append(spec_of(value, f"the values after node {key}"))
    if model is not None:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            copied = tuple(t.detach().clone() for t in as_tensors(sample, "sample"))
            if traced_forward(layers).traced_on is not None:
                expected = exported_output(copy.deepcopy(model), traced_forward(layers), copied)
            else:
                expected = copy.deepcopy(model)(*copied)
        difference = _difference(value, expected)
        if difference:
            name = type(model).__name__
            raise TypeError(
                f"the traced graph of {name}.forward computes other values than {name}.forward on the sample: "
                f"{difference}. torch.fx records the tensor ops of a forward once, as it traces it, and what it does "
                "not record is not in the graph: a Python side effect (a counter or a cache on the module, which the "
                "graph keeps as the constant it saw), a write in place through a name fx does not follow, a value "
                "read from outside the model. Make the forward compute the same on every call "
                f"(torch.fx.symbolic_trace(model).code shows what the graph computes), or {LEAF_FIX}"
            )
    return tuple(specs[:-1])


def _difference(got: Any, expected: Any) -> str:
    """How ``got`` (the traced layers' output) differs from ``expected`` (the forward's), in words;
    "" if it does not (see ``boundary_specs``)."""
    parts, wanted = (got, expected) if type(got) is tuple else ((got,), (expected,))
    if type(wanted) is not tuple or len(wanted) != len(parts):
        return f"it returns {_kind(expected)}, and the traced graph {_kind(got)}"
    for k, (a, b) in enumerate(zip(parts, wanted)):
        what = "its output" if len(parts) == 1 else f"its output {k}"
        if not isinstance(b, torch.Tensor):
            return f"{what} is {_kind(b)}, and in the traced graph a tensor"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{what} is {tuple(b.shape)} {b.dtype}, and in the traced graph {tuple(a.shape)} {a.dtype}"
        exact = a.device.type == "cpu" and b.device.type == "cpu"
        if a.is_floating_point() or a.is_complex():
            b = b.to(a.device)
            rtol, atol = (0.0, 0.0) if exact else (1e-3, 1e-3)
            if not torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
                gap = (a - b).abs().nan_to_num(nan=float("inf")).max().item()
                return f"{what}, a {tuple(a.shape)} {a.dtype} tensor, differs by up to {gap:.3g}"
        elif not torch.equal(a, b.to(a.device)):
            differ = int((a != b.to(a.device)).sum())
            return f"{what}, a {tuple(a.shape)} {a.dtype} tensor, differs in {differ} of its {a.numel()} elements"
    return ""


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__name__}"


def _cuda_devices(sample: Any, layers: nn.Module) -> list[int]:
    """The CUDA devices of ``sample`` and ``layers``, whose random state a check must leave alone."""
    tensors = [*as_tensors(sample, "sample"), *layers.parameters(), *layers.buffers()]
    return sorted(
        {torch.cuda.current_device() if t.device.index is None else t.device.index for t in tensors if t.is_cuda}
    )


def balance_hint(layers: nn.Sequential) -> str:
    """For a message about a balance that does not fit ``layers``: if they are a traced model's, how
    many they are and the names of their nodes, numbered in order (the middle ones elided when
    there are more than ``LISTED``), and where to see them; else ""."""
    segments = list(layers._modules.values())
    if not segments or not all(isinstance(s, Segment) for s in segments):
        return ""
    names = [f"{k} {s.node}" for k, s in enumerate(segments) if isinstance(s, Segment)]
    if len(names) > LISTED:
        names = [*names[: LISTED // 2], "...", *names[-(LISTED // 2) :]]
    model = segments[0].traced_forward.model if isinstance(segments[0], Segment) else "the model"
    n = len(segments)
    return (
        f"{model}: its {n} layers are the nodes of its traced graph, in order: {', '.join(names)} "
        "(pipe.partition.nodes names them, and pipe.partition.summary() shows them by stage, for a pipeline "
        f"made with balance=[{n}])"
    )


LISTED = 24
"""How many node names ``balance_hint`` lists in full; of more, the first and the last half of it."""


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


def check_writes(graph: fx.Graph, model: nn.Module) -> None:
    """A TypeError naming the node and its line, and the other name and where it is used, for a
    write in place into a tensor that another name would see in Python and not in the traced graph
    or a stage (see the module). An explicit write into an input is ``_check``'s to refuse."""
    name = type(model).__name__
    order = {node: i for i, node in enumerate(graph.nodes)}
    _, python = inline_nodes(graph)
    regions = _regions(graph, model)
    sharing: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        sharing.setdefault(regions[node][0], []).append(node)
    for node in graph.nodes:
        symbol = node.meta.get(AUGMENTED)
        written = node.args[0] if symbol else _written(node, model)
        if not isinstance(written, fx.Node) or written in python or (written.op == "placeholder" and not symbol):
            continue
        for other in sharing[regions[written][0]]:
            if order[other] >= order[node]:
                break
            if other in python or (other is written and not symbol) or not _overlap(regions[other], regions[written]):
                continue
            later = next((u for u in other.users if order[u] > order[node]), None)
            if later is not None:
                raise TypeError(_write_missed(node, written, other, later, name))


def _regions(graph: fx.Graph, model: nn.Module) -> dict[fx.Node, tuple[fx.Node, tuple[Any, ...]]]:
    """The memory each node's value may share, as (root, path): the node that made the memory, and
    the steps from it (a view's node, or an int index: ``x.chunk(3)[1]`` is (x, (chunk, 1))). An
    explicit in-place op's value is the memory it writes into; an augmented assignment's is new,
    as the traced graph computes it."""
    regions: dict[fx.Node, tuple[fx.Node, tuple[Any, ...]]] = {}
    for node in graph.nodes:
        first = node.args[0] if node.args else None
        written = None if node.meta.get(AUGMENTED) else _written(node, model)
        op = _op_name(node)
        if isinstance(written, fx.Node) and written in regions:
            regions[node] = regions[written]
        elif isinstance(first, fx.Node) and first in regions and op in VIEWS:
            root, path = regions[first]
            index = node.args[1] if op == "getitem" and len(node.args) > 1 else None
            regions[node] = (root, (*path, index if type(index) is int else node))
        else:
            regions[node] = (node, ())
    return regions


def _overlap(a: tuple[fx.Node, tuple[Any, ...]], b: tuple[fx.Node, tuple[Any, ...]]) -> bool:
    """Whether two regions (``_regions``) may share memory: one root, and no step where they take
    different int indices (two chunks of a tensor, two items of a tuple) before they part."""
    if a[0] is not b[0]:
        return False
    for step_a, step_b in zip(a[1], b[1]):
        if step_a is step_b:
            continue
        return not (type(step_a) is int and type(step_b) is int and step_a != step_b)
    return True


def _write_missed(node: fx.Node, written: fx.Node, other: fx.Node, later: fx.Node, name: str) -> str:
    at = f" ({where(node)})" if where(node) else ""
    used = "is returned" if later.op == "output" else f"is used after it by {_named(later)}"
    symbol = node.meta.get(AUGMENTED)
    if symbol:
        shares = "the tensor it changes" if other is written else "which shares the memory it changes"
        return (
            f"node {node.name} of {name}.forward{at} is an augmented assignment ({symbol}): Python runs it in place "
            "on a tensor, so every other name of that memory sees the new value, but torch.fx records it as "
            f"{_op_name(node)} into a new tensor, and the traced graph would compute other values than "
            f"{name}.forward: {_named(other)}, {shares}, {used}. Write it out of place (a = a + b for a += b), and "
            "the other name keeps the value before, as the traced graph has it; or use the new value where the "
            f"other name is, for the value after; or {LEAF_FIX}"
        )
    return (
        f"node {node.name} of {name}.forward{at} writes in place into {_named(written)}, and {_named(other)}, which "
        f"shares its memory, {used}: a cut between them gives each stage its own copy of every value that "
        f"crosses it, and the write would not reach that of node {other.name}. Compute out of place "
        f"(x = x.add(1) for x.add_(1); ReLU() for ReLU(inplace=True)), or {LEAF_FIX}"
    )


def _named(node: fx.Node) -> str:
    """ "node add_1 (model.py:9, in forward: return a + keep)", or without the line where fx gives none."""
    at = where(node)
    return f"node {node.name} ({at})" if at else f"node {node.name}"


def _forward_of(model: nn.Module) -> Forward:
    """``model``'s forward, for messages about a sample (``traced.segment.Forward``)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a forward Python cannot read the signature of
        return Forward(type(model).__name__)
    signature = f"({', '.join(str(p) for p in parameters)})"
    left = tuple(p.name for p in parameters if p.default is not p.empty and p.kind not in _VARIADIC)
    inputs = tuple(p.name for p in parameters if p.default is p.empty and p.kind not in _VARIADIC)
    return Forward(type(model).__name__, signature, left, names=inputs)  # a sample may name its inputs


def _op_name(node: fx.Node) -> str:
    """The name of what ``node`` calls: a method's or a function's name (getattr: the attribute's)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    if isinstance(node.target, torch._ops.OpOverload):  # an ATen op of an exported graph: aten.add_.Tensor
        return str(node.target._opname)
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


__all__ = [
    "AUGMENTED",
    "AugmentedProxy",
    "Tracer",
    "balance_hint",
    "boundary_specs",
    "check_writes",
    "layers_of",
    "trace",
    "traced_forward",
    "where",
]

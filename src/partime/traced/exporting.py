"""A module that torch.fx cannot trace without values, traced by ``torch.export`` on a sample.

fx's symbolic tracer (``partime.traced.tracing``) records a forward without running it, so it
cannot follow Python that reads a tensor's shape or dtype (``if q_length == 1``, ``if
pixel_values.dtype != expected_dtype``), a slice whose bounds come from a shape, or a forward that
takes ``**kwargs``: what Hugging Face transformers models do everywhere. ``export_graph`` traces
such a module with ``torch.export.export(..., strict=False)`` on one sample instead: it runs the
forward's Python for real on fake tensors of the sample's shapes and dtypes, so control flow on
shapes and dtypes takes the sample's branch and every shape becomes a constant (the graph is
*specialised* to the sample, as torch.export and dynamo specialise static shapes). Control flow
on a tensor's values cannot be resolved there and is refused, as fx refuses it.

Why torch.export and not a tracer of partime's own that specialises fx's proxies: the model's
Python decides what it runs by asking whether it is being traced (transformers skips an
all-ones attention mask by reading its values, unless the tensor is fake or dynamo compiles),
and torch.export is what such code is written for; a proxy of partime's own would take the eager
path and be refused at the first value it reads. What it keeps of partime's promise:

- **The model's tensors, by their own names.** ``ExportedProgram.module()`` reads each parameter
  and buffer as a ``get_attr`` of the model's own qualified name (``encoder.layer.0.attention
  .self.query.weight``) and holds the very tensors the model holds, so training a stage trains
  the model, and a buffer stays a buffer.
- **The model's outputs, to the bit.** The graph is in ATen ops (``aten.linear``,
  ``aten.layer_norm``, ``aten.scaled_dot_product_attention``), the same kernels the eager
  forward dispatches to, in its order; random ops draw as the eager ones do (``aten.dropout``).
  What is not kept: the modules themselves (their calls are inlined into ops) and the mode. A
  forward is exported in the mode the model is in (``model.train()`` or ``model.eval()``): a
  dropout is in the graph as it ran then, as fx already fixes every ``self.training`` it reads.

The graph is cleaned of what only checks the sample the program was exported on (its guards,
its dtype asserts): partime checks each sample against the traced shapes itself
(``traced.segment.Forward.traced_on``). What ``forward`` returns is flattened by torch's pytree
(``ModelOutput``, a dict, a tuple): the graph returns its tensors, and ``Forward.structured``
makes the model's own output of them again.

A sample here is one tensor (the first argument), a tuple (the first arguments, in order) or a
dict of named tensors (``input_ids``, ``attention_mask``, ``pixel_values``). A forward that takes
``use_cache`` is exported with ``use_cache=False``: a cache carries state from one call to the
next, and a pipeline's samples are independent.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_leaves

from ..core.boundary_values import TensorSpec
from .segment import Forward, tree_of

NO_CACHE = {"use_cache": False}
"""What a forward that names these arguments is exported with."""

CHECKS_ONLY = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size")
"""ATen ops of an exported graph that only check the sample it was exported on."""


def export_graph(model: nn.Module, sample: Any) -> tuple[fx.GraphModule, Forward]:
    """``model``'s forward exported on ``sample`` (see the module), as a graph module that holds
    ``model``'s own tensors, and the ``Forward`` that names its inputs, the shapes it was traced on
    and the structure of its output. A TypeError naming what could not be exported."""
    name = type(model).__name__
    args, kwargs, names = _arguments(model, sample)
    try:
        program = torch.export.export(model, args, {**kwargs, **_fixed(model)}, strict=False)
    except Exception as exc:
        raise TypeError(
            f"cannot trace {name}.forward with torch.export on the sample either: {type(exc).__name__}: "
            f"{_first_line(exc)}. A model that torch.fx cannot trace symbolically is traced by torch.export on "
            "the sample, which runs its Python on the sample's shapes: control flow on a tensor's values, or an "
            "output that is not made of tensors, cannot be traced so"
        ) from exc
    module = program.module()
    out_spec = program.call_spec.out_spec  # the pytree structure of forward's output, which the graph flattens
    _clean(module.graph, len(names))
    module.recompile()
    inputs = [node for node in module.graph.nodes if node.op == "placeholder"]
    values = [*args, *kwargs.values()]
    traced_on = tuple(TensorSpec(tuple(v.shape), v.dtype) for v in values)
    forward = Forward(
        name,
        f"({', '.join(names)})",
        names=tuple(names) if kwargs else (),
        traced_on=traced_on,
        out_tree=tree_of(out_spec),
    )
    assert len(inputs) == len(names), "one placeholder per tensor of the sample"
    return module, forward


def exported_output(model: nn.Module, forward: Forward, tensors: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    """What ``model.forward`` returns on ``tensors`` (a sample's, flat) called as ``export_graph``
    exported it, flattened as its graph returns it: one tensor, or a tuple of them."""
    if forward.names:
        out = model(**dict(zip(forward.names, tensors)), **_fixed(model))
    else:
        out = model(*tensors, **_fixed(model))
    return tuple(tree_leaves(out))


def _fixed(model: nn.Module) -> dict[str, Any]:
    """The arguments of ``NO_CACHE`` that ``model.forward`` names, as it is exported with them (a
    sample, a dict of tensors, never gives them)."""
    return {k: v for k, v in NO_CACHE.items() if _names(model, k)}


def _arguments(model: nn.Module, sample: Any) -> tuple[tuple[Tensor, ...], dict[str, Tensor], list[str]]:
    """The positional and keyword arguments ``sample`` gives ``model.forward``, and their names."""
    name = type(model).__name__
    if isinstance(sample, Mapping):
        bad = {k: type(v).__name__ for k, v in sample.items() if not isinstance(k, str) or not isinstance(v, Tensor)}
        if bad or not sample:
            raise TypeError(
                f"a sample for {name}.forward given as a dict must map names of its arguments to tensors, got "
                f"{bad or 'an empty dict'}"
            )
        unknown = [k for k in sample if not _takes(model, k)]
        if unknown:
            raise TypeError(
                f"{name}.forward{_signature(model)} takes no argument {', '.join(map(repr, unknown))}: a sample "
                "given as a dict names the arguments of forward"
            )
        return (), dict(sample), list(sample)
    tensors = (sample,) if isinstance(sample, Tensor) else sample
    if not isinstance(tensors, tuple) or not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise TypeError(
            f"a sample for {name}.forward must be a tensor, a tuple of tensors (its first arguments) or a dict of "
            f"named tensors (its arguments by name), got {type(sample).__name__}"
        )
    positional = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return tuple(tensors), {}, positional[: len(tensors)] or [f"input {k}" for k in range(len(tensors))]


def _takes(model: nn.Module, argument: str) -> bool:
    """Whether ``model.forward`` takes an argument named ``argument``: it names it, or takes ``**kwargs``."""
    parameters = inspect.signature(model.forward).parameters.values()
    return _names(model, argument) or any(p.kind is p.VAR_KEYWORD for p in parameters)


def _names(model: nn.Module, argument: str) -> bool:
    """Whether ``model.forward`` has a parameter named ``argument`` that may be given by name."""
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.name == argument and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters)


def _signature(model: nn.Module) -> str:
    try:
        return str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        return "(...)"


def _clean(graph: fx.Graph, tensors: int) -> None:
    """Remove from an exported graph its guards, its asserts on the sample and the placeholders of
    the arguments it fixed (``NO_CACHE``), which nothing else uses."""
    for node in reversed(graph.nodes):
        target = getattr(node.target, "_opname", node.target)
        if (node.op == "call_module" and node.target == "_guards_fn") or target in CHECKS_ONLY:
            graph.erase_node(node)
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    for node in placeholders[tensors:]:
        if node.users:
            raise TypeError(f"the exported graph uses its argument {node.name}, which the sample does not give")
        graph.erase_node(node)
    graph.lint()


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


__all__ = ["CHECKS_ONLY", "NO_CACHE", "export_graph", "exported_output"]

"""One node of a traced model, as a layer of an ``nn.Sequential``.

``partime.traced.tracing`` turns the fx graph of a model into an ``nn.Sequential`` of ``Segment`` modules,
one per computing node, in the graph's order. A segment takes the values live before its node
(the model's input, for the first) and returns those live after it (the model's output, for the
last): a bare tensor where one value is live, else a tuple. So a cut between two segments carries
exactly the values that the rest of the model still needs, as the rest of partime passes values
between stages, and running the segments one after another runs the graph's own ops in its order.

A segment holds, as child modules, parameters and buffers, the very objects its node uses (the
modules it calls, the tensors it reads), under the names the traced model gives them (a module
``layer1.0.conv1`` of the model is the segment's ``layer1.0.conv1``): training a stage trains the
model, a parameter that nodes of two segments use is a tensor two children hold (``ties``), and
each buffer (BatchNorm's statistics) stays with its module.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_unflatten, treespec_leaf

from ..core.boundary_values import TensorSpec


@dataclass(frozen=True)
class Ref:
    """A value of the graph, by the name of the node that computes it, in a step's arguments."""

    name: str


class Step(NamedTuple):
    """One node of the graph as a segment runs it: it stores the result as ``name``.

    ``op`` is fx's: ``call_module`` (``target``: the module's name in the model), ``call_function``
    (the function), ``call_method`` (the method's name; ``args[0]`` is the object), ``get_attr``
    (the tensor's name in the model), or ``constant`` (``target`` is the value: an argument of
    ``forward`` left at its default). ``args`` and ``kwargs`` hold ``Ref`` where the node had a value
    of the graph."""

    name: str
    op: str
    target: Any
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class Forward:
    """The traced model's ``forward``, for messages about a sample that does not fit it: the model's
    class name, the signature (``"(x, mask=None)"``) and the arguments left at their defaults (fx's
    ``concrete_args``: no inputs of the traced graph).

    A forward traced on a sample (``traced.exporting``) also has the shapes and dtypes it was
    traced on (``traced_on``: its graph holds them, and a sample of others is refused), the names
    of its inputs where the sample was a dict of them (``names``: ``flat_sample`` makes such a
    sample the tuple the graph takes), and the pytree structure of what it returns (``out_tree``,
    as ``tree_of`` gives it: ``structured`` makes the model's output of the graph's tensors)."""

    model: str = "the model"
    signature: str = ""
    left: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    traced_on: tuple[TensorSpec, ...] | None = None
    out_tree: Any = None

    def flat_sample(self, sample: Any) -> Any:
        """``sample`` as the traced graph takes it: a dict of the named inputs as the tuple of them
        in order (one tensor for one input); any other sample as it is. A TypeError for a dict
        without the names."""
        if not self.names or not isinstance(sample, Mapping):
            return sample
        if set(sample) != set(self.names):
            missing, extra = [n for n in self.names if n not in sample], [k for k in sample if k not in self.names]
            raise TypeError(
                f"the traced {self.model}.forward takes {', '.join(self.names)}: give every sample as a dict of "
                f"these{f', without {extra}' if extra else ''}{f', with {missing}' if missing else ''}"
            )
        values = tuple(sample[n] for n in self.names)
        return values[0] if len(values) == 1 else values

    def structured(self, output: Any) -> Any:
        """The model's own output (a ``ModelOutput``, a dict) of the traced graph's ``output``; the
        output as it is for a forward traced without a sample."""
        if self.out_tree is None or output is None:
            return output
        leaves = [output] if isinstance(output, Tensor) else list(output)
        return tree_unflatten(leaves, _spec_of(self.out_tree))

    def check_traced_on(self, sample: Any) -> None:
        """A TypeError unless ``sample`` (a tensor, or a tuple of them) has the shapes and dtypes
        traced on; a sample of another kind is for the other checks to refuse."""
        tensors = (sample,) if isinstance(sample, Tensor) else sample
        if self.traced_on is None or not isinstance(tensors, tuple) or not all(isinstance(t, Tensor) for t in tensors):
            return
        got = tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors)
        if got != self.traced_on:
            names = self.names or tuple(f"input {k}" for k in range(len(got)))
            shown = ", ".join(f"{n} {s}" for n, s in zip(names, self.traced_on))
            seen = ", ".join(f"{n} {s}" for n, s in zip(names, got))
            raise TypeError(
                f"{self.model}.forward was traced on a sample of {shown}, and this sample is {seen}: a graph "
                "traced on a sample holds its shapes and dtypes. Give every sample the traced shapes (pad a "
                "sequence to the traced length), or make one Pipeline per shape, each with sample= of it"
            )


LEAF = "leaf"
"""A leaf of a pytree structure as ``tree_of`` gives it: one tensor."""


def tree_of(spec: TreeSpec) -> Any:
    """A pytree structure as plain values that pickle and copy: ``LEAF`` for a leaf, else its
    type, context and children's (torch's ``TreeSpec`` warns as it is pickled or copied)."""
    return LEAF if spec.is_leaf() else (spec.type, spec.context, tuple(tree_of(c) for c in spec.children()))


def _spec_of(tree: Any) -> TreeSpec:
    """The ``TreeSpec`` of a structure that ``tree_of`` gave."""
    if tree == LEAF:
        return treespec_leaf()
    kind, context, children = tree
    return TreeSpec(kind, context, [_spec_of(c) for c in children])


@dataclass(frozen=True)
class Program:
    """What a ``Segment`` runs (see there): kept in one attribute, so that a module of the model may
    have any name but ``_program`` inside a segment."""

    node: str
    steps: tuple[Step, ...]
    takes: tuple[str, ...]
    gives: Any
    unpack: bool
    first: bool
    last: bool
    where: Mapping[str, str]
    forward: Forward

    def __reduce__(self) -> tuple[Any, ...]:
        """Travel with each ATen op (``torch.ops.aten.add.Tensor``, of a graph torch.export made) by
        its name, which pickle cannot take the op itself by, and find the op again by it."""
        steps = tuple(step._replace(target=OpName.of(step.target)) for step in self.steps)
        return (
            _program_of,
            (self.node, steps, self.takes, self.gives, self.unpack, self.first, self.last, self.where, self.forward),
        )


@dataclass(frozen=True)
class OpName:
    """An operator of ``torch.ops`` by name: ``aten``, ``add``, ``Tensor``."""

    namespace: str
    name: str
    overload: str

    @staticmethod
    def of(target: Any) -> Any:
        """``target`` by name if it is an operator of ``torch.ops``; else ``target`` itself."""
        if isinstance(target, torch._ops.OpOverload):
            return OpName(target.namespace, target._opname, target._overloadname)
        return target

    def op(self) -> torch._ops.OpOverload:
        """The operator this names."""
        return getattr(getattr(getattr(torch.ops, self.namespace), self.name), self.overload)


def _program_of(node: str, steps: tuple[Step, ...], *rest: Any) -> Program:
    """A ``Program`` made again where it traveled to, each operator found by its name."""
    found = tuple(step._replace(target=step.target.op()) if isinstance(step.target, OpName) else step for step in steps)
    return Program(node, found, *rest)


class Segment(nn.Module):
    """Node ``node`` of a traced model, with the nodes that must run beside it (see the module).

    ``takes`` names the values it is given: one value as it comes (``unpack`` False), or a tuple
    with one tensor per name. It runs ``steps`` in order and returns ``gives`` filled in (``Ref``:
    one value; a tuple of them: a tuple). A value it returns that is not a tensor (where it is not
    ``last``; there, an output that is not a tensor or a flat tuple of tensors) raises a TypeError
    naming the node that computed it and its source line (``where``: node name to source line).
    An exception raised by a step carries a note naming its node (Python 3.11 and later). The
    ``first`` segment refuses a sample that does not fit the traced forward (``check_sample``).
    """

    def __init__(
        self,
        node: str,
        steps: tuple[Step, ...],
        takes: tuple[str, ...],
        gives: Any,
        *,
        unpack: bool,
        first: bool = False,
        last: bool = False,
        where: Mapping[str, str] | None = None,
        forward: Forward | None = None,
    ):
        super().__init__()
        self._program = Program(node, steps, takes, gives, unpack, first, last, dict(where or {}), forward or Forward())

    @property
    def program(self) -> Program:
        """What this segment runs: its steps, what it takes and what it gives."""
        return self._program

    @property
    def node(self) -> str:
        """The name of the node this segment computes."""
        return self._program.node

    @property
    def takes(self) -> tuple[str, ...]:
        """The names of the values this segment is given (those live across the cut before it)."""
        return self._program.takes

    @property
    def traced_forward(self) -> Forward:
        """The traced model's ``forward`` (its class name, signature and arguments left at defaults)."""
        return self._program.forward

    def check_sample(self, sample: Any) -> None:
        """A TypeError unless ``sample`` fits the traced forward's inputs (this segment's ``takes``, it
        being the ``first``): one tensor for one input, a tuple of one tensor per input for more. The
        message names the forward's inputs, what ``sample`` is, and how to give it."""
        n = len(self.takes)
        fits = isinstance(sample, Tensor) if n == 1 else isinstance(sample, tuple) and len(sample) == n
        if not fits:
            raise TypeError(self._bad_sample(sample))

    def hold(self, name: str, obj: nn.Module | Tensor, *, persistent: bool = True) -> None:
        """Hold ``obj`` (a module, a parameter, or a buffer or other tensor) as ``name`` (a dotted
        path in the model), making empty modules for the path's parts that are not held yet."""
        *path, field = name.split(".")
        owner: nn.Module = self
        for part in path:
            inner = getattr(owner, part, None)
            if not isinstance(inner, nn.Module):
                inner = nn.Module()
                owner.add_module(part, inner)
            owner = inner
        if getattr(owner, field, None) is obj:
            return  # held already, as part of a module this segment holds
        if isinstance(obj, nn.Module):
            owner.add_module(field, obj)
        elif isinstance(obj, nn.Parameter):
            owner.register_parameter(field, obj)
        else:
            owner.register_buffer(field, obj, persistent=persistent)

    def extra_repr(self) -> str:
        return f"node={self.node}, takes={list(self.takes)}"

    def forward(self, value: Any) -> Any:
        program = self._program
        if program.first:
            self.check_sample(value)
        if program.unpack:
            if not isinstance(value, tuple) or len(value) != len(program.takes):
                raise TypeError(self._bad_input(value))
            env = dict(zip(program.takes, value))
        else:
            env = {program.takes[0]: value}
        for step in program.steps:
            try:
                env[step.name] = self._run(step, env)
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"partime: in node {step.name} of the traced model{self._at(step.name)}")
                raise
        gives = program.gives
        out = fill(gives, env)
        if type(gives) is tuple:
            pairs = list(zip(gives, out))
        else:  # one value: at the last segment, the output may be a node's tuple
            pairs = [(gives, out)]
            if program.last and type(out) is tuple and out:
                pairs = [(gives, v) for v in out]
        bad = next(((ref, v) for ref, v in pairs if not isinstance(v, Tensor)), None)
        if bad is not None:
            raise TypeError(self._not_a_tensor(*bad, out))
        return out

    # -- internals ------------------------------------------------------------------------------

    def _run(self, step: Step, env: dict[str, Any]) -> Any:
        op, target = step.op, step.target
        if op == "get_attr":
            return functools.reduce(getattr, target.split("."), self)
        if op == "constant":
            return target
        args, kwargs = fill(step.args, env), fill(step.kwargs, env)
        if op == "call_module":
            return self.get_submodule(target)(*args, **kwargs)
        if op == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)

    def _at(self, name: str) -> str:
        where = self._program.where.get(name)
        return f" ({where})" if where else ""

    def _bad_input(self, value: Any) -> str:
        got = f"a tuple of {len(value)}" if isinstance(value, tuple) else _kind(value)
        return f"node {self.node} takes {len(self.takes)} values ({', '.join(self.takes)}), got {got}"

    def _bad_sample(self, sample: Any) -> str:
        forward, takes = self._program.forward, self.takes
        n, one = len(takes), len(takes) == 1
        names = takes[0] if one else f"{', '.join(takes[:-1])} and {takes[-1]}"
        want = "one tensor" if one else f"a tuple of {n} tensors ({', '.join(takes)}), in this order"
        message = (
            f"the traced {forward.model}.forward{forward.signature} takes {n} input{'' if one else 's'}, {names}: "
            f"give each sample as {want}, got {_kind(sample)}."
        )
        if forward.left:
            left, them = forward.left, "it" if len(forward.left) == 1 else "them"
            every = ", ".join((*takes, *left))
            message += (
                f" {' and '.join(left)} {'is left at its default' if them == 'it' else 'are left at their defaults'} "
                "(the tracer fixes every argument that has one: it is no input of the traced graph): to stream "
                f"{them} too, give {them} no default (forward(self, {every})) and each sample as a tuple ({every})"
            )
        return message

    def _not_a_tensor(self, ref: Ref, value: Any, out: Any) -> str:
        given = value if type(self._program.gives) is tuple else out  # one of several values, or the whole
        what = f"node {ref.name}{self._at(ref.name)} gives {_kind(given)}"
        if self._program.last:
            return (
                f"{what}, and it is the model's output or a part of it: partime streams outputs that are a "
                "tensor or a flat tuple of tensors; return those (compute the rest from them outside the model)"
            )
        return (
            f"{what}, and it is used after node {self.node}, where the model may be cut between stages: only "
            "tensors cross a cut. Compute it where it is used, or keep the code that makes it and the code that "
            "uses it in one module that is not traced into (a leaf: trace the model with a torch.fx.Tracer whose "
            "is_leaf_module says so, and give partime the GraphModule), or wrap the model's parts in an nn.Sequential"
        )


def _kind(value: Any) -> str:
    """What ``value`` is, in words: "a tuple of 2 (Tensor, NoneType)", "an int"."""
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def fill(template: Any, env: dict[str, Any]) -> Any:
    """``template`` with every ``Ref`` replaced by its value in ``env`` (in tuples, lists, dicts, slices)."""
    kind = type(template)
    if kind is Ref:
        return env[template.name]
    if kind is tuple:
        return tuple(fill(a, env) for a in template)
    if kind is list:
        return [fill(a, env) for a in template]
    if kind is dict:
        return {k: fill(v, env) for k, v in template.items()}
    if kind is slice:
        return slice(fill(template.start, env), fill(template.stop, env), fill(template.step, env))
    return template

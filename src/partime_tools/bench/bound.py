"""The bound of a pipeline's cut: the model's own pieces of it, each alone, with plain torch.

A cut of D stages splits the model into D pieces (``pieces``): for an ``nn.Sequential``,
``model[a:b]`` for each stage's children ``(a, b)`` of ``Partition.bounds``; for a traced model
(``--model resnet``), each stage's fused ``GraphModule`` (``traced.fused.Fused.graph_module``), the
Python code fx generates from the model's own graph between the stage's two cuts. A traced
model's ``forward`` cannot be stopped part-way, so that graph module is the nearest to its own
code between two nodes that there is; it holds the model's own modules and runs its nodes' own
ops in order. Run one after another on a frame, the pieces give exactly what the model gives.

``piece_alone`` times one piece alone, on one torch thread, on its own inputs (what the pieces
before it make of the setting's first frames), with nothing of partime around it:

- inference: a forward under ``torch.inference_mode()``;
- learning: one forward with autograd, a backward and a step of the setting's optimizer
  (``Setting.optimizer``). The backward starts from the gradient that the rest of the model and
  the bench's loss give the piece's output on that frame (the last piece computes the loss itself,
  against the frame's target), and reaches the piece's input unless the piece is the first, as
  the model's own backward does.

The bound of a cut is its slowest piece's time per sample: what a pipeline of that cut would take
per sample if running a stage cost no more than the model's own work for it, one forward per
sample. ``bench_contenders.own_tick`` is the same stage as partime's own ``Stage`` runs it.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from partime import Partition
from partime.internals import Fused, as_tensors, layers_of, split, torch_threads

from .contenders import STAGE_INPUTS, Contender, Opened, Setting, Timing, time_calls

Value = Tensor | tuple[Tensor, ...]
"""What crosses a cut: one tensor, or a flat tuple of them (a traced model's values live across it)."""


def pieces(model: nn.Module, partition: Partition) -> list[nn.Module]:
    """``model``'s own pieces of the cut ``partition``, one per stage, in order (see the module):
    they hold ``model``'s own modules, not copies, and composed they compute what ``model`` does."""
    return [
        stage.graph_module if isinstance(stage, Fused) else stage
        for stage in split(layers_of(model), partition.balance)
    ]


def run_pieces(chain: Sequence[nn.Module], value: Value) -> Value:
    """``value`` through each module of ``chain`` in turn."""
    for piece in chain:
        value = piece(value)
    return value


def piece_alone(name: str, partition: Partition, stage: int) -> Contender:
    """The piece of stage ``stage`` of ``partition`` (of a copy of the setting's model), alone with
    plain torch and one thread, on its own inputs: see the module. Its kind is ``bound``."""

    @contextmanager
    def open_(setting: Setting) -> Iterator[Opened]:
        # a copy: learning here trains no other contender's model, and changes no BatchNorm of it
        chain = pieces(copy.deepcopy(setting.layers), partition)
        piece, ys = chain[stage], setting.ys
        count = min(STAGE_INPUTS, len(setting.xs))
        with torch.no_grad():
            inputs = [run_pieces(chain[:stage], x) for x in setting.xs[:count]]
        one = _inferring(piece) if ys is None else _learning(chain, stage, inputs, ys[:count], setting)

        def run() -> Timing:
            with torch_threads(1):
                return time_calls(itertools.islice(itertools.cycle(inputs), setting.results), setting.results, one)

        yield Opened(run)

    return Contender(name, "bound", partition.depth, 1, open_)


Step = Callable[[int, Value], None]
"""The work on the ``i``-th input of a run."""


def _inferring(piece: nn.Module) -> Step:
    """A forward of ``piece`` on each input, under ``torch.inference_mode()``."""

    def infer(i: int, value: Value) -> None:
        with torch.inference_mode():
            piece(value)

    return infer


def _learning(chain: list[nn.Module], stage: int, inputs: list[Value], ys: Tensor, setting: Setting) -> Step:
    """A forward of ``chain[stage]`` on each input, its backward and a step of the setting's
    optimizer; input ``k`` is ``inputs[i % len(inputs)]`` at call ``i``, as the run cycles them."""
    piece, last = chain[stage], stage == len(chain) - 1
    loss_fn = nn.CrossEntropyLoss()
    grads = [] if last else [_output_grads(chain, stage, value, y, loss_fn) for value, y in zip(inputs, ys)]
    params = [p for p in piece.parameters() if p.requires_grad]
    optimizer = setting.optimizer(params) if params else None

    def learn(i: int, value: Value) -> None:
        k = i % len(inputs)
        if optimizer is not None:
            optimizer.zero_grad()
        out = piece(_leaves(value, grad=stage > 0))
        if last:
            loss_fn(out, ys[k]).backward()
        else:
            pairs = [(o, g) for o, g in zip(as_tensors(out, f"piece {stage}'s output"), grads[k]) if o.requires_grad]
            if pairs:  # nothing to learn from in a piece with no parameters before the first that has some
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if optimizer is not None:
            optimizer.step()

    return learn


def _output_grads(
    chain: list[nn.Module], stage: int, value: Value, y: Tensor, loss_fn: nn.Module
) -> tuple[Tensor, ...]:
    """The gradient of the loss on this frame at each tensor of ``chain[stage]``'s output for
    ``value``, through the pieces after it (zeros where the loss does not depend on it)."""
    with torch.no_grad():
        out = chain[stage](value)
    leaves = _leaves(out, grad=True)
    loss = loss_fn(run_pieces(chain[stage + 1 :], leaves), y)
    tensors = as_tensors(leaves, f"piece {stage}'s output")
    wanted = [t for t in tensors if t.requires_grad]
    found = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
    grads = []
    for t in tensors:
        g = next(found) if t.requires_grad else None
        grads.append(torch.zeros_like(t) if g is None else g)
    return tuple(grads)


def _leaves(value: Value, *, grad: bool) -> Value:
    """``value``'s tensors cut from any graph; with ``grad``, its floating-point ones require a gradient."""

    def leaf(t: Tensor) -> Tensor:
        return t.detach().requires_grad_(grad and t.is_floating_point())

    return tuple(leaf(t) for t in value) if isinstance(value, tuple) else leaf(value)

"""Tensors that children of a model share, and the cuts that would separate them.

Two children of an ``nn.Sequential`` may hold the very same parameter or buffer (weight tying,
or one module that appears twice). A cut between them would give two stages each their own
update of one tensor, so no cut may separate them: ``tied_cuts`` says which cut positions are
forbidden and, for each, the ``Tie`` it would break; ``check_ties`` refuses a balance that makes
one of them. Its ValueError names the tensor as each child holds it, the layers and both stages
it would fall into, and a balance that keeps them together (or, for a number of stages, the most
stages that can). In a traced model (``partime.traced.tracing``) the children are the graph's nodes, and
two of them share a tensor where both use one parameter or buffer (a module called twice, tied
weights, a parameter of the model read by two nodes): the message names the tensor as the traced
module does and the nodes that use it. ``held_together`` says, in the same words, why given cut
positions are ruled out (``planner`` warns with it when a tie leaves D stages no cut worth making).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from torch import nn

from ..traced.segment import Segment


@dataclass(frozen=True)
class Tie:
    """A parameter or buffer that two children of a model hold: the very same tensor.

    ``kind`` is "parameter" or "buffer"; ``first < second`` are the two children's indices, and
    ``first_name`` / ``second_name`` the tensor's name in the model as each child holds it, as
    ``model.named_parameters(remove_duplicate=False)`` (or ``named_buffers``) calls it there,
    e.g. "0.weight" and "2.weight". In a traced model (its children are ``Segment`` layers) they
    are the tensor's names in the module that was traced, e.g. "embed.weight", and ``first_node``
    / ``second_node`` name the nodes that use it.
    """

    kind: str
    first: int
    first_name: str
    second: int
    second_name: str
    first_node: str | None = None
    second_node: str | None = None


def tied_cuts(model: nn.Sequential) -> dict[int, Tie]:
    """The cut positions of ``model`` that would separate a tensor that two children share, each
    with a ``Tie`` that the cut would break; positions in increasing order, none if nothing is shared.

    Position k cuts between child k - 1 and child k (1 <= k < len(model)). Parameters and buffers
    are compared by identity, so a child that appears twice shares all of its own (one that holds
    none shares nothing and may be cut). A tensor held by children i < j rules out every position
    from i + 1 to j. Where several ties span a position, its ``Tie`` is the first in the model's
    order; a tensor held by three or more children ties each holder to the next.
    """
    holders: dict[int, list[tuple[int, str, str]]] = {}  # id(tensor) -> (child, name, kind)
    nodes = _nodes(model)
    # _modules rather than named_children(): the latter skips a module that appears twice.
    for k, (key, child) in enumerate(model._modules.items()):
        if child is None:
            continue
        seen: set[int] = set()
        prefix = "" if nodes else key  # a segment holds the tensors under the traced module's names
        named = itertools.chain(
            (("parameter", name, t) for name, t in child.named_parameters(prefix, remove_duplicate=False)),
            (("buffer", name, t) for name, t in child.named_buffers(prefix, remove_duplicate=False)),
        )
        for kind, name, t in named:
            if id(t) not in seen:  # the first name of a tensor a child holds twice
                seen.add(id(t))
                holders.setdefault(id(t), []).append((k, name, kind))
    ties = [
        Tie(kind, i, first_name, j, second_name, *((nodes[i], nodes[j]) if nodes else ()))
        for held in holders.values()
        for (i, first_name, kind), (j, second_name, _) in itertools.pairwise(held)
    ]
    cuts: dict[int, Tie] = {}
    for tie in sorted(ties, key=lambda t: (t.first, t.second)):  # stable: the model's order
        for k in range(tie.first + 1, tie.second + 1):
            cuts.setdefault(k, tie)
    return dict(sorted(cuts.items()))


def check_ties(model: nn.Sequential, balance: int | Sequence[int]) -> None:
    """Raise a ValueError unless ``balance`` keeps every tensor that children of ``model`` share
    in one stage.

    ``balance`` must already be valid for ``model`` otherwise (``partition.check_balance``): a
    number of stages D from 1 to ``len(model)``, or positive ints summing to ``len(model)``. A
    list balance that cuts at a position of ``tied_cuts`` is refused, naming the tensor, both
    stages and the nearest balance that keeps them together; D stages only if no cut into D
    stages avoids those positions, naming the runs of layers that must stay together.
    """
    n = len(model)
    ties = tied_cuts(model)
    nodes = _nodes(model)
    if not isinstance(balance, Sequence):
        if balance > n - len(ties):
            raise ValueError(_too_tied(n, int(balance), ties, nodes))
        return
    layers = [int(b) for b in balance]
    cuts = list(itertools.accumulate(layers[:-1]))
    cut = next((c for c in cuts if c in ties), None)
    if cut is not None:
        raise ValueError(_cuts_a_tie(n, layers, cut, ties, nodes))


def held_together(model: nn.Sequential, cuts: Collection[int]) -> str:
    """Why no cut may fall at ``cuts`` (positions of ``tied_cuts(model)``), in words: each run of
    layers around them that must stay in one stage, and the tensor its children share."""
    return "; ".join(_held(len(model), tied_cuts(model), _nodes(model), cuts))


def _held(n: int, ties: dict[int, Tie], nodes: Sequence[str] | None, cuts: Collection[int]) -> list[str]:
    """For each run of layers around ``cuts`` that must stay in one stage, in order: why, in words."""
    runs = sorted({_block(n, k, ties) for k in cuts})
    return [f"{_layers(a, b, nodes)} must stay in one stage ({_tie_text(ties[a + 1])})" for a, b in runs]


def _nodes(model: nn.Sequential) -> list[str] | None:
    """The node of each child, if ``model`` is a traced model's layers (``partime.traced.tracing``); else None."""
    children = list(model._modules.values())
    if not children or not all(isinstance(child, Segment) for child in children):
        return None
    return [child.node for child in children if isinstance(child, Segment)]


def _balance(cuts: Sequence[int], n: int) -> list[int]:
    """The balance of ``n`` layers cut at ``cuts`` (increasing positions)."""
    return [b - a for a, b in itertools.pairwise((0, *cuts, n))]


def _nearest_cuts(cuts: Sequence[int], allowed: Sequence[int]) -> tuple[int, ...] | None:
    """As many increasing positions out of ``allowed`` as ``cuts`` has, each moved as little from
    its own (least total distance; ties to the earlier positions), or None if there are too few.
    """
    # row[j]: (distance, positions) of the best placement of the cuts so far in allowed[:j].
    Key = tuple[int, tuple[int, ...]]
    row: list[Key | None] = [(0, ())] * (len(allowed) + 1)
    for c in cuts:
        new: list[Key | None] = [None]
        for j, a in enumerate(allowed):
            options = [key for key in (new[j],) if key is not None]
            if (before := row[j]) is not None:
                options.append((before[0] + abs(a - c), (*before[1], a)))
            new.append(min(options) if options else None)
        row = new
    last = row[-1]
    return None if last is None else last[1]


def _tie_text(tie: Tie, stages: Sequence[int] = ()) -> str:
    if tie.first_node is None:
        where = [f" (stage {s})" for s in stages] or ["", ""]
        return (
            f'"{tie.first_name}" of layer {tie.first}{where[0]} is "{tie.second_name}" of layer {tie.second}{where[1]}'
        )
    at = [f", stage {s}" for s in stages] or ["", ""]
    first = f"node {tie.first_node} (layer {tie.first}{at[0]})"
    second = f"node {tie.second_node} (layer {tie.second}{at[1]})"
    if tie.first_name == tie.second_name:  # one module that two nodes call
        return f'"{tie.first_name}" is used by {first} and by {second}'
    return f'"{tie.first_name}" of {first} is "{tie.second_name}" of {second}'


def _layers(start: int, last: int, nodes: Sequence[str] | None) -> str:
    """Layers ``start`` to ``last``, in words; with the nodes they compute, for a traced model."""
    return f"layers {start} to {last}" + ("" if nodes is None else f" (nodes {nodes[start]} to {nodes[last]})")


def _block(n: int, cut: int, ties: Collection[int]) -> tuple[int, int]:
    """The first and last layer of the run around ``cut`` that no allowed position cuts."""
    start = max(k for k in range(cut) if k not in ties)  # 0 is never in ties
    stop = min(k for k in range(cut + 1, n + 1) if k not in ties)  # nor is n
    return start, stop - 1


def _cuts_a_tie(n: int, balance: list[int], cut: int, ties: dict[int, Tie], nodes: Sequence[str] | None) -> str:
    """Why ``balance`` must not cut at ``cut``, and a balance that keeps the tie in one stage."""
    tie = ties[cut]
    cuts = list(itertools.accumulate(balance[:-1]))
    stages = [bisect.bisect_right(cuts, k) for k in (tie.first, tie.second)]
    start, last = _block(n, cut, ties)
    allowed = [k for k in range(1, n) if k not in ties]
    nearest = _nearest_cuts(cuts, allowed)
    if nearest is not None:
        fix = f"balance={_balance(nearest, n)}"
    else:
        fix = (
            f"balance={_balance(allowed, n)} (no cut into {len(balance)} stages keeps the shared "
            f"tensors together: {len(allowed) + 1} stage{'s' if allowed else ''} at most)"
        )
    return (
        f"balance {balance} splits a shared {tie.kind} between stage {stages[0]} and stage "
        f"{stages[1]}: {_tie_text(tie, stages)}, and each stage would update it on its own "
        f"(layers: {n}); put {_layers(start, last, nodes)} in one stage: {fix}, or untie the weights"
    )


def _too_tied(n: int, depth: int, ties: dict[int, Tie], nodes: Sequence[str] | None) -> str:
    """Why no cut of ``n`` layers into ``depth`` stages keeps every tie in one stage."""
    allowed = [k for k in range(1, n) if k not in ties]
    reasons = _held(n, ties, nodes, ties)
    if len(reasons) > 3:
        reasons[3:] = [f"{len(reasons) - 3} more such runs"]
    at_most = len(allowed) + 1
    return (
        f"cannot cut {n} layers into {depth} stages without splitting a shared parameter or "
        f"buffer (balance: {depth}, layers: {n}): {'; '.join(reasons)}, so {at_most} "
        f"stage{'s' if at_most != 1 else ''} at most: balance={_balance(allowed, n)}, "
        f"or untie the weights"
    )

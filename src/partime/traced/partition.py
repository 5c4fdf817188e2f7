"""What a cut of a traced model holds: its nodes, and what crosses each boundary.

``TracedPartition`` is the ``Partition`` of a traced model (``partime.traced.tracing``), with the names of
the nodes each stage computes and, for each boundary between stages, the values that cross it (by
the names of the nodes that compute them, or of the model's inputs) with their shapes and bytes
once a sample has shown them. ``describe`` makes one from a ``Partition`` and the model's layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ..core.boundary_values import ValueSpec
from ..planning.partition import Partition
from .segment import Segment

SHOWN = 6
"""How many of a stage's nodes ``summary`` names before it elides the middle ones."""


@dataclass(frozen=True)
class Boundary:
    """What crosses from stage ``stage`` to the next: ``values`` (node names), their layout if known."""

    stage: int
    values: tuple[str, ...]
    spec: ValueSpec | None

    @property
    def nbytes(self) -> int | None:
        """Bytes of one sample's values at this boundary (None until a sample has shown them)."""
        return None if self.spec is None else self.spec.nbytes

    def __str__(self) -> str:
        if self.spec is None:
            return f"stage {self.stage} -> {self.stage + 1}: {', '.join(self.values)}"
        tensors = ", ".join(f"{v} {t}" for v, t in zip(self.values, self.spec.tensors, strict=True))
        plural = "s" if len(self.values) != 1 else ""
        return (
            f"stage {self.stage} -> {self.stage + 1}: {len(self.values)} tensor{plural}, {self.nbytes} bytes: {tensors}"
        )


@dataclass(frozen=True)
class TracedPartition(Partition):
    """A ``Partition`` of a traced model: ``nodes[k]`` is the node layer k computes, ``crossing[k - 1]``
    the values that cross cut position k (1 to ``len(nodes) - 1``), and ``outgoing[i]`` the layout
    of what crosses from stage i to i + 1 where a sample has shown it (else None)."""

    nodes: tuple[str, ...] = ()
    crossing: tuple[tuple[str, ...], ...] = ()
    outgoing: tuple[ValueSpec | None, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        n = sum(self.balance)
        if len(self.nodes) != n or len(self.crossing) != n - 1 or len(self.outgoing) != self.depth - 1:
            raise ValueError(
                f"a traced partition of {n} layers in {self.depth} stages needs {n} nodes, {n - 1} crossings and "
                f"{self.depth - 1} outgoing layouts, got {len(self.nodes)}, {len(self.crossing)}, {len(self.outgoing)}"
            )

    @property
    def stage_nodes(self) -> tuple[tuple[str, ...], ...]:
        """The names of the nodes each stage computes, in order."""
        return tuple(self.nodes[a:b] for a, b in self.bounds)

    @property
    def boundaries(self) -> tuple[Boundary, ...]:
        """What crosses each boundary between stages, from stage 0's outgoing one on."""
        return tuple(
            Boundary(i, self.crossing[stop - 1], spec)
            for i, ((_, stop), spec) in enumerate(zip(self.bounds[:-1], self.outgoing, strict=True))
        )

    def summary(self) -> str:
        """``Partition.summary``, then the nodes of each stage and what crosses each boundary."""
        lines = [super().summary()]
        for i, nodes in enumerate(self.stage_nodes):
            names = list(nodes) if len(nodes) <= SHOWN else [*nodes[: SHOWN - 2], "...", *nodes[-2:]]
            plural = "s" if len(nodes) != 1 else ""
            lines.append(f"  stage {i} holds {len(nodes)} node{plural}: {', '.join(names)}")
        lines += [f"  {boundary}" for boundary in self.boundaries]
        return "\n".join(lines)


def describe(partition: Partition, layers: nn.Sequential, specs: Sequence[ValueSpec | None] | None) -> Partition:
    """``partition`` of ``layers`` as a ``TracedPartition`` if they are a traced model's segments
    (``partition`` itself otherwise); ``specs[k - 1]``, where given, is the layout of what crosses
    cut position k."""
    segments = list(layers._modules.values())
    if not segments or not all(isinstance(s, Segment) for s in segments):
        return partition
    cuts = [stop for _, stop in partition.bounds[:-1]]
    known = list(specs) if specs is not None else [None] * (len(segments) - 1)
    return TracedPartition(
        **{f.name: getattr(partition, f.name) for f in dataclasses.fields(Partition)},
        nodes=tuple(s.node for s in segments if isinstance(s, Segment)),
        crossing=tuple(tuple(s.takes) for s in segments[1:] if isinstance(s, Segment)),
        outgoing=tuple(known[k - 1] for k in cuts),
    )

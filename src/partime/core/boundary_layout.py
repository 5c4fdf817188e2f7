"""What crosses every boundary of a pipeline: its ``Layout``, learnt from the first sample."""

from __future__ import annotations

from dataclasses import dataclass

from .boundary_values import ValueSpec


@dataclass(frozen=True)
class Layout:
    """The layout of every boundary, learnt from the first sample (and its target)."""

    input: ValueSpec
    activations: tuple[ValueSpec, ...]  # the output of stage i, for i < D - 1
    output: ValueSpec
    target: ValueSpec | None

    def into(self, stage: int) -> ValueSpec:
        """The layout of what stage ``stage`` takes in: the sample, or the previous stage's output."""
        return self.input if stage == 0 else self.activations[stage - 1]

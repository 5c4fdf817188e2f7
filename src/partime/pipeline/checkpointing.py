"""A pipeline's checkpoints: ``state_dict``, ``load_state_dict``, ``save``, ``load`` (internal module).

``Checkpointing`` is the part of ``Pipeline`` that takes and loads checkpoints on rank 0; what a
checkpoint holds and how it is checked is ``partime.checkpoint.files``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from ..checkpoint import files as checkpoint
from ..checkpoint.files import CheckpointError
from ..core.boundary_values import copy_tensors
from ..executors.distributed.on_rank_0 import on_rank_0
from ..planning.partition import Partition, split
from .running import Running


class Checkpointing(Running):
    """The checkpoints of a running pipeline (see ``partime.checkpoint.files``)."""

    @on_rank_0()
    def state_dict(self) -> dict[str, Any] | None:
        """The whole state of the pipeline between two ticks, as tensors and plain values.

        It holds the weights, the optimizer states, the counters and everything in flight: the
        forwards the stages keep for a late gradient, the activations and gradients on their way
        to the next tick, the targets not used yet and the results that left the pipeline but were
        not handed out. Loaded (``load_state_dict``) into a pipeline made with the same settings,
        also in another process or with another executor, it goes on exactly as this one would.

        Take it after ``step()`` or ``flush()``, or inside a ``stream()`` loop: there the pipeline
        has fed one sample more than ``step()`` would have, and the result it has not handed out yet
        is in the checkpoint and comes out first after loading; resume that stream from sample
        ``fed``. Random layers (dropout) draw from their process's generator, which is not in it.
        """
        return self._checkpoint()

    @on_rank_0()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (made by ``state_dict``) exactly as the pipeline it came from would.

        This pipeline must have the same depth, cut, grad mode, compensation, loss kind and sample
        layout (a ``CheckpointError`` names what differs, with both values) and a model of the same
        architecture, whose weights are replaced. It may be new or open; if its stages are running
        they stop, and stages start from ``state`` at the next sample or ``flush()``. A ``state``
        whose parts contradict each other (``check_contents``), or whose identity or cut does not
        fit this pipeline, raises a ``CheckpointError`` before anything of this pipeline changes.
        """
        self._check_checkpoints()
        expected = self._identity()
        if isinstance(self._balance, int):
            expected["balance"] = None  # cut where the checkpoint was cut
        checkpoint.check_state(state, expected)
        balance = state["identity"]["balance"]
        try:  # the model's own children, cut where the checkpoint was cut
            modules = split(self._model, balance)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint's cut does not fit this model: {exc}") from exc
        state = copy_tensors(dict(state))
        if self._executor is not None:
            self._executor.close()
            self._executor = None
            self._state.layout = None
        if self._partition is None or list(self._partition.balance) != balance:
            self._partition = Partition(tuple(balance))
        checkpoint.load_weights(modules, state)
        self._state = checkpoint.from_checkpoint(state)

    @on_rank_0()
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``state_dict()`` to ``path``, atomically: a crash leaves the previous file whole."""
        checkpoint.save(self._checkpoint(), path)

    @on_rank_0()
    def load(self, path: str | os.PathLike[str]) -> None:
        """``load_state_dict`` of the checkpoint in ``path``, read by ``checkpoint.load``: a
        ``CheckpointError`` names the file (a missing one raises ``FileNotFoundError``)."""
        state = checkpoint.load(path)
        try:
            self.load_state_dict(state)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc.__cause__

    # -- internals ------------------------------------------------------------------------------

    def _check_checkpoints(self) -> None:
        if not self._executor_class.checkpoints:
            raise NotImplementedError(
                f"the {self._executor_class.__name__} cannot take or load checkpoints; "
                "the inline, process and distributed executors can"
            )
        if self._failure is not None or self._status == "closed":
            self._check_open()

    def _identity(self) -> dict[str, Any]:
        return checkpoint.identity_of(
            self._state, self._config, None if self._partition is None else self._partition.balance
        )

    def _checkpoint(self) -> dict[str, Any]:
        """``state_dict()`` on rank 0."""
        self._check_checkpoints()
        if self._state.resume is not None:  # loaded and not started yet: that is the state
            resume: dict[str, Any] = copy_tensors(self._state.resume)
            return resume
        if self._executor is None:
            if self._partition is None:
                raise CheckpointError(
                    "no checkpoint before the cut is known: with balance=D the layers are timed on the "
                    "first sample; pass balance=[...] or sample=, or take it after the first step"
                )
            executor_state = checkpoint.unstarted(
                split(copy.deepcopy(self._model), self._partition.balance), self._config
            )
        else:
            self._guard(self._executor.sync)
            while len(self._state.held) < self._due():  # out of the pipeline, not handed out yet
                self._state.held.append(self._guard(self._executor.next_result))
            executor_state = self._guard(self._executor.state_dict)
        return checkpoint.to_checkpoint(self._state, self._identity(), executor_state)

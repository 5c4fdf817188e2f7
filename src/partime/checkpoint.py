"""Checkpoints: a pipeline's whole state as plain values, and files that are replaced atomically.

``Checkpoints`` gives ``Pipeline`` its ``state_dict``, ``load_state_dict``, ``save`` and ``load``;
the executors contribute their stages' states and the values in transit (``executors/base.py``).

A checkpoint is taken between two ticks. It holds everything that decides the ticks to come, so
that a run stopped at tick k and resumed (also in a fresh process, also on another executor)
gives exactly the results of a run that never stopped::

    {"format": "partime-checkpoint", "version": 1,
     "identity": {depth, balance, grad_mode, compensation, learning, supervised, input, target},
     "counters": {next_index, in_segment, taken},
     "layout": {input, activations, output, target} or None before the first sample,
     "held": [results that left the pipeline and were not handed out yet],
     "stages": [Stage.state_dict() of each stage: weights, optimizer, stashed forwards, ...],
     "transit": {tick, acts, grads, targets} or None: the values sent during the last tick,
                which their receivers take at the next one}

Everything in it is a tensor, a number, a string, a bool, None, or a list or dict of those, so
``torch.load(weights_only=True)`` reads it without running any code.

Under the distributed executor rank 0 holds the checkpoint (it gathers every rank's part) and
gives each rank its part when it resumes; on the other ranks ``state_dict`` is None and ``save``,
``load`` and ``load_state_dict`` do nothing, so that every rank may run the same script.
"""

from __future__ import annotations

import copy
import io
import os
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .executors.base import Layout, Result
from .partition import Partition, split
from .stage import Stage
from .values import TensorSpec, ValueSpec, as_tensors, copy_tensors, rebuild

FORMAT = "partime-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that does not fit the pipeline it is loaded into (or is no checkpoint)."""


def spec_to_plain(spec: ValueSpec | None) -> dict[str, Any] | None:
    """A layout as plain values: ``{"tensors": [[shape, dtype name], ...], "is_tuple": bool}``."""
    if spec is None:
        return None
    tensors = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in spec.tensors]
    return {"tensors": tensors, "is_tuple": spec.is_tuple}


def spec_from_plain(plain: dict[str, Any] | None) -> ValueSpec | None:
    """The layout that ``spec_to_plain`` wrote."""
    if plain is None:
        return None
    tensors = tuple(TensorSpec(tuple(shape), getattr(torch, dtype)) for shape, dtype in plain["tensors"])
    return ValueSpec(tensors, bool(plain["is_tuple"]))


def message(sample: int, tensors: tuple[Tensor, ...] | list[Tensor] | None) -> dict[str, Any]:
    """A value in transit (an activation, a gradient, a target) for sample ``sample``, copied;
    ``tensors`` None for a SKIP (a hole going forward, a gradient that will not come back)."""
    return {"sample": int(sample), "tensors": None if tensors is None else [t.detach().clone() for t in tensors]}


def to_bytes(value: Any) -> bytes:
    """``value`` (a checkpoint or a part of one) as the bytes of ``torch.save``, to send to another process."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    """What ``to_bytes`` wrote, read with ``weights_only=True`` (tensors on the CPU)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def check_state(state: Any, expected: Mapping[str, Any]) -> None:
    """Raise a ``CheckpointError`` unless ``state`` is a checkpoint of a pipeline like ``expected``.

    ``expected`` is the loading pipeline's identity; a value of None there (not known yet, such
    as the layout of a pipeline that has seen no sample) matches anything.
    """
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise CheckpointError(f"not a partime checkpoint (no 'format': {FORMAT!r} in it)")
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint format version {state.get('version')!r} cannot be read by this partime, "
            f"which reads version {VERSION}"
        )
    saved = state["identity"]
    for key, want in expected.items():
        got = saved.get(key)
        if want is not None and got != want:
            raise CheckpointError(
                f"the checkpoint is of another pipeline: its {key} is {got!r}, this pipeline's is {want!r}"
            )


def save(state: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``state`` to ``path`` atomically: after a crash at any point, ``path`` holds either
    the previous file or the new one, whole.

    The file is written as ``<path>.tmp`` beside it, flushed to disk, renamed over ``path`` and
    the directory synced. A save that is killed leaves ``<path>.tmp`` behind; the next save to
    the same path overwrites and renames it, and ``load`` never reads it. Two processes must not
    save to one path at once.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_directory(path.parent)


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint in ``path``, read with ``weights_only=True`` (tensors on the CPU)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the system can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows: renames there are durable without it
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def layout_to_plain(layout: Layout) -> dict[str, Any]:
    """Every boundary's layout as plain values."""
    plain = spec_to_plain
    return {"input": plain(layout.input), "activations": [plain(a) for a in layout.activations],
            "output": plain(layout.output), "target": plain(layout.target)}


def layout_from_plain(plain: dict[str, Any]) -> Layout:
    """The layout that ``layout_to_plain`` wrote."""
    spec = spec_from_plain
    return Layout(spec(plain["input"]), tuple(spec(a) for a in plain["activations"]), spec(plain["output"]),
                  spec(plain["target"]))


class Checkpoints:
    """What ``Pipeline`` does with checkpoints: ``state_dict``, ``load_state_dict``, ``save`` and
    ``load``. A mixin of ``Pipeline`` only: it reads and sets the pipeline's own counters."""

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
        self._check_checkpoints()
        if self._rank > 0:
            return None
        if self._failure is not None or self._state == "closed":
            self._check_open()
        if self._resume is not None:  # loaded and not started yet: that is the state
            return copy_tensors(self._resume)
        layout = None
        if self._executor is None:
            if self._partition is None:
                raise CheckpointError(
                    "no checkpoint before the cut is known: with balance=D the layers are timed on the "
                    "first sample; pass balance=[...] or sample=, or take it after the first step"
                )
            modules = split(copy.deepcopy(self._model), self._partition.balance)
            executor = {"stages": [Stage(i, m, self._config).state_dict() for i, m in enumerate(modules)],
                        "transit": None}
        else:
            self._guard(self._executor.sync)
            while len(self._held) < self._due():  # out of the pipeline, not handed out yet
                self._held.append(self._guard(self._executor.next_result))
            executor = self._guard(self._executor.state_dict)
            layout = layout_to_plain(self._executor_layout)
        held = [{"index": r.index, "loss": r.loss, "skipped": r.skipped,
                 "output": None if r.output is None else [t.detach().clone() for t in as_tensors(r.output, "output")]}
                for r in self._held]
        return {
            "format": FORMAT, "version": VERSION, "identity": self._identity(),
            "counters": {"next_index": self._next_index, "in_segment": self._in_segment, "taken": self._taken},
            "layout": layout, "held": held, **executor,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from ``state`` (made by ``state_dict``) exactly as the pipeline it came from would.

        This pipeline must have the same depth, cut, grad mode, compensation, loss kind and sample
        layout (a ``CheckpointError`` names what differs, with both values) and a model of the same
        architecture, whose weights are replaced. It may be new or open; if its stages are running
        they stop, and stages start from ``state`` at the next sample or ``flush()``.
        """
        self._check_checkpoints()
        if self._rank > 0:
            return
        if self._failure is not None or self._state == "closed":
            self._check_open()
        expected = self._identity()
        if isinstance(self._balance, int):
            expected["balance"] = None  # cut where the checkpoint was cut
        check_state(state, expected)
        state = copy_tensors(dict(state))
        identity = state["identity"]
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        if self._partition is None or list(self._partition.balance) != identity["balance"]:
            self._partition = Partition(tuple(identity["balance"]))
        for i, (module, stage) in enumerate(zip(split(self._model, self._partition.balance), state["stages"])):
            try:
                module.load_state_dict(stage["module"])
            except RuntimeError as exc:
                raise CheckpointError(f"the weights of stage {i} do not fit this model: {exc}") from exc
        self._supervised = identity["supervised"]
        self._x_spec = spec_from_plain(identity["input"])
        self._y_spec = spec_from_plain(identity["target"])
        counters = state["counters"]
        self._next_index, self._in_segment, self._taken = (
            counters["next_index"], counters["in_segment"], counters["taken"])
        self._held = deque()
        if state["layout"] is not None:
            output = spec_from_plain(state["layout"]["output"])
            self._held.extend(Result(h["index"], None if h["output"] is None else rebuild(output, tuple(h["output"])),
                                     h["loss"], skipped=h["skipped"]) for h in state["held"])
        self._resume = state if state["layout"] is not None else None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``state_dict()`` to ``path``, atomically: a crash leaves the previous file whole."""
        if self._rank == 0:
            save(self.state_dict(), path)

    def load(self, path: str | os.PathLike[str]) -> None:
        """``load_state_dict`` of the checkpoint in ``path``, read with ``torch.load(weights_only=True)``."""
        if self._rank == 0:
            self.load_state_dict(load(path))

    # -- internals ------------------------------------------------------------------------------

    def _check_checkpoints(self) -> None:
        if not self._executor_class.checkpoints:
            raise NotImplementedError(
                f"the {self._executor_class.__name__} cannot take or load checkpoints; "
                "the inline, process and distributed executors can"
            )

    def _identity(self) -> dict[str, Any]:
        """What a checkpoint must agree on with the pipeline it is loaded into."""
        return {
            "depth": self.depth,
            "balance": None if self._partition is None else list(self._partition.balance),
            "learning": self.learning,
            "supervised": self._supervised,
            "grad_mode": self._config.grad_mode,
            "compensation": list(self._config.compensation),
            "input": spec_to_plain(self._x_spec),
            "target": spec_to_plain(self._y_spec),
        }

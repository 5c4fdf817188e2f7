"""Checkpoints: a pipeline's whole state as plain values, and files that are replaced atomically
(internal module; ``Pipeline.state_dict``, ``load_state_dict``, ``save`` and ``load`` use it).

A checkpoint is taken between two ticks. It holds everything that decides the ticks to come, so
that a run stopped at tick k and resumed (also in a fresh process, also on another executor)
gives exactly the results of a run that never stopped::

    {"format": "partime-checkpoint", "version": 1,
     "identity": {depth, balance, grad_mode, compensation, learning, supervised, input, target},
     "counters": {next_index, in_segment, taken},
     "held": [results that left the pipeline and were not handed out yet],
     "stages": [Stage.state_dict() of each stage: weights, optimizer, stashed forwards, ...],
     "transit": {tick, acts, grads, targets} or None: the values sent during the last tick,
                which their receivers take at the next one}

Everything in it is a tensor, a number, a string, a bool, None, or a list or dict of those, so
``torch.load(weights_only=True)`` reads it without running any code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .values import TensorSpec, ValueSpec

FORMAT = "partime-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that does not fit the pipeline it is loaded into (or is no checkpoint)."""


def copy_tensors(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists and tuples) replaced by a detached copy."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: copy_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copy_tensors(v) for v in value)
    return value


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


def message(sample: int, tensors: tuple[Tensor, ...] | list[Tensor]) -> dict[str, Any]:
    """A value in transit (an activation, a gradient, a target) for sample ``sample``, copied."""
    return {"sample": int(sample), "tensors": [t.detach().clone() for t in tensors]}


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

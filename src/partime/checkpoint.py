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
     "given": [the targets of the samples fed and not handed out, for their results]
              (optional: a checkpoint without it gives those results no target),
     "stages": [Stage.state_dict() of each stage: weights, optimizer, stashed forwards, ...],
     "transit": {tick, acts, grads, targets} or None: the values sent during the last tick,
                which their receivers take at the next one}

Everything in it is a tensor, a number, a string, a bool, None, or a list or dict of those, so
``torch.load(weights_only=True)`` reads it without running any code. ``load`` and
``load_state_dict`` refuse one whose parts contradict each other (``check_contents``) with a
``CheckpointError``, before anything of the pipeline changes: a damaged file never reaches the stages.

Under the distributed executor rank 0 holds the checkpoint (it gathers every rank's part) and
gives each rank its part when it resumes; on the other ranks ``state_dict`` is None and ``save``,
``load`` and ``load_state_dict`` do nothing, so that every rank may run the same script.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
from collections import deque
from collections.abc import Callable, Mapping
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
    """A checkpoint that does not fit the pipeline it is loaded into, is damaged, or is no checkpoint."""


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
    """Raise a ``CheckpointError`` unless ``state`` is a whole checkpoint (``check_contents``) of
    a pipeline like ``expected``.

    ``expected`` is the loading pipeline's identity; a value of None there (not known yet, such
    as the layout of a pipeline that has seen no sample) matches anything.
    """
    check_contents(state)
    saved = state["identity"]
    for key, want in expected.items():
        if key not in saved:
            raise CheckpointError(f"damaged checkpoint: it has no identity.{key}")
        got = saved[key]
        if want is not None and got != want:
            raise CheckpointError(
                f"the checkpoint is of another pipeline: its {key} is {got!r}, this pipeline's is {want!r}"
            )


def check_contents(state: Any) -> None:
    """Raise a ``CheckpointError`` unless ``state`` is a partime checkpoint whose parts agree.

    Every part is there with its type; the counters are whole numbers with
    ``taken <= in_segment <= next_index``; a checkpoint with no layout (taken before the first
    sample) has nothing in flight; ``held`` holds exactly the results that left the pipeline and
    were not handed out (``max(0, in_segment - (depth - 1)) - taken``), in increasing sample
    order; there is one stage state per stage; and values are in transit (``transit["tick"] ==
    in_segment``, one activation and one gradient slot per stage) exactly when a segment has
    begun. Sample indices need not be consecutive. The message names the part
    (``counters.taken``) and the values involved.
    """
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise CheckpointError(f"not a partime checkpoint (no 'format': {FORMAT!r} in it)")
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint format version {state.get('version')!r} cannot be read by this partime, "
            f"which reads version {VERSION}"
        )
    identity = _part(state, "identity", _is_mapping, "a dict")
    depth = _part(identity, "identity.depth", _is_positive, "a whole number >= 1")
    balance = _part(identity, "identity.balance", _is_list, "a list of layers per stage")
    if len(balance) != depth or not all(_is_positive(b) for b in balance):
        raise CheckpointError(f"damaged checkpoint: its identity.balance {balance!r} is not {depth} "
                              f"positive whole numbers (identity.depth is {depth})")
    for key in ("input", "target"):
        _check_spec(identity.get(key), f"identity.{key}", optional=True)

    counters = _part(state, "counters", _is_mapping, "a dict")
    next_index, in_segment, taken = (_part(counters, f"counters.{key}", _is_count, "a whole number >= 0")
                                     for key in ("next_index", "in_segment", "taken"))
    if in_segment > next_index:
        raise CheckpointError(f"damaged checkpoint: counters.in_segment ({in_segment}) is more than "
                              f"counters.next_index ({next_index}), the samples fed in all")
    if taken > in_segment:
        raise CheckpointError(f"damaged checkpoint: counters.taken ({taken}) is more than "
                              f"counters.in_segment ({in_segment}), the samples fed in this segment")

    layout = _part(state, "layout", lambda v: v is None or _is_mapping(v), "None or a dict")
    if layout is None:
        if in_segment:
            raise CheckpointError(f"damaged checkpoint: its layout is None, as before the first sample, "
                                  f"but counters.in_segment is {in_segment}")
    else:
        for key in ("input", "output", "target"):
            _check_spec(_part(layout, f"layout.{key}", lambda v: True, ""), f"layout.{key}", optional=key == "target")
        activations = _part(layout, "layout.activations", _is_list, "a list")
        if len(activations) != depth - 1:
            raise CheckpointError(f"damaged checkpoint: len(layout.activations) is {len(activations)}, "
                                  f"not depth - 1 = {depth - 1}")
        for i, spec in enumerate(activations):
            _check_spec(spec, f"layout.activations[{i}]", optional=False)

    held = _part(state, "held", _is_list, "a list")
    due = max(0, in_segment - (depth - 1)) - taken
    if due < 0:
        raise CheckpointError(
            f"damaged checkpoint: counters.taken ({taken}) is more than the results that left the pipeline "
            f"in this segment: max(0, in_segment {in_segment} - (depth {depth} - 1)) = {taken + due}")
    if len(held) != due:
        raise CheckpointError(
            f"damaged checkpoint: len(held) is {len(held)}, but the counters say {due} results left the "
            f"pipeline and were not handed out: max(0, in_segment {in_segment} - (depth {depth} - 1)) "
            f"- taken {taken} = {due}")
    previous = -1
    for k, result in enumerate(held):
        name = f"held[{k}]"
        _part(held, name, _is_mapping, "a dict", k)
        index = _part(result, f"{name}.index", _is_count, "a whole number >= 0")
        if not previous < index < next_index:
            raise CheckpointError(f"damaged checkpoint: {name}.index is {index}: held results must come in "
                                  f"increasing sample order (the one before is {previous}) and before "
                                  f"counters.next_index ({next_index})")
        previous = index
        _part(result, f"{name}.skipped", lambda v: isinstance(v, bool), "a bool")
        _part(result, f"{name}.loss", lambda v: v is None or _is_real(v), "None or a number")
        _part(result, f"{name}.output", _is_tensors, "None or a list of tensors")

    stages = _part(state, "stages", _is_list, "a list")
    if len(stages) != depth:
        raise CheckpointError(f"damaged checkpoint: len(stages) is {len(stages)}, "
                              f"but identity.depth is {depth}")
    for i, stage in enumerate(stages):
        _part(stages, f"stages[{i}]", _is_mapping, "a dict", i)
        _part(stage, f"stages[{i}].module", _is_mapping, "a dict of weights")

    transit = _part(state, "transit", lambda v: v is None or _is_mapping(v), "None or a dict")
    if (transit is None) != (in_segment == 0):
        what = "nothing is" if transit is None else "values are"
        raise CheckpointError(f"damaged checkpoint: {what} in transit, but counters.in_segment is {in_segment}: "
                              "values are in transit exactly when a segment has begun")
    if transit is not None:
        tick = _part(transit, "transit.tick", _is_count, "a whole number >= 0")
        if tick != in_segment:
            raise CheckpointError(f"damaged checkpoint: transit.tick is {tick}, but counters.in_segment is "
                                  f"{in_segment}: a segment runs one tick per sample fed")
        for key in ("acts", "grads"):
            sent = _part(transit, f"transit.{key}", _is_list, "a list")
            if len(sent) != depth:
                raise CheckpointError(f"damaged checkpoint: len(transit.{key}) is {len(sent)}, "
                                      f"not one per stage ({depth})")
            for i, value in enumerate(sent):
                if value is not None:
                    _check_message(value, f"transit.{key}[{i}]", next_index)
        for i, value in enumerate(_part(transit, "transit.targets", _is_list, "a list")):
            _check_message(value, f"transit.targets[{i}]", next_index, tensors=True)
    for i, value in enumerate(_part(state, "given", _is_list, "a list") if "given" in state else ()):
        _check_message(value, f"given[{i}]", next_index, tensors=True)


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
    """The checkpoint in ``path``, read with ``weights_only=True`` (tensors on the CPU) and
    checked (``check_contents``).

    A file that is no whole checkpoint (empty, cut short, not written by ``torch.save``, holding
    anything but tensors and plain values, another object, or parts that contradict each other)
    raises a ``CheckpointError`` that names the file and what is wrong, with torch's error, if
    any, as its ``__cause__``. A path where there is no file raises ``FileNotFoundError``.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, MemoryError):  # the path's or the machine's trouble, not the file's
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable partime checkpoint ({_reason(exc)})") from exc
    try:
        check_contents(state)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc.__cause__
    return state


def _reason(exc: Exception) -> str:
    """What ``torch.load``'s error says is wrong with a file, on one line."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if isinstance(exc, EOFError):
        return f"EOFError: the file is empty or ends early {text}".strip()
    if isinstance(exc, pickle.UnpicklingError) and text.startswith("Weights only load failed"):
        # torch's reason, without its advice to load with weights_only=False: a partime checkpoint
        # never needs that, and a file that does is not one.
        detail = text.split("WeightsUnpickler error:", 1)[-1]
        if detail == text:
            detail = text.split(" trusted source. ", 1)[-1]
        for advice in ("Please use `torch.serialization", "Check the documentation", "Please file an issue"):
            detail = detail.split(advice, 1)[0]
        return (f"UnpicklingError: torch.load(weights_only=True) refused it: {detail.strip() or text}; "
                "every partime checkpoint loads with weights_only=True")
    return f"{type(exc).__name__}: {text}"


def _part(container: Any, name: str, test: Callable[[Any], bool], what: str, key: Any = None) -> Any:
    """``container[key]`` (by default the last part of ``name``), if ``test`` passes; else a
    ``CheckpointError`` that names the part and says that it should be ``what``."""
    key = name.rsplit(".", 1)[-1] if key is None else key
    if isinstance(container, Mapping) and key not in container:
        raise CheckpointError(f"damaged checkpoint: it has no {name}")
    value = container[key]
    if not test(value):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise CheckpointError(f"damaged checkpoint: its {name} is {shown} ({type(value).__name__}), not {what}")
    return value


def _check_spec(plain: Any, name: str, optional: bool) -> None:
    """Raise a ``CheckpointError`` naming ``name`` unless ``plain`` is what ``spec_to_plain`` writes."""
    if plain is None and optional:
        return
    tensors = plain.get("tensors") if isinstance(plain, Mapping) else None
    if (not _is_list(tensors) or not tensors or not isinstance(plain.get("is_tuple"), bool)
            or (not plain["is_tuple"] and len(tensors) != 1)
            or not all(_is_list(t) and len(t) == 2 and _is_list(t[0]) and all(_is_count(d) for d in t[0])
                       and isinstance(t[1], str) and isinstance(getattr(torch, t[1], None), torch.dtype)
                       for t in tensors)):
        shown = repr(plain)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointError(f"damaged checkpoint: its {name} is {shown}, not a layout "
                              "({'tensors': [[shape, dtype name], ...], 'is_tuple': bool})")


def _check_message(value: Any, name: str, next_index: int, tensors: bool = False) -> None:
    """Raise a ``CheckpointError`` naming ``name`` unless ``value`` is what ``message`` writes for a
    sample fed before ``next_index`` (with tensors, if ``tensors``)."""
    _part({name: value}, name, _is_mapping, "a dict", name)
    sample = _part(value, f"{name}.sample", _is_count, "a whole number >= 0")
    if sample >= next_index:
        raise CheckpointError(f"damaged checkpoint: {name}.sample is {sample}, "
                              f"but only samples before counters.next_index ({next_index}) were fed")
    if tensors:
        _part(value, f"{name}.tensors", lambda v: v is not None and _is_tensors(v), "a list of tensors")
    else:
        _part(value, f"{name}.tensors", _is_tensors, "None or a list of tensors")


def _is_mapping(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_positive(value: Any) -> bool:
    return _is_count(value) and value >= 1


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_tensors(value: Any) -> bool:
    """None (a hole: a skipped sample) or the tensors of one value."""
    return value is None or (_is_list(value) and len(value) > 0 and all(isinstance(t, Tensor) for t in value))


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
            "layout": layout, "held": held, "given": [message(index, as_tensors(y, "target")) for index, y in self._given],
            **executor,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from ``state`` (made by ``state_dict``) exactly as the pipeline it came from would.

        This pipeline must have the same depth, cut, grad mode, compensation, loss kind and sample
        layout (a ``CheckpointError`` names what differs, with both values) and a model of the same
        architecture, whose weights are replaced. It may be new or open; if its stages are running
        they stop, and stages start from ``state`` at the next sample or ``flush()``. A ``state``
        whose parts contradict each other (``check_contents``), or whose identity or cut does not
        fit this pipeline, raises a ``CheckpointError`` before anything of this pipeline changes.
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
        try:  # the model's own children, cut where the checkpoint was cut
            modules = split(self._model, state["identity"]["balance"])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint's cut does not fit this model: {exc}") from exc
        state = copy_tensors(dict(state))
        identity = state["identity"]
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        if self._partition is None or list(self._partition.balance) != identity["balance"]:
            self._partition = Partition(tuple(identity["balance"]))
        for i, (module, stage) in enumerate(zip(modules, state["stages"])):
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
        self._given = deque((g["sample"], rebuild(self._y_spec, tuple(g["tensors"]))) for g in state.get("given", ()))
        self._resume = state if state["layout"] is not None else None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``state_dict()`` to ``path``, atomically: a crash leaves the previous file whole."""
        if self._rank == 0:
            save(self.state_dict(), path)

    def load(self, path: str | os.PathLike[str]) -> None:
        """``load_state_dict`` of the checkpoint in ``path``, read by ``load``: a ``CheckpointError``
        names the file (a missing one raises ``FileNotFoundError``)."""
        if self._rank == 0:
            state = load(path)
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

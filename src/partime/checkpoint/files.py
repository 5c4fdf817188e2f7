"""Checkpoints: a pipeline's whole state as plain values, and files that are replaced atomically.

``to_checkpoint`` writes a pipeline's ``PipelineState`` (``partime.pipeline.state``) with the executor's
part, its stages' states and the values in transit (``executors/base.py``); ``from_checkpoint``
reads it back. ``Pipeline.state_dict``, ``load_state_dict``, ``save`` and ``load`` call them.

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
     "dropped": [the indices of the samples dropped (when_behind="drop") whose results were not
                handed out yet] (optional),
     "stages": [Stage.state_dict() of each stage: weights, optimizer, stashed forwards, ...],
     "transit": {tick, acts, grads, targets} or None: the values sent during the last tick,
                which their receivers take at the next one}

Everything in it is a tensor, a number, a string, a bool, None, or a list or dict of those, so
``torch.load(weights_only=True)`` reads it without running any code. ``load`` and
``load_state_dict`` refuse one whose parts contradict each other (``check_contents``, in ``checkpoint.format``), or
whose stages do not load into this pipeline's (``check_fits``), with a ``CheckpointError``, before anything of
the pipeline changes: a damaged file never reaches the stages.

Under the distributed executor rank 0 holds the checkpoint (it gathers every rank's part) and
gives each rank its part when it resumes; on the other ranks ``state_dict`` is None and ``save``,
``load`` and ``load_state_dict`` do nothing, so that every rank may run the same script.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, overload

import torch
from torch import Tensor, nn

from ..core.boundary_layout import Layout
from ..core.boundary_values import TensorSpec, ValueSpec, as_tensors, copy_tensors, rebuild
from ..core.stage import Stage, StageConfig
from ..core.stage.stage import scheduler_class
from ..pipeline.state import PipelineState
from ..result import Result
from .format import FORMAT, VERSION, CheckpointError, check_contents, check_state


def spec_to_plain(spec: ValueSpec | None) -> dict[str, Any] | None:
    """A layout as plain values: ``{"tensors": [[shape, dtype name], ...], "is_tuple": bool}``."""
    if spec is None:
        return None
    tensors = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in spec.tensors]
    return {"tensors": tensors, "is_tuple": spec.is_tuple}


@overload
def spec_from_plain(plain: Mapping[str, Any]) -> ValueSpec: ...
@overload
def spec_from_plain(plain: None) -> None: ...
def spec_from_plain(plain: Mapping[str, Any] | None) -> ValueSpec | None:
    """The layout that ``spec_to_plain`` wrote."""
    if plain is None:
        return None
    tensors = tuple(TensorSpec(tuple(shape), getattr(torch, dtype)) for shape, dtype in plain["tensors"])
    return ValueSpec(tensors, bool(plain["is_tuple"]))


def message(sample: int, tensors: tuple[Tensor, ...] | list[Tensor] | None, predicted: bool = False) -> dict[str, Any]:
    """A value in transit (an activation, a gradient, a target) for sample ``sample``, copied;
    ``tensors`` None for a SKIP (a hole going forward, a gradient that will not come back). The
    activation of a sample that is only predicted has ``"predicted": True`` (absent: learnt)."""
    sent = {"sample": int(sample), "tensors": None if tensors is None else [t.detach().clone() for t in tensors]}
    if predicted:
        sent["predicted"] = True
    return sent


def to_bytes(value: Any) -> bytes:
    """``value`` (a checkpoint or a part of one) as the bytes of ``torch.save``, to send to another process."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    """What ``to_bytes`` wrote, read with ``weights_only=True`` (tensors on the CPU)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def layout_to_plain(layout: Layout) -> dict[str, Any]:
    """Every boundary's layout as plain values."""
    plain = spec_to_plain
    return {
        "input": plain(layout.input),
        "activations": [plain(a) for a in layout.activations],
        "output": plain(layout.output),
        "target": plain(layout.target),
    }


def layout_from_plain(plain: Mapping[str, Any]) -> Layout:
    """The layout that ``layout_to_plain`` wrote."""
    spec = spec_from_plain
    return Layout(
        spec(plain["input"]), tuple(spec(a) for a in plain["activations"]), spec(plain["output"]), spec(plain["target"])
    )


def identity_of(state: PipelineState, config: StageConfig, balance: Sequence[int] | None) -> dict[str, Any]:
    """What a checkpoint of a pipeline (in ``state``, configured by ``config``, cut by ``balance``)
    must agree on with the pipeline it is loaded into."""
    return {
        "depth": config.depth,
        "balance": None if balance is None else list(balance),
        "learning": config.learning,
        "supervised": state.supervised,
        "grad_mode": config.grad_mode,
        "compensation": list(config.compensation),
        "input": spec_to_plain(state.x_spec),
        "target": spec_to_plain(state.y_spec),
    }


def unstarted(stages: list[nn.Module], config: StageConfig) -> dict[str, Any]:
    """The executor's part of a checkpoint for ``stages`` that have not run: their fresh states."""
    return {"stages": [Stage(i, m, config).state_dict() for i, m in enumerate(stages)], "transit": None}


def to_checkpoint(
    state: PipelineState, identity: Mapping[str, Any], executor_state: Mapping[str, Any]
) -> dict[str, Any]:
    """The checkpoint of a pipeline in ``state``, of ``identity``, whose executor (stopped between
    two ticks) is in ``executor_state``; its results out of the executor are in ``state.held``."""
    held = [
        {
            "index": r.index,
            "loss": r.loss,
            "skipped": r.skipped,
            "predicted": r.predicted,
            "output": None if r.output is None else [t.detach().clone() for t in as_tensors(r.output, "output")],
        }
        for r in state.held
    ]
    return {
        "format": FORMAT,
        "version": VERSION,
        "identity": dict(identity),
        "counters": {"next_index": state.next_index, "in_segment": state.in_segment, "taken": state.taken},
        "layout": None if state.layout is None else layout_to_plain(state.layout),
        "held": held,
        "given": [message(index, as_tensors(y, "target")) for index, y in state.given],
        "dropped": [r.index for r in state.dropped],
        **executor_state,
    }


def from_checkpoint(checkpoint: Mapping[str, Any]) -> PipelineState:
    """The state that ``to_checkpoint`` wrote, in a checkpoint that ``check_state`` passed; the
    executor starts from it (``resume``) unless it was taken before the first sample."""
    identity, counters, layout = checkpoint["identity"], checkpoint["counters"], checkpoint["layout"]
    state = PipelineState(
        counters["next_index"],
        counters["in_segment"],
        counters["taken"],
        supervised=identity["supervised"],
        x_spec=spec_from_plain(identity["input"]),
        y_spec=spec_from_plain(identity["target"]),
    )
    if layout is not None:
        output = spec_from_plain(layout["output"])
        state.held.extend(
            Result(
                h["index"],
                None if h["output"] is None else rebuild(output, tuple(h["output"])),
                h["loss"],
                skipped=h["skipped"],
                predicted=h.get("predicted", False),  # absent from checkpoints written before predictions
            )
            for h in checkpoint["held"]
        )
        state.resume = dict(checkpoint)
    state.dropped.extend(Result(index, None, dropped=True) for index in checkpoint.get("dropped", ()))
    given = checkpoint.get("given", ())
    if given:
        y_spec = state.y_spec
        assert y_spec is not None, "check_contents refuses targets given without identity.target"
        state.given.extend((g["sample"], rebuild(y_spec, tuple(g["tensors"]))) for g in given)
    return state


def check_fits(stages: list[nn.Module], checkpoint: Mapping[str, Any], config: StageConfig) -> None:
    """Raise a ``CheckpointError`` unless every stage of ``checkpoint`` (one that ``check_state``
    passed) loads into a stage of ``stages`` made with ``config``, as the executor will load it.

    Each stage is tried on copies (of its layers, of a loss with parameters, of the checkpoint's
    part), one at a time, before anything of the pipeline changes: weights that do not fit, another
    optimizer, an optimizer state of other parameter groups, a loss of other parameters, a kept
    forward that does not run are refused here, never at the next sample with half of the pipeline
    loaded. The message names the stage and, for the optimizer and the lr scheduler, both classes
    (a checkpoint written with a scheduler does not load where there is none, nor the reverse).
    """
    loss_fn = config.loss_fn
    if isinstance(loss_fn, nn.Module) and any(p.requires_grad for p in loss_fn.parameters()):
        config = replace(config, loss_fn=copy.deepcopy(loss_fn))  # a stage loads the loss's parameters into it
    # a trial draws nothing from the caller's random stream (rebuilding a kept forward may draw)
    with torch.random.fork_rng(devices=[]):
        for i, (module, saved) in enumerate(zip(stages, checkpoint["stages"])):
            trial = copy.deepcopy(module)
            try:
                trial.load_state_dict(saved["module"])
            except RuntimeError as exc:
                raise CheckpointError(f"the weights of stage {i} do not fit this model: {exc}") from exc
            stage = Stage(i, trial, config)
            mine, theirs = type(stage.optimizer).__name__, saved.get("optimizer_class")
            if theirs != mine:
                raise CheckpointError(
                    f"the checkpoint is of another pipeline: its stage {i} learns with {_optimizer(theirs)}, "
                    f"this pipeline's with {_optimizer(mine)}; load it into a pipeline made with the optimizer "
                    "factory it was made with (an optimizer's state means nothing to another kind of optimizer)"
                )
            schedule, saved_schedule = scheduler_class(stage.lr_scheduler), saved.get("lr_scheduler_class")
            if saved_schedule != schedule:  # a checkpoint written before schedules has none
                raise CheckpointError(
                    f"the checkpoint is of another pipeline: its stage {i} schedules its lr with "
                    f"{_scheduler(saved_schedule)}, this pipeline's with {_scheduler(schedule)}; load it into a pipeline made with the lr_scheduler "
                    "factory it was made with (a scheduler's state means nothing to another schedule)"
                )
            try:
                stage.load_state_dict(copy_tensors(dict(saved)))
            except Exception as exc:
                raise CheckpointError(
                    f"stage {i} of the checkpoint does not fit this pipeline: {type(exc).__name__}: {exc}"
                ) from exc


def _optimizer(name: Any) -> str:
    """An optimizer's class name as a checkpoint keeps it, in a message."""
    return "no optimizer" if name == "NoneType" else repr(name)


def _scheduler(name: str | None) -> str:
    """An lr scheduler's class name as a checkpoint keeps it, in a message."""
    return "no lr_scheduler" if name is None else repr(name)


def load_weights(stages: list[nn.Module], checkpoint: Mapping[str, Any]) -> None:
    """Load each stage's weights from ``checkpoint``, which ``check_fits`` passed."""
    for module, stage in zip(stages, checkpoint["stages"]):
        module.load_state_dict(stage["module"])


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
        return (
            f"UnpicklingError: torch.load(weights_only=True) refused it: {detail.strip() or text}; "
            "every partime checkpoint loads with weights_only=True"
        )
    return f"{type(exc).__name__}: {text}"


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


__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "check_contents",
    "check_fits",
    "check_state",
    "from_bytes",
    "from_checkpoint",
    "identity_of",
    "layout_from_plain",
    "layout_to_plain",
    "load",
    "load_weights",
    "message",
    "save",
    "spec_from_plain",
    "spec_to_plain",
    "to_bytes",
    "to_checkpoint",
    "unstarted",
]

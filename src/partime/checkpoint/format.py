"""What a partime checkpoint must hold: its format, and the checks that refuse a damaged one
(``check_contents``) or one of another pipeline (``check_state``) with a ``CheckpointError``
(``partime.checkpoint.files`` re-exports what it defines).

The checks read plain values only, before anything is built from them, so that a damaged file never
reaches the pipeline or its stages; each message names the part (``counters.taken``) and the values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

FORMAT = "partime-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that does not fit the pipeline it is loaded into, is damaged, or is no checkpoint."""


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
    begun; targets are given only with an identity.target to read them by; every value in flight
    (held outputs, activations, gradients and targets in transit, targets given) has the shapes and
    dtypes of its layout. Sample indices need not be consecutive. The message names the part
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
        raise CheckpointError(
            f"damaged checkpoint: its identity.balance {balance!r} is not {depth} "
            f"positive whole numbers (identity.depth is {depth})"
        )
    for key in ("input", "target"):
        _check_spec(identity.get(key), f"identity.{key}", optional=True)

    counters = _part(state, "counters", _is_mapping, "a dict")
    next_index, in_segment, taken = (
        _part(counters, f"counters.{key}", _is_count, "a whole number >= 0")
        for key in ("next_index", "in_segment", "taken")
    )
    if in_segment > next_index:
        raise CheckpointError(
            f"damaged checkpoint: counters.in_segment ({in_segment}) is more than "
            f"counters.next_index ({next_index}), the samples fed in all"
        )
    if taken > in_segment:
        raise CheckpointError(
            f"damaged checkpoint: counters.taken ({taken}) is more than "
            f"counters.in_segment ({in_segment}), the samples fed in this segment"
        )

    layout = _part(state, "layout", lambda v: v is None or _is_mapping(v), "None or a dict")
    if layout is None:
        if in_segment:
            raise CheckpointError(
                f"damaged checkpoint: its layout is None, as before the first sample, "
                f"but counters.in_segment is {in_segment}"
            )
    else:
        for key in ("input", "output", "target"):
            _check_spec(_part(layout, f"layout.{key}", lambda v: True, ""), f"layout.{key}", optional=key == "target")
        activations = _part(layout, "layout.activations", _is_list, "a list")
        if len(activations) != depth - 1:
            raise CheckpointError(
                f"damaged checkpoint: len(layout.activations) is {len(activations)}, not depth - 1 = {depth - 1}"
            )
        for i, spec in enumerate(activations):
            _check_spec(spec, f"layout.activations[{i}]", optional=False)

    held = _part(state, "held", _is_list, "a list")
    due = max(0, in_segment - (depth - 1)) - taken
    if due < 0:
        raise CheckpointError(
            f"damaged checkpoint: counters.taken ({taken}) is more than the results that left the pipeline "
            f"in this segment: max(0, in_segment {in_segment} - (depth {depth} - 1)) = {taken + due}"
        )
    if len(held) != due:
        raise CheckpointError(
            f"damaged checkpoint: len(held) is {len(held)}, but the counters say {due} results left the "
            f"pipeline and were not handed out: max(0, in_segment {in_segment} - (depth {depth} - 1)) "
            f"- taken {taken} = {due}"
        )
    previous = -1
    for k, result in enumerate(held):
        name = f"held[{k}]"
        _part(held, name, _is_mapping, "a dict", k)
        index = _part(result, f"{name}.index", _is_count, "a whole number >= 0")
        if not previous < index < next_index:
            raise CheckpointError(
                f"damaged checkpoint: {name}.index is {index}: held results must come in "
                f"increasing sample order (the one before is {previous}) and before "
                f"counters.next_index ({next_index})"
            )
        previous = index
        _part(result, f"{name}.skipped", lambda v: isinstance(v, bool), "a bool")
        if "predicted" in result:  # absent from checkpoints written before predictions
            _part(result, f"{name}.predicted", lambda v: isinstance(v, bool), "a bool")
        _part(result, f"{name}.loss", lambda v: v is None or _is_real(v), "None or a number")
        _part(result, f"{name}.output", _is_tensors, "None or a list of tensors")

    stages = _part(state, "stages", _is_list, "a list")
    if len(stages) != depth:
        raise CheckpointError(f"damaged checkpoint: len(stages) is {len(stages)}, but identity.depth is {depth}")
    for i, stage in enumerate(stages):
        _part(stages, f"stages[{i}]", _is_mapping, "a dict", i)
        _part(stage, f"stages[{i}].module", _is_mapping, "a dict of weights")

    transit = _part(state, "transit", lambda v: v is None or _is_mapping(v), "None or a dict")
    if (transit is None) != (in_segment == 0):
        what = "nothing is" if transit is None else "values are"
        raise CheckpointError(
            f"damaged checkpoint: {what} in transit, but counters.in_segment is {in_segment}: "
            "values are in transit exactly when a segment has begun"
        )
    if transit is not None:
        tick = _part(transit, "transit.tick", _is_count, "a whole number >= 0")
        if tick != in_segment:
            raise CheckpointError(
                f"damaged checkpoint: transit.tick is {tick}, but counters.in_segment is "
                f"{in_segment}: a segment runs one tick per sample fed"
            )
        for key in ("acts", "grads"):
            sent = _part(transit, f"transit.{key}", _is_list, "a list")
            if len(sent) != depth:
                raise CheckpointError(
                    f"damaged checkpoint: len(transit.{key}) is {len(sent)}, not one per stage ({depth})"
                )
            for i, value in enumerate(sent):
                if value is not None:
                    _check_message(value, f"transit.{key}[{i}]", next_index)
        for i, value in enumerate(_part(transit, "transit.targets", _is_list, "a list")):
            _check_message(value, f"transit.targets[{i}]", next_index, tensors=True)
    given = _part(state, "given", _is_list, "a list") if "given" in state else ()
    if given and identity.get("target") is None:
        raise CheckpointError(
            f"damaged checkpoint: it has {len(given)} targets given (given), but no identity.target to read them by"
        )
    for i, value in enumerate(given):
        _check_message(value, f"given[{i}]", next_index, tensors=True)
    previous = -1
    for k, index in enumerate(_part(state, "dropped", _is_list, "a list") if "dropped" in state else ()):
        if not _is_count(index) or not previous < index < next_index:
            raise CheckpointError(
                f"damaged checkpoint: dropped[{k}] is {index!r}: the dropped samples must be whole numbers in "
                f"increasing order (the one before is {previous}), before counters.next_index ({next_index})"
            )
        previous = index

    if layout is not None:  # every value in flight has the layout it will be read by
        activations = layout["activations"]
        for k, result in enumerate(held):
            _check_layout(result["output"], layout["output"], f"held[{k}].output", "layout.output")
        if transit is not None:
            for i, value in enumerate(transit["acts"]):  # sent by stage i - 1 to stage i
                spec, spec_name = (
                    (activations[i - 1], f"layout.activations[{i - 1}]")
                    if i
                    else (None, "stage 0 is sent no activation")
                )
                _check_layout(value and value["tensors"], spec, f"transit.acts[{i}]", spec_name)
            for i, value in enumerate(transit["grads"]):  # sent by stage i + 1 to stage i
                last = i == depth - 1
                spec, spec_name = (
                    (None, "the last stage is sent no gradient")
                    if last
                    else (activations[i], f"layout.activations[{i}]")
                )
                _check_layout(value and value["tensors"], spec, f"transit.grads[{i}]", spec_name)
            for i, value in enumerate(transit["targets"]):
                _check_layout(value["tensors"], identity.get("target"), f"transit.targets[{i}]", "identity.target")
        for i, value in enumerate(given):
            _check_layout(value["tensors"], identity.get("target"), f"given[{i}]", "identity.target")


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
    if (
        not _is_list(tensors)
        or not tensors
        or not isinstance(plain.get("is_tuple"), bool)
        or (not plain["is_tuple"] and len(tensors) != 1)
        or not all(
            _is_list(t)
            and len(t) == 2
            and _is_list(t[0])
            and all(_is_count(d) for d in t[0])
            and isinstance(t[1], str)
            and isinstance(getattr(torch, t[1], None), torch.dtype)
            for t in tensors
        )
    ):
        shown = repr(plain)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointError(
            f"damaged checkpoint: its {name} is {shown}, not a layout "
            "({'tensors': [[shape, dtype name], ...], 'is_tuple': bool})"
        )


def _check_layout(tensors: Any, spec: Any, name: str, spec_name: str) -> None:
    """Raise a ``CheckpointError`` naming ``name`` and ``spec_name`` unless ``tensors`` (None: a
    hole, which fits anything) have the shapes and dtypes of the layout ``spec`` (None: no value
    may be there, for the reason ``spec_name`` gives)."""
    if tensors is None:
        return
    got = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]
    if spec is None:
        raise CheckpointError(f"damaged checkpoint: {name} holds tensors of {got}, but {spec_name}")
    want = [[list(shape), dtype] for shape, dtype in spec["tensors"]]
    if got != want:
        raise CheckpointError(
            f"damaged checkpoint: {name} holds tensors of {got} ([shape, dtype] each), but {spec_name} is "
            f"{want}: a value in flight has the layout of the boundary it crosses"
        )


def _check_message(value: Any, name: str, next_index: int, tensors: bool = False) -> None:
    """Raise a ``CheckpointError`` naming ``name`` unless ``value`` is what ``message`` writes for a
    sample fed before ``next_index`` (with tensors, if ``tensors``)."""
    _part({name: value}, name, _is_mapping, "a dict", name)
    sample = _part(value, f"{name}.sample", _is_count, "a whole number >= 0")
    if sample >= next_index:
        raise CheckpointError(
            f"damaged checkpoint: {name}.sample is {sample}, "
            f"but only samples before counters.next_index ({next_index}) were fed"
        )
    if tensors:
        _part(value, f"{name}.tensors", lambda v: v is not None and _is_tensors(v), "a list of tensors")
    else:
        _part(value, f"{name}.tensors", _is_tensors, "None or a list of tensors")
    if "predicted" in value:  # a predicted sample's activation
        _part(value, f"{name}.predicted", lambda v: v is True, "True (a predicted sample's value, with tensors)")
        _part(value, f"{name}.tensors", lambda v: v is not None, "a list of tensors (a predicted sample's value)")


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

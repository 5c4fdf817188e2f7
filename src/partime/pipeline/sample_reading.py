"""What the pipeline reads off the samples it is given.

``pair`` splits an item of a stream of ``(x, y)`` pairs, or raises a ValueError naming the
sample; ``layout_of`` learns every boundary's ``Layout`` from the first sample (and what each stage
takes in), without changing the stages, and raises a ``StageError`` naming the stage whose forward
fails on it.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Any

import torch
from torch import nn

from ..core.boundary_layout import Layout
from ..core.boundary_values import ValueSpec, as_tensors, rebuild, spec_of
from ..executors.base import stage_error


def pair(item: Any, index: int) -> tuple[Any, Any]:
    """``item`` of a stream of ``(x, y)`` pairs, split; a ValueError naming the sample if it is no pair."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    kind = f"a {type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
    raise ValueError(
        f"loss_fn takes a target and ys was not given, so every item of xs must be a pair (x, y); "
        f"sample {index} is {kind}: pass ys=, or pairs"
    )


def layout_of(
    stages: list[nn.Module], x: Any, target: ValueSpec | None, autocast: torch.dtype | None = None
) -> tuple[Layout, list[Any]]:
    """Every boundary's layout, from one forward of a copy of the stages on the first sample,
    without gradients (under ``torch.autocast`` of ``autocast`` on each stage's device type, as the
    stages run: what crosses a boundary has the dtype they emit), and what each stage took in (stage 0 the sample, each other the output of
    the one before: what a stage's worker warms up on). The stages are left as they were, but a
    side effect outside them (a counter in a forward) sees that forward, and it draws from the
    current random stream (the pipeline calls it on a fork of the caller's)."""
    specs = []
    sample = spec_of(x, "sample 0")
    value = rebuild(sample, as_tensors(x, "sample 0"))  # as stage 0 takes it (contiguous): its outputs' strides follow
    inputs = []
    with torch.no_grad():
        for i, stage in enumerate(copy.deepcopy(stages)):
            inputs.append(value)
            try:
                with _autocasting(stage, value, autocast):
                    value = stage(value)
            except Exception as exc:
                raise stage_error(i, 0, "forward", exc) from exc
            specs.append(spec_of(value, f"output of stage {i}", strides=True))  # handed on in its strides
    return Layout(sample, tuple(specs[:-1]), specs[-1], target), inputs


def _autocasting(stage: nn.Module, value: Any, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` of ``dtype`` on the device type ``stage`` runs on (that of its first
    parameter or buffer, else of its input ``value``); nothing for None."""
    if dtype is None:
        return contextlib.nullcontext()
    held = next(itertools.chain(stage.parameters(), stage.buffers()), None)
    if held is None:
        held = next(iter(as_tensors(value, "input")), None)
    return torch.autocast(device_type="cpu" if held is None else held.device.type, dtype=dtype)

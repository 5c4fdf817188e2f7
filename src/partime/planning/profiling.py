"""The time of each layer of a model.

``profile_layers`` promises one positive median time per top-level child of an
``nn.Sequential``, measured on a copy so that the model and the random state are left as they were.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..core.boundary_values import as_tensors
from ..traced.segment import Segment
from .balance import check_balance, is_int

log = logging.getLogger(__name__)

Sample = Tensor | tuple[Tensor, ...]


def profile_layers(
    model: nn.Sequential,
    sample: Sample,
    *,
    learning: bool,
    repeats: int = 5,
    warmup: int = 2,
    on_output: Callable[[int, object], None] | None = None,
) -> tuple[float, ...]:
    """Median seconds of each top-level child of ``model`` on ``sample``: one positive time each.

    ``sample`` goes to the first child as ``model(sample)`` would pass it; each child's output
    feeds the next. Without ``learning`` each child's forward is timed under ``torch.no_grad()``;
    with it, its forward and its backward (a gradient of ones for its output, taken with respect
    to its parameters and to its floating-point inputs; the first child's input only if the
    sample requires grad). A child with nothing to differentiate is timed forward only. Each
    child gets a copy of its input (made untimed), so in-place children leave ``sample`` as it was.

    Runs on a deep copy of the model, in the model's own train/eval mode, so the model (its
    parameters, grads, buffers such as BatchNorm running stats) and the global random state are
    left as they were. On CUDA the device is synchronised around each timed step. The copy
    needs as much memory again as the model.

    ``on_output(k, output)``, if given, is called with each child's output once, in the last
    repetition, outside the timed part (``hop_cost.HopMeter`` times the boundaries so).

    A sample that does not fit a traced model's forward (``traced.segment.Segment.check_sample``)
    is refused with that TypeError, which names the forward's inputs, before anything runs.
    """
    if not is_int(repeats) or repeats < 1 or not is_int(warmup) or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats!r}, warmup={warmup!r}")
    check_balance(model, 1)
    as_tensors(sample, "sample")
    first = next(iter(model._modules.values()))
    if isinstance(first, Segment):  # its own words, rather than the first op's on a misplaced value
        first.check_sample(sample)
    replica = copy.deepcopy(model)
    children = list(replica._modules.values())
    devices = _cuda_devices(sample, replica)
    # Times at or below the clock's resolution are reported as the resolution: positive.
    floor = time.get_clock_info("perf_counter").resolution
    samples: list[list[float]] = [[] for _ in children]
    with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(learning):
        for rep in range(warmup + repeats):
            value: object = sample
            for k, child in enumerate(children):
                value, leaves = _fresh(value, learning=learning, first=k == 0)
                _sync(devices)
                start = time.perf_counter()
                out = _run(k, child, "forward", child, value)
                outputs = as_tensors(out, f"the output of child {k} ({type(child).__name__})")
                if learning:
                    _run(k, child, "backward", _backward, child, leaves, outputs)
                _sync(devices)
                if rep >= warmup:
                    samples[k].append(max(time.perf_counter() - start, floor))
                if on_output is not None and rep == warmup + repeats - 1:
                    on_output(k, out)
                value = out
    times = tuple(statistics.median(ts) for ts in samples)
    log.debug("profiled %d layers (learning=%s): %s", len(times), learning, times)
    return times


def _fresh(value: object, *, learning: bool, first: bool) -> tuple[object, list[Tensor]]:
    """A copy of ``value`` cut from the graph, for a child's input, and the leaves to take its
    gradient at: when learning, every floating-point tensor (of the first child's input, those
    that require grad). Copies, so that in-place children (``ReLU(inplace=True)``) touch neither
    the user's sample nor a leaf.
    """
    tensors, leaves = [], []
    for t in as_tensors(value, "a child's input"):
        leaf = t.detach()
        if learning and leaf.is_floating_point() and (t.requires_grad or not first):
            leaves.append(leaf.requires_grad_())
        tensors.append(leaf.clone())
    if isinstance(value, Tensor):
        return tensors[0], leaves
    return (tensors if isinstance(value, list) else tuple(tensors)), leaves


def _run(k: int, child: nn.Module, phase: str, step: Callable[..., object], *args: object) -> Any:
    """``step(*args)``; what it raises comes back as a RuntimeError naming the child and phase."""
    try:
        return step(*args)
    except Exception as exc:
        raise RuntimeError(f"profiling child {k} ({type(child).__name__}) failed in its {phase}: {exc}") from exc


def _backward(child: nn.Module, leaves: list[Tensor], outputs: tuple[Tensor, ...]) -> None:
    """Gradients of ``outputs`` (times ones) w.r.t. ``child``'s parameters and input ``leaves``."""
    outs = [o for o in outputs if o.requires_grad]
    wrt: list[Tensor] = [p for p in child.parameters() if p.requires_grad] + leaves
    if outs and wrt:
        torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)


def _cuda_devices(sample: object, model: nn.Module) -> list[int]:
    tensors = [*as_tensors(sample, "sample"), *model.parameters(), *model.buffers()]
    return sorted(
        {
            torch.cuda.current_device() if t.device.index is None else t.device.index
            for t in tensors
            if t.device.type == "cuda"
        }
    )


def _sync(devices: list[int]) -> None:
    for d in devices:
        torch.cuda.synchronize(d)

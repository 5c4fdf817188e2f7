"""Whether the pipeline ``balance="auto"`` chose is faster than the model as it is, measured.

The planner predicts a stage's time from its layers' forward (and backward) and the copies of its
boundaries. A stage's tick holds more: when it learns, the grad mode keeps the forward's graph
or runs a late gradient's sample forward again (``stash``), the compensation keeps and corrects
weights, the optimizer steps, and each of those costs Python time that no layer's timing sees;
on small stages that is most of the tick. So before ``"auto"`` keeps a pipeline, ``confirmed``
runs each stage of its cut as partime's own ``Stage`` for a few ticks of a steady stream (a
forward per tick and, when learning, the product of a gradient of ones for the sample its delay
gives, and the step) and adds what its boundaries cost it per tick (``Partition.hop_costs``):
the pipeline's own tick. It weighs that against the model as a user runs it without partime,
with plain torch on every core: a forward without gradients, or a forward, the backward of a
gradient of ones and a step of the pipeline's optimizer. The pipeline is kept only if its slowest
stage is ``planner.AUTO_MARGIN`` faster than that, so ``"auto"`` falls back to one stage wherever
the plain model would be as fast (the bench's "sequential" on every core).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..core.boundary_values import as_tensors
from ..core.stage import Stage, StageConfig
from .partition import Partition, split
from .planner import AUTO_MARGIN, torch_threads

log = logging.getLogger("partime.pipeline.pipeline")

WARMUP_TICKS = 2
"""Ticks of each stage (once its first gradient comes, when learning), and calls of the plain
model, run before the timed ones."""

TIMED_TICKS = 10
"""Ticks of each stage, and calls of the plain model, timed; a time is their median."""


def confirmed(
    model: nn.Sequential,
    partition: Partition,
    sample: Any,
    config: StageConfig,
    threads: Callable[[int], int],
    margin: float = AUTO_MARGIN,
) -> Partition:
    """``partition`` if its slowest stage's measured tick (see the module docstring) is ``margin``
    faster than the plain model's, else the model as one stage (with the figures logged at INFO).
    ``config`` is the pipeline's, for ``partition.depth`` stages; ``threads(D)`` is the torch
    thread count each of D stages runs with."""
    depth, n = partition.depth, len(model)
    staged = copy.deepcopy(model)  # the timing steps and updates BatchNorm statistics: not the pipeline's
    with torch_threads(threads(depth)):
        stages = [
            _tick_seconds(i, module, config, value)
            for i, (module, value) in enumerate(
                zip(split(staged, partition.balance), _inputs(staged, partition, sample))
            )
        ]
    hops = partition.hop_costs or (0.0,) * depth  # a tick's own work and its boundaries' copies
    stages = [t + hop for t, hop in zip(stages, hops, strict=True)]
    with torch_threads(threads(1)):
        alone = _plain_seconds(copy.deepcopy(model), config, sample)
    said = f"measured {max(stages) * 1e3:.3g} ms per sample at {depth} stages {list(partition.balance)}, "
    said += f"{alone * 1e3:.3g} ms for the plain model"
    if max(stages) * (1 + margin) <= alone:
        log.info("balance='auto': %d stages, %s", depth, said)
        return partition
    log.info("balance='auto': 1 stage, no pipeline is measured at least %.0f%% faster: %s", margin * 100, said)
    return dataclasses.replace(partition, balance=(n,))  # with its profile, as the planner's own D = 1


def _inputs(model: nn.Sequential, partition: Partition, sample: Any) -> list[Any]:
    """What each stage of ``partition`` takes, on ``sample``."""
    values, value = [], sample
    with torch.no_grad():
        for module in split(copy.deepcopy(model), partition.balance):
            values.append(value)
            value = module(value)
    return values


def _plain_seconds(model: nn.Module, config: StageConfig, value: Any) -> float:
    """Median seconds of ``model`` on ``value`` with plain torch (see the module docstring): when
    ``config`` learns, with an optimizer of its own from ``config.optimizer``."""
    learning = config.optimizer is not None  # config.learning, in a form mypy narrows
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = config.optimizer(params) if config.optimizer is not None and params else None
    with torch.no_grad():
        ones = [torch.ones_like(t) for t in as_tensors(model(value), "output of the model")]
    times = []
    for s in range(WARMUP_TICKS + TIMED_TICKS):
        start = time.perf_counter()
        if learning:
            if optimizer is not None:
                optimizer.zero_grad()
            outs = [(t, g) for t, g in zip(as_tensors(model(value), "output of the model"), ones) if t.requires_grad]
            if outs:
                torch.autograd.backward([t for t, _ in outs], [g for _, g in outs])
            if optimizer is not None:
                optimizer.step()
        else:
            with torch.no_grad():
                model(value)
        if s >= WARMUP_TICKS:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _tick_seconds(index: int, module: nn.Module, config: StageConfig, value: Any) -> float:
    """Median seconds of stage ``index``'s tick in a steady stream of ``value`` (see the module docstring)."""
    stage = Stage(index, module, config)
    delay = 2 * (config.depth - 1 - index)
    grad: Any = None
    if config.learning:
        with torch.no_grad():
            out = module(value)
        ones = tuple(torch.ones_like(t) for t in as_tensors(out, f"output of stage {index}"))
        grad = ones[0] if isinstance(out, Tensor) else ones
    times = []
    for s in range(delay + WARMUP_TICKS + TIMED_TICKS):
        start = time.perf_counter()
        stage.forward(s, value)
        if config.learning and s >= delay:
            stage.backward(s - delay, grad)
        if s >= delay + WARMUP_TICKS:
            times.append(time.perf_counter() - start)
    return statistics.median(times)

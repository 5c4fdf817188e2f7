"""Whether the pipeline ``balance="auto"`` chose is faster than the model as it is, measured.

The planner predicts a stage's time from its layers' forward (and backward) and the copies of its
boundaries. A stage's tick holds more: when it learns, the grad mode keeps the forward's graph
or runs a late gradient's sample forward again (``stash``), the compensation keeps and corrects
weights, the optimizer steps, and each of those costs Python time that no layer's timing sees;
on small stages that is most of the tick, and stages that run at once on one machine slow each
other and wait for each other. So before ``"auto"`` keeps a pipeline, ``confirmed`` measures it:
where its executor runs the stages in workers, a pipeline of the cut itself, running for a
moment on copies of the model and the sample (``running``); else (the inline executor, which
simulates one) each stage of its cut as partime's own ``Stage`` for a few ticks of a steady stream
(a forward per tick and, when learning, the product of a gradient of ones for the sample its
delay gives, and the step), plus what its boundaries cost it per tick (``Partition.hop_costs``).
It weighs that against the model as a user runs it without partime, with plain torch on every
core: a forward without gradients, or a forward, the backward of a gradient of zeros and a step
of the pipeline's optimizer (the work of any gradient, and weights that stay put, for as long as
it runs). The pipeline is kept only if it is ``planner.AUTO_MARGIN`` faster than
that, so ``"auto"`` falls back to one stage wherever the plain model would be as fast (the bench's
"sequential" on every core).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ..core.boundary_values import as_tensors
from ..core.stage import Stage, StageConfig
from .partition import Partition, split
from .planner import AUTO_MARGIN, torch_threads, usable_cores

log = logging.getLogger("partime.pipeline.pipeline")

WARMUP_TICKS = 2
"""Ticks of each stage run before the timed ones (once its first gradient comes, when learning)."""

TIMED_TICKS = 10
"""Ticks of each stage timed; a stage's time is their median."""

STEADY_WARMUP_S = 0.5
"""Seconds that ``steady_seconds`` lets pass (and ``STEADY_COUNT`` items) before it times: a
fresh worker's, or a fresh model's, first calls are slower than its steady ones."""

STEADY_S = 0.5
"""Seconds over which ``steady_seconds`` times (and at least ``STEADY_COUNT`` items)."""

STEADY_COUNT = 20
"""The fewest items ``steady_seconds`` warms up with, and times."""


def confirmed(
    model: nn.Sequential,
    partition: Partition,
    sample: Any,
    config: StageConfig,
    threads: Callable[[int], int],
    running: Callable[[Partition], float] | None = None,
    margin: float = AUTO_MARGIN,
) -> Partition:
    """``partition`` if it is measured (see the module docstring) ``margin`` faster than the plain
    model, else the model as one stage (with the figures logged at INFO). ``config`` is the
    pipeline's, for ``partition.depth`` stages; ``threads(D)`` is the torch thread count each of D
    stages runs with (the plain model runs with one per usable core); ``running(partition)``, where given, the seconds per sample of a pipeline of
    ``partition`` running."""
    depth, n = partition.depth, len(model)
    if running is not None:
        pipeline = running(partition)
        how = "running"
    else:
        staged = copy.deepcopy(model)  # the timing steps and updates BatchNorm statistics: not the pipeline's
        with torch_threads(threads(depth)):
            stages = [
                _tick_seconds(i, module, config, value)
                for i, (module, value) in enumerate(
                    zip(split(staged, partition.balance), _inputs(staged, partition, sample))
                )
            ]
        hops = partition.hop_costs or (0.0,) * depth  # a tick's own work and its boundaries' copies
        pipeline = max(t + hop for t, hop in zip(stages, hops, strict=True))
        how = "its stages' ticks"
    with torch_threads(usable_cores()):
        alone = _plain_seconds(copy.deepcopy(model), config, sample)
    said = f"measured {pipeline * 1e3:.3g} ms per sample at {depth} stages {list(partition.balance)} ({how}), "
    said += f"{alone * 1e3:.3g} ms for the plain model"
    if pipeline * (1 + margin) <= alone:
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


def steady_seconds(done: Iterable[Any]) -> float:
    """The seconds per item of ``done`` (each one made when it is taken: a result of a running
    pipeline, a call of a model), on average over ``STEADY_S`` seconds after ``STEADY_WARMUP_S``
    (each at least ``STEADY_COUNT`` items): its rate, stalls included. ``done`` is closed after."""
    seen: list[float] = []  # when each item came
    timed_from: int | None = None  # the first item timed
    for _ in done:
        now = time.perf_counter()
        seen.append(now)
        if timed_from is None:
            if len(seen) > STEADY_COUNT and now - seen[0] >= STEADY_WARMUP_S:
                timed_from = len(seen) - 1
        elif len(seen) - timed_from > STEADY_COUNT and now - seen[timed_from] >= STEADY_S:
            break
    if isinstance(done, Generator):
        done.close()
    if timed_from is None or len(seen) - timed_from <= STEADY_COUNT:
        raise ValueError(f"steady_seconds needs an endless stream of items, got {len(seen)}")
    return (seen[-1] - seen[timed_from]) / (len(seen) - 1 - timed_from)


def _plain_seconds(model: nn.Module, config: StageConfig, value: Any) -> float:
    """The steady seconds of a call of ``model`` on ``value`` with plain torch (see the module
    docstring): when ``config`` learns, with an optimizer of its own from ``config.optimizer``."""
    return steady_seconds(_plain_calls(model, config, value))


def _plain_calls(model: nn.Module, config: StageConfig, value: Any) -> Iterator[None]:
    """Calls of ``model`` on ``value`` with plain torch, one per item taken (see ``_plain_seconds``)."""
    learning = config.optimizer is not None  # config.learning, in a form mypy narrows
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = config.optimizer(params) if config.optimizer is not None and params else None
    with torch.no_grad():
        zeros = [torch.zeros_like(t) for t in as_tensors(model(value), "output of the model")]
    while True:
        if learning:
            if optimizer is not None:
                optimizer.zero_grad()
            outs = [(t, g) for t, g in zip(as_tensors(model(value), "output of the model"), zeros) if t.requires_grad]
            if outs:
                torch.autograd.backward([t for t, _ in outs], [g for _, g in outs])
            if optimizer is not None:
                optimizer.step()
        else:
            with torch.no_grad():
                model(value)
        yield


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

"""Whether the pipeline ``balance="auto"`` chose is faster than the model as it is, measured.

The planner predicts a stage's time from its layers' forward (and backward) and the copies of its
boundaries. A stage's tick holds more: when it learns, the grad mode keeps the forward's graph
or runs a late gradient's sample forward again (``stash``), the compensation keeps and corrects
weights, the optimizer steps, and each of those costs Python time that no layer's timing sees;
on small stages that is most of the tick, and stages that run at once on one machine slow each
other and wait for each other. So before ``"auto"`` keeps a pipeline, ``confirmed`` measures it:
where its executor runs the stages in workers, a pipeline of the cut itself, running on copies of
the model and the sample (``running``), in turns with the plain model (``in_turns``); else (the
inline executor, which simulates one) each stage of its cut as partime's own ``Stage`` for a few
ticks of a steady stream (a forward per tick and, when learning, the product of a gradient of ones
for the sample its delay gives, and the step), plus what its boundaries cost it per tick
(``Partition.hop_costs``). The plain model is the model as a user runs it without partime (a traced
model's own module and forward, not the graph's layers the stages run), with plain torch and the
threads one stage would have (every core, unless the pipeline's ``threads`` says
otherwise): a forward without gradients, or a forward, the backward of a gradient of zeros and a
step of the pipeline's optimizer (the work of any gradient, and weights that stay put for as long as
it runs). The pipeline is kept only if it is ``planner.AUTO_MARGIN`` faster than that, so ``"auto"``
falls back to one stage wherever the model alone would be as fast.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from ..core.boundary_values import as_tensors
from ..core.stage import Stage, StageConfig
from ..core.stage.config import first_trained
from .partition import Partition, split
from .planner import AUTO_MARGIN, torch_threads

log = logging.getLogger("partime.pipeline.pipeline")

WARMUP_TICKS = 2
"""Ticks of each stage run before the timed ones (once its first gradient comes, when learning)."""

TIMED_TICKS = 10
"""Ticks of each stage timed; a stage's time is their median."""

WARMUP_S = 0.5
"""Seconds (and at least ``WINDOW_COUNT`` items) that the pipeline and the plain model each run
before they are timed: a fresh worker's, or a fresh model's, first calls are slower."""

WINDOW_S = 0.25
"""Seconds of each timed window (and at least ``WINDOW_COUNT`` items)."""

WINDOW_COUNT = 3
"""The fewest items in a window (and in the warm-up) after its first: a model of a second a sample
and its pipeline are measured in about 30 seconds, one of 10 ms in about 3."""

WINDOWS = 4
"""Timed windows of each, the pipeline's and the plain model's taking turns: a time is their
median, and the turns make a machine that slows or speeds up for a while slow both alike."""


def confirmed(
    model: nn.Sequential,
    partition: Partition,
    sample: Any,
    config: StageConfig,
    threads: Callable[[int], int],
    running: Callable[[Partition], AbstractContextManager[Iterator[Any]]] | None = None,
    margin: float = AUTO_MARGIN,
    plain: nn.Module | None = None,
) -> Partition:
    """``partition`` if it is measured (see the module docstring) ``margin`` faster than the plain
    model, else the model as one stage (with the figures logged at INFO). ``config`` is the
    pipeline's, for ``partition.depth`` stages; ``threads(D)`` is the torch thread count each of D
    stages runs with (the plain model runs with ``threads(1)``, as the pipeline would at one
    stage); ``running(partition)``, where given, opens a pipeline of ``partition`` and gives its
    endless results. ``plain`` is the model as its user runs it, called on ``sample`` (for a traced
    model, ``traced.structured_loss.ModelCall`` of its module); None: ``model`` is (an
    ``nn.Sequential``). It is timed on a copy."""
    depth, n = partition.depth, len(model)
    alone_calls = (_plain_calls(copy.deepcopy(model if plain is None else plain), config, sample), threads(1))
    if running is not None:
        with running(partition) as results:
            pipeline, alone = in_turns((results, torch.get_num_threads()), alone_calls)
        how = "running"
    else:
        staged = copy.deepcopy(model)  # the timing steps and updates BatchNorm statistics: not the pipeline's
        modules = split(staged, partition.balance)
        trial = dataclasses.replace(config, first_trained=first_trained(modules, config.loss_fn))
        with torch_threads(threads(depth)):
            stages = [
                _tick_seconds(i, module, trial, value)
                for i, (module, value) in enumerate(zip(modules, _inputs(staged, partition, sample)))
            ]
        hops = partition.hop_costs or (0.0,) * depth  # a tick's own work and its boundaries' copies
        pipeline = max(t + hop for t, hop in zip(stages, hops, strict=True))
        (alone,) = in_turns(alone_calls)
        how = "its stages' ticks"
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


def in_turns(*runs: tuple[Iterator[Any], int]) -> tuple[float, ...]:
    """The seconds per item of each of ``runs``, an iterator (each item made when it is taken: a
    result of a running pipeline, a call of a model) and the torch thread count to take its items
    with: after each has run ``WARMUP_S``, the median of ``WINDOWS`` windows of ``WINDOW_S``,
    taken in turns, one window of each run after the other. A window's time is its rate, stalls
    included. A ``ValueError`` if a run ends."""

    def window(run: Iterator[Any], threads: int, seconds: float) -> float:
        with torch_threads(threads):
            return window_seconds(run, seconds)

    for run in runs:
        window(*run, WARMUP_S)
    windows = [[window(*run, WINDOW_S) for run in runs] for _ in range(WINDOWS)]
    return tuple(statistics.median(times) for times in zip(*windows))


def window_seconds(run: Iterator[Any], seconds: float) -> float:
    """The seconds per item of ``run`` over a window from its next item to the first at least
    ``seconds`` and ``WINDOW_COUNT`` items later."""
    taken, start = 0, None
    for _ in run:
        now = time.perf_counter()
        if start is None:
            start = now
        elif (taken := taken + 1) >= WINDOW_COUNT and now - start >= seconds:
            return (now - start) / taken
    raise ValueError(f"a timed run ended after {taken + (start is not None)} items of a window")


def _plain_calls(model: nn.Module, config: StageConfig, value: Any) -> Iterator[None]:
    """Calls of ``model`` on ``value`` with plain torch, one per item taken (see the module
    docstring): when ``config`` learns, with an optimizer of its own from ``config.optimizer``."""
    learning = config.optimizer is not None  # config.learning, in a form mypy narrows
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = config.optimizer(named) if config.optimizer is not None and named else None
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
    if stage.takes_gradient:
        with torch.no_grad():
            out = module(value)
        ones = tuple(torch.ones_like(t) for t in as_tensors(out, f"output of stage {index}"))
        grad = ones[0] if isinstance(out, Tensor) else ones
    times = []
    for s in range(delay + WARMUP_TICKS + TIMED_TICKS):
        start = time.perf_counter()
        stage.forward(s, value)
        if stage.takes_gradient and s >= delay:
            stage.backward(s - delay, grad)
        if s >= delay + WARMUP_TICKS:
            times.append(time.perf_counter() - start)
    return statistics.median(times)

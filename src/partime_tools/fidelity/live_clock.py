"""The live view on the real clock: how long each contender learns from a sample, and whether a
real live run keeps what the drop schedule says it keeps.

``measure`` times, on the machine it runs on, the plain loop (forward, loss, backward and
optimizer step on one torch thread) once, and a real ``Pipeline(model, D, executor="process")``
with its defaults otherwise at each depth D, all learning on the stream; the live view's runs then
take those times as given (``fidelity_live_runs``). A pipeline of more stages than the machine has
cores shares them, and is timed so: the times are the machine's. ``check_real`` plays a stream
with ``partime.sources.at_rate`` on the real clock to each, a pipeline under ``when_behind="drop"``
and the plain loop over ``partime.internals.newest`` (the same rule), and counts what each kept
beside what ``fidelity_live.drop_schedule`` predicts from the times.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from partime import Pipeline, StageError
from partime.internals import newest, torch_threads
from partime.sources import at_rate

from .live import drop_schedule
from .live_runs import Times, loss_of, stream_items
from .models import loss_named, model_named, model_of
from .runs import LR_GRID, optimizer_factory

MEASURED, WARMUP = 300, 50
"""Samples timed, after the warm-up ones."""


def measure(
    model: str, optimizer: str, depths: Sequence[int], samples: int = MEASURED, warmup: int = WARMUP
) -> tuple[Times, dict[int, tuple[int, ...]]]:
    """The plain loop's seconds per learning sample, and the pipeline's at each of ``depths``, with
    ``model`` (``"digits"`` or ``"camera"``) and ``optimizer`` at its smallest step of ``LR_GRID``
    (what it costs does not depend on the step), each the median over ``samples`` samples of its
    stream after ``warmup``; and the layers per stage the pipeline chose at each depth."""
    items = list(stream_items(model, 0, warmup + samples + max(depths)))
    lr = LR_GRID[optimizer][0]
    pipeline, balances = {}, {}
    with torch_threads(1):
        torch.manual_seed(0)
        net = model_named(model)
        step = _plain_step(net, model, optimizer, lr)
        stamps = [time.perf_counter()]
        for item in items:
            step(item)
            stamps.append(time.perf_counter())
        plain = _median_gap(stamps, warmup, samples)
        for depth in depths:
            torch.manual_seed(0)
            net = model_named(model)
            # The caller only copies samples in and results out: one thread leaves the cores to the stages.
            with _pipeline(net, depth, model, optimizer, lr) as pipe:
                stamps = [time.perf_counter()]
                for _ in pipe.stream(iter(items)):
                    stamps.append(time.perf_counter())
                balances[depth] = tuple(pipe.partition.balance if pipe.partition else ())
            pipeline[depth] = _median_gap(stamps, warmup, samples)
    return Times(plain, pipeline), balances


def check_real(
    stream: str,
    optimizer: str,
    lrs: dict[int, float],
    times: Times,
    rate: float,
    frames: int,
    seed: int = 1,
) -> dict[str, Any]:
    """``frames`` samples of ``stream`` (from ``seed``) played at ``rate`` per second on the real
    clock to the plain loop and to the pipeline at each depth, each learning what it takes at its
    step size of ``lrs`` (by depth: 1 for the plain loop, and a pipeline at each other depth of
    ``lrs``); in ``"contenders"``, for each, the samples it kept and those ``drop_schedule``
    predicts from ``times``. A run whose loss became non-finite stops there (``diverged``)."""
    items = list(stream_items(stream, seed, frames))  # made beforehand: the source must not wait for them
    model = model_of(stream)
    out: dict[str, Any] = dict(stream=stream, optimizer=optimizer, rate=rate, frames=frames, seed=seed)
    with torch_threads(1):
        torch.manual_seed(seed)
        net = model_named(model)
        step = _plain_step(net, model, optimizer, lrs[1])
        kept = 0
        for item, _, _ in newest(at_rate(items, rate)):
            step(item)
            kept += 1
        predicted = len(drop_schedule(frames, rate, times.plain))
        out["contenders"] = [dict(contender="plain", depth=1, kept=kept, predicted=predicted, diverged=False)]
        for depth in (d for d in lrs if d > 1):
            torch.manual_seed(seed)
            net = model_named(model)
            kept, diverged = 0, False
            with _pipeline(net, depth, model, optimizer, lrs[depth]) as pipe:
                try:
                    kept = sum(not r.dropped for r in pipe.stream(at_rate(items, rate), when_behind="drop"))
                except StageError as exc:
                    if "not finite" not in exc.message:
                        raise
                    diverged = True
            predicted = len(drop_schedule(frames, rate, times.of("pipeline", depth)))
            out["contenders"].append(
                dict(contender="pipeline", depth=depth, kept=kept, predicted=predicted, diverged=diverged)
            )
    return out


def _plain_step(net: nn.Module, model: str, optimizer: str, lr: float) -> Callable[[Any], None]:
    """The plain loop's work on one item: a forward, the loss, a backward and an optimizer step."""
    loss, opt = loss_of(net, model), optimizer_factory(optimizer, lr)(net.parameters())

    def step(item: Any) -> None:
        opt.zero_grad()
        loss(item).backward()
        opt.step()

    return step


@contextmanager
def _pipeline(net: nn.Module, depth: int, model: str, optimizer: str, lr: float) -> Iterator[Pipeline]:
    """A learning ``depth``-stage process pipeline of ``net``, its defaults otherwise."""
    with Pipeline(
        net, depth, executor="process", loss_fn=loss_named(model), optimizer=optimizer_factory(optimizer, lr)
    ) as pipe:
        yield pipe


def _median_gap(stamps: list[float], warmup: int, samples: int) -> float:
    """The median of the ``samples`` gaps between successive stamps after the first ``warmup``."""
    return statistics.median(b - a for a, b in itertools.islice(itertools.pairwise(stamps), warmup, warmup + samples))

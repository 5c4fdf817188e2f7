"""The contenders of ``partime bench --rate``: the plain model and the pipeline, each reading a live source.

A contender is opened once on a ``bench_contenders.Setting`` and then run many times; a run
streams the setting's frames, either recorded (``fps=None``: as fast as the contender takes them)
or as a live source (``partime.sources.at_rate(frames, fps)``) under ``when_behind="drop"``, and
returns a ``StreamTimes``: for every frame, in order, when it arrived, when its result was handed out,
and whether it was dropped. The contenders:

- ``plain(threads)``: a copy of the model with ``threads`` torch threads, in a plain loop over
  ``partime.internals.newest`` (the newest frame arrived, the ones it replaced dropped);
- ``pipelined(executor, depth)``: ``Pipeline(model, depth, executor=executor)`` with one torch
  thread per stage, its ``stream(source, when_behind="drop")``.

Both time their frames on the source's clock (``partime.sources.MONOTONIC``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from partime import Partition, Pipeline
from partime.internals import newest, torch_threads
from partime.sources import MONOTONIC, Clock, at_rate

from .contenders import Setting
from .runner import plain_step


@dataclass(frozen=True)
class StreamTimes:
    """One stream of a contender at ``fps`` (None: recorded): for frame ``k``, when it arrived
    (``arrived[k]``, seconds on the source's clock), when its result was handed out
    (``handed[k]``) and whether it was dropped (``dropped[k]``: it never went in)."""

    fps: float | None
    arrived: list[float]
    handed: list[float]
    dropped: list[bool]


@dataclass(frozen=True)
class Live:
    """An opened contender: ``run(fps)`` streams its setting once; a pipeline has the cut it chose."""

    run: Callable[[float | None], StreamTimes]
    partition: Partition | None = None


@dataclass(frozen=True)
class LiveContender:
    """A way to keep up with a live source: its name in the report, its kind (``sequential`` or
    ``pipeline``), its depth (0: the plain model), the torch threads it computes with, its executor
    (None: the plain model) and how to open it on a ``Setting``."""

    name: str
    kind: str
    depth: int
    threads: int
    open: Callable[[Setting], AbstractContextManager[Live]]
    executor: str | None = None


def plain(threads: int) -> LiveContender:
    """The plain model (a copy), one frame at a time, with ``threads`` torch threads; when the
    setting learns, a forward, backward and step of its optimizer on each frame that it takes."""

    @contextmanager
    def open_(setting: Setting) -> Iterator[Live]:
        one = plain_step(copy.deepcopy(setting.model), setting.ys, setting.optimizer)

        def run(fps: float | None) -> StreamTimes:
            with torch_threads(threads):
                return plain_loop(setting.xs, one, fps)

        yield Live(run)

    plural = "s" if threads > 1 else ""
    return LiveContender(f"sequential {threads} thread{plural}", "sequential", 0, threads, open_)


def plain_loop(
    items: Iterable[Any], one: Callable[[int, Any], None], fps: float | None, clock: Clock = MONOTONIC
) -> StreamTimes:
    """``one(k, item)`` on the items of ``items``: each in turn (``fps=None``), or on the newest
    arrived of ``at_rate(items, fps, clock=clock)`` (``arrivals.newest``), the ones it replaced
    dropped; each handed out when ``one`` returns."""
    arrived: list[float] = []
    handed: list[float] = []
    dropped: list[bool] = []
    if fps is None:
        for k, item in enumerate(items):
            arrived.append(clock.now())
            one(k, item)
            handed.append(clock.now())
            dropped.append(False)
        return StreamTimes(None, arrived, handed, dropped)
    source = at_rate(enumerate(items), fps, clock=clock)
    for (k, item), at, _ in newest(source):
        start = at - k / fps  # when the stream began: item k arrives at start + k / fps
        for j in range(len(arrived), k):  # the items this one replaced
            arrived.append(source.arrival(j, start))
            handed.append(math.nan)
            dropped.append(True)
        one(k, item)
        arrived.append(at)
        handed.append(clock.now())
        dropped.append(False)
    return StreamTimes(fps, arrived, handed, dropped)


def pipelined(executor: str, depth: int) -> LiveContender:
    """``Pipeline(model, depth, executor=executor)``, one torch thread per stage (and in the
    caller), learning as the setting says with the bench's loss and the setting's optimizer."""

    @contextmanager
    def open_(setting: Setting) -> Iterator[Live]:
        learning: dict[str, Any] = {}
        if setting.learning:
            learning = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=setting.optimizer)
        options = dict(executor=executor, sample=setting.xs[0], threads=1, **learning)
        # One thread here too: the layers are then profiled as the stages run them, and the
        # caller, which only hands frames in and takes results out, leaves the cores to the stages.
        with torch_threads(1), Pipeline(setting.model, depth, **options) as pipe:
            targets = setting.ys

            def run(fps: float | None) -> StreamTimes:
                source = iter(setting.xs) if fps is None else at_rate(setting.xs, fps)
                ys = None if targets is None else iter(targets)
                results = list(pipe.stream(source, ys, when_behind="wait" if fps is None else "drop"))
                arrived = [r.offered_at for r in results]
                handed = [math.nan if r.dropped else r.handed_at for r in results]
                return StreamTimes(fps, arrived, handed, [r.dropped for r in results])

            yield Live(run, pipe.partition)

    return LiveContender(f"{executor} D={depth}", "pipeline", depth, 1, open_, executor)

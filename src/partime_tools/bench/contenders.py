"""The contenders of ``partime bench --sizes``: each way of running one stream, ready to be timed in rounds.

A contender is opened once per frame size and mode (its processes or threads start, a pipeline
chooses its cut) and then run once per round; a run streams the whole ``Setting`` and returns
when each sample was offered and when its result was handed out (a ``Timing``). The contenders:

- ``sequential(threads)``: the plain model, one sample at a time, with ``threads`` torch threads;
- ``replicas(depth)``: ``depth`` copies of the model in as many processes, frames dealt
  round-robin (``bench_peers.Replicas``; inference only);
- ``pipeline(kind, depth)``: ``partime.Pipeline`` at ``depth`` stages, as ``kind`` builds it;
- ``own_tick(partition, stage)``: one stage of a pipeline's cut, alone in this process, on its
  own inputs, doing the work of its tick as partime's own ``Stage`` does it: the slowest stage is
  *partime's own tick* of that cut, what a pipeline of it would take per sample with nothing but
  its hops to add;
- ``bench_bound.piece_alone(partition, stage)``: the model's own piece of that stage with plain
  torch, no partime around it: the slowest piece is the *bound* of the cut.
- ``floor.python_floor(name, partition)``: the simplest Python pipeline of that cut
  (``benchmarks/python_floor.py``), the *floor* partime's pipelines should beat.

A learning contender learns with the setting's optimizer (``Setting.optimizer``).
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from partime import Partition, Pipeline
from partime.internals import (
    DEFAULT_GRAD_MODE,
    Stage,
    StageConfig,
    as_tensors,
    check_compensation,
    fused,
    layers_of,
    torch_threads,
)

from .latency import Offered
from .peers import Replicas
from .runner import OptimizerFactory, plain_step, sgd

T = TypeVar("T")

STAGE_INPUTS = 8
"""How many distinct inputs a stage alone cycles through (its time does not depend on their values)."""


@dataclass(frozen=True)
class Setting:
    """What each contender of one size and mode streams: a model, its frames (and targets when
    learning, with ``optimizer``, and the grad mode ``grad_mode`` that the pipelines and partime's
    own tick learn with), and how many results a run times (``results``; the frames go a little
    further). ``layers`` are the model's layers as a pipeline cuts them (itself, or its traced
    segments)."""

    model: nn.Module
    xs: Tensor
    ys: Tensor | None
    results: int
    optimizer: OptimizerFactory = sgd
    grad_mode: str = DEFAULT_GRAD_MODE
    layers: nn.Sequential = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", layers_of(self.model))

    @property
    def learning(self) -> bool:
        return self.ys is not None


@dataclass(frozen=True)
class Timing:
    """When each of the ``results`` samples of a run was offered and when its result was handed out."""

    offered_at: list[float]
    handed_at: list[float]


@dataclass(frozen=True)
class Opened:
    """An opened contender: ``run()`` streams its setting once; a pipeline has the cut it chose."""

    run: Callable[[], Timing]
    partition: Partition | None = None


@dataclass(frozen=True)
class Contender:
    """A way to run the stream: its name in the report, its kind (``sequential``, ``replicas``,
    ``pipeline``, ``own tick`` or ``bound``), its depth (0: one process), the torch threads it computes with,
    whether it only infers, and how to open it on a ``Setting``."""

    name: str
    kind: str
    depth: int
    threads: int
    open: Callable[[Setting], AbstractContextManager[Opened]]
    inference_only: bool = False
    executor: str | None = None


@dataclass(frozen=True)
class PipelineKind:
    """How one pipeline contender is built: ``Pipeline(model, balance=D, executor=executor,
    sample=..., threads=1, **options)`` (``options`` may replace ``balance``)."""

    name: str
    executor: str
    options: Mapping[str, Any] = field(default_factory=dict)


def sequential(threads: int) -> Contender:
    """The plain model (a copy), one sample at a time, with ``threads`` torch threads."""

    @contextmanager
    def open_(setting: Setting) -> Iterator[Opened]:
        one = plain_step(copy.deepcopy(setting.model), setting.ys, setting.optimizer)

        def run() -> Timing:
            with torch_threads(threads):
                return time_calls(setting.xs, setting.results, one)

        yield Opened(run)

    plural = "s" if threads > 1 else ""
    return Contender(f"sequential {threads} thread{plural}", "sequential", 0, threads, open_)


def replicas(depth: int) -> Contender:
    """``depth`` copies of the model in ``depth`` processes of one torch thread each (inference)."""

    @contextmanager
    def open_(setting: Setting) -> Iterator[Opened]:
        with torch_threads(1), Replicas(setting.model, depth, setting.xs[0]) as peers:
            yield Opened(lambda: time_stream(setting, peers.stream))

    return Contender(f"replicas D={depth}", "replicas", depth, 1, open_, inference_only=True)


def pipeline(kind: PipelineKind, depth: int) -> Contender:
    """``partime.Pipeline`` of ``depth`` stages (one torch thread each) built as ``kind`` says; named
    by ``kind`` and the depth, or by ``kind`` alone where its options give the balance."""

    @contextmanager
    def open_(setting: Setting) -> Iterator[Opened]:
        learning: dict[str, Any] = {}
        if setting.learning:
            learning = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=setting.optimizer, grad_mode=setting.grad_mode)
        options = dict(balance=depth, executor=kind.executor, sample=setting.xs[0], threads=1, **learning)
        # One thread here too: the layers are then profiled as the stages run them, and the
        # caller, which only copies samples in and results out, leaves the cores to the stages.
        with torch_threads(1), Pipeline(setting.model, **{**options, **kind.options}) as pipe:
            if pipe.partition is None:
                raise RuntimeError(f"pipeline {kind.name!r} has no partition, though it was given a sample")
            targets = setting.ys

            def stream(offered: Offered[Tensor]) -> Iterator[Any]:
                return pipe.stream(offered, None if targets is None else iter(targets))

            yield Opened(lambda: time_stream(setting, stream), pipe.partition)

    name = kind.name if "balance" in kind.options else f"{kind.name} D={depth}"  # its own balance: its own depth
    return Contender(name, "pipeline", depth, 1, open_, executor=kind.executor)


def own_tick(name: str, partition: Partition, stage: int) -> Contender:
    """Stage ``stage`` of ``partition`` (a copy of its layers), alone, with one torch thread, doing
    what that stage does at each tick of the pipeline in a steady stream: partime's own ``Stage``
    with the pipeline's defaults, a forward per input and, when learning, the product of the
    gradient of the sample ``2 (D - 1 - stage)`` ticks older (a fixed output gradient; at the last
    stage, the loss of the sample just run) and the step of the setting's optimizer, with what
    the setting's grad mode keeps for the product and the delay's compensation, as in the pipeline."""
    start, stop = partition.bounds[stage]
    last, delay = stage == partition.depth - 1, 2 * (partition.depth - 1 - stage)

    @contextmanager
    def open_(setting: Setting) -> Iterator[Opened]:
        ys = setting.ys
        learning: dict[str, Any] = {}
        if ys is not None:
            learning = dict(
                loss_fn=nn.CrossEntropyLoss(), optimizer=setting.optimizer, grad_mode=setting.grad_mode, supervised=True
            )
        config = StageConfig(partition.depth, compensation=check_compensation("auto"), **learning)
        layers = copy.deepcopy(setting.layers)  # running them here changes no BatchNorm of the model
        (module,) = fused([layers[start:stop]])  # as the pipeline builds its stage (a traced run: one module)
        alone = Stage(stage, module, config)
        count = min(STAGE_INPUTS, len(setting.xs))
        with torch.no_grad():
            inputs = [layers[:start](x) for x in setting.xs[:count]]
            out = copy.deepcopy(module)(inputs[0])
        gen = torch.Generator().manual_seed(0)
        grads = tuple(torch.randn(t.shape, generator=gen) for t in as_tensors(out, f"stage {stage}'s output"))
        grad = grads if isinstance(out, tuple) else grads[0]
        ticks = itertools.count()  # the stage's own sample numbers, on across runs

        def one(i: int, x: Tensor) -> None:
            s = next(ticks)
            alone.forward(s, x)
            if ys is None:
                return
            if last:
                alone.learn(s, ys[i])
            elif s >= delay:
                alone.backward(s - delay, grad)

        def run() -> Timing:
            with torch_threads(1):
                return time_calls(itertools.islice(itertools.cycle(inputs), setting.results), setting.results, one)

        yield Opened(run)

    return Contender(name, "own tick", partition.depth, 1, open_)


def time_calls(items: Iterable[T], results: int, one: Callable[[int, T], None]) -> Timing:
    """``one(i, item)`` for the first ``results`` items, each offered and handed out in turn."""
    offered: Offered[T] = Offered(items)
    handed = []
    for i, x in zip(range(results), offered):
        one(i, x)
        handed.append(time.perf_counter())
    return Timing(offered.offered_at[:results], handed)


def time_stream(setting: Setting, stream: Callable[[Offered[Tensor]], Iterator[Any]]) -> Timing:
    """Stream every frame, noting when the first ``setting.results`` results come out; the rest
    (the tail, which keeps the draining stream out of the timing) is taken untimed."""
    offered: Offered[Tensor] = Offered(iter(setting.xs))
    results = stream(offered)
    handed = []
    for _ in range(setting.results):
        next(results)
        handed.append(time.perf_counter())
    for _ in results:  # drain: the tail, and every gradient applied, before the next round
        pass
    return Timing(offered.offered_at[: setting.results], handed)

"""How much faster a stream goes through a pipeline than through the plain model (a benchmark).

``run_bench`` streams the same frames through ``Pipeline(model, D)`` for each depth D, for
inference and for online learning, and through the plain model one sample at a time (the
sequential baseline, with one torch thread and with every core). Each row reports the median
time per sample over a few blocks of the stream, measured once the workers run and a warm-up
is over. With ``compile``, each mode also has the plain model compiled (``torch.compile`` of the
whole model, in the plain loop) and each depth's pipeline with ``compile=True`` (each stage's forward
compiled in its worker); the compiling falls in the warm-up::

    results:  w w w … w | block 0 | block 1 | … | block 4 | tail (the pipeline drains)
              warm-up      median of the five per-sample times is the row's figure

The model (``models.conv_net``) follows the first experiment of PARTIME: a stack of 5x5
convolutions with 32 channels and ReLUs on small frames. It returns rows (dicts); printing is
the CLI's job. ``frames`` is the stream of the sweep over frame sizes (``sweep``, ``partime
bench --sizes``).
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from partime import ExecutorName, Partition, Pipeline

from .clocks import cpu_clocks, others_busy
from .hop import measure_hop
from .models import conv_net

log = logging.getLogger(__name__)

MODES = ("inference", "learning")
CLASSES = 10
LR = 1e-3

Progress = Callable[[str], None]
"""Called with a label as each configuration begins (for a progress display)."""


def frames(size: int, count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The bench's stream: ``count`` batch-1 RGB frames (``count`` x 1 x 3 x ``size`` x ``size``,
    standard normal) and a random label of ``CLASSES`` for each (``count`` x 1), from ``seed`` alone."""
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(count, 1, 3, size, size, generator=gen)
    return xs, torch.randint(0, CLASSES, (count, 1), generator=gen)


OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
"""How the bench gives an optimizer: a factory of parameters, as ``Pipeline`` takes it."""


def sgd(params: Any) -> torch.optim.Optimizer:
    """The bench's default optimizer: plain SGD at ``LR``."""
    return torch.optim.SGD(params, lr=LR)


def adam(params: Any) -> torch.optim.Optimizer:
    """The bench's other optimizer: Adam at ``LR``, torch's other defaults."""
    return torch.optim.Adam(params, lr=LR)


OPTIMIZERS: dict[str, OptimizerFactory] = {"sgd": sgd, "adam": adam}
"""The optimizers the bench learns with, by name (``--optimizer``); ``sgd`` is the default."""


def optimizer_named(name: str) -> OptimizerFactory:
    """The factory of ``OPTIMIZERS`` called ``name``, or a ValueError naming the choices."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def plain_step(
    model: nn.Module, ys: torch.Tensor | None, optimizer: OptimizerFactory = sgd, compiled: bool = False
) -> Callable[[int, torch.Tensor], None]:
    """The plain model's work on sample ``i``, ``x``: a forward without gradients (``ys`` None), or
    a forward, the loss against ``ys[i]``, a backward and a step of ``optimizer``; ``compiled``: the
    forward of ``torch.compile(model, dynamic=False)`` (the shapes of a stream do not change)."""
    forward: Callable[[torch.Tensor], torch.Tensor] = torch.compile(model, dynamic=False) if compiled else model
    if ys is None:

        def infer(i: int, x: torch.Tensor) -> None:
            with torch.no_grad():
                forward(x)

        return infer
    loss_fn, step = nn.CrossEntropyLoss(), optimizer(model.parameters())

    def learn(i: int, x: torch.Tensor) -> None:
        step.zero_grad()
        loss_fn(forward(x), ys[i]).backward()
        step.step()

    return learn


def run_bench(
    *,
    executor: str = "process",
    samples: int = 300,
    depths: Sequence[int] = (1, 2, 3, 4),
    size: int = 32,
    layers: int = 12,
    channels: int = 32,
    modes: Sequence[str] = MODES,
    warmup: int = 20,
    blocks: int = 5,
    seed: int = 0,
    optimizer: str = "sgd",
    progress: Progress | None = None,
    compile: bool = False,
) -> list[dict[str, Any]]:
    """One row per mode and configuration: the sequential baselines, then each depth in ``depths``.

    Every configuration runs a copy of the same seeded model on the same ``samples`` frames
    (batch 1, 3 x ``size`` x ``size``; random labels when learning, with the optimizer
    ``OPTIMIZERS`` calls ``optimizer``, named in each learning row's ``optimizer``), timed after
    ``warmup`` results. ``ms_per_sample`` is the median over ``blocks`` blocks of the per-sample time; a
    speed-up is a baseline's ``ms_per_sample`` over the row's. A pipeline row has its partition
    and the profiled time of each stage (``stage_ms``, ``max_stage_ms``). Every row carries the
    per-hop transfer cost (median, microseconds) of a 64 KB payload and of one activation,
    measured once per call, and ``others_busy``: the fraction of the machine's CPUs that other
    processes kept busy while the row was timed (``hop_others_busy``: while the hops were; None
    where that cannot be known), since they skew every figure. With ``compile``, the rows of the
    compiled plain model and of ``Pipeline(..., compile=True)`` follow the uncompiled ones, with
    ``compiled`` True (False in the others); every speed-up is over the uncompiled baselines.
    """
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    if samples < blocks or blocks < 1 or warmup < 0:
        raise ValueError(
            f"need samples >= blocks >= 1 and warmup >= 0, got samples={samples}, blocks={blocks}, warmup={warmup}"
        )
    if not depths or any(d < 1 or d > layers + 1 for d in depths):
        raise ValueError(f"depths must be from 1 to layers + 1 = {layers + 1}, got {list(depths)}")
    factory = optimizer_named(optimizer)
    report = progress or (lambda label: None)
    activation_bytes = channels * size * size * 4
    report("hop cost")
    cores = os.cpu_count() or 1
    clocks = cpu_clocks()
    hops: dict[str, float | None] = {
        "hop_64kb_us": measure_hop(65536)["hop_us_median"],
        "hop_activation_us": measure_hop(activation_bytes)["hop_us_median"],
        "activation_bytes": activation_bytes,
    }
    hops["hop_others_busy"] = others_busy(clocks, cores)
    # the tail keeps the draining pipeline out of the timing
    xs, ys = frames(size, warmup + samples + max(depths), seed)
    rows: list[dict[str, Any]] = []
    for mode in modes:
        learning = mode == "learning"
        model = conv_net(layers, channels, classes=CLASSES if learning else None, seed=seed)
        targets = ys if learning else None
        timing: dict[str, Any] = dict(samples=samples, warmup=warmup, blocks=blocks, optimizer=factory)
        base = {}
        for compiled in (False, True) if compile else (False,):
            label = " compiled" if compiled else ""
            for threads in sorted({1, cores}):
                report(f"{mode}: sequential{label}, {threads} thread{'s' if threads > 1 else ''}")
                clocks = cpu_clocks()
                ms = time_sequential(copy.deepcopy(model), xs, targets, threads, compile=compiled, **timing)
                if not compiled:
                    base[threads] = ms
                rows.append(
                    dict(
                        mode=mode,
                        depth=0,
                        executor=f"sequential{label} ({threads} thr)",
                        threads=threads,
                        compiled=compiled,
                        ms_per_sample=ms,
                        others_busy=others_busy(clocks, cores),
                    )
                )
            for depth in depths:
                report(f"{mode}: D={depth}, {executor}{label}")
                clocks = cpu_clocks()
                ms, partition = time_pipeline(
                    copy.deepcopy(model), depth, executor, xs, targets, compile=compiled, **timing
                )
                times = partition.stage_times or ()
                rows.append(
                    dict(
                        mode=mode,
                        depth=depth,
                        executor=executor,
                        threads=1,
                        compiled=compiled,
                        ms_per_sample=ms,
                        others_busy=others_busy(clocks, cores),
                        partition=str(partition),
                        balance=list(partition.balance),
                        stage_ms=[t * 1e3 for t in times],
                        max_stage_ms=max(times) * 1e3 if times else None,
                    )
                )
        for row in rows:
            if row["mode"] == mode:
                row.update(
                    optimizer=optimizer if learning else None,
                    speedup_vs_seq_1thread=base[1] / row["ms_per_sample"],
                    speedup_vs_seq_allcores=base[cores] / row["ms_per_sample"],
                    samples=samples,
                    size=size,
                    layers=layers,
                    channels=channels,
                    **hops,
                )
    return rows


def median_ms(stamps: Sequence[float], warmup: int, blocks: int) -> float:
    """Median over ``blocks`` blocks of the ms per call from ``stamps[warmup]`` to the last stamp,
    ``stamps`` being the clock read after each call."""
    samples = len(stamps) - 1 - warmup
    if samples < blocks:
        raise ValueError(
            f"{blocks} blocks need {blocks} timed samples, got {samples} ({len(stamps)} stamps, warmup {warmup})"
        )
    cuts = [warmup + samples * k // blocks for k in range(blocks + 1)]
    per_block = [(stamps[b] - stamps[a]) * 1e3 / (b - a) for a, b in itertools.pairwise(cuts)]
    log.debug("ms per sample by block: %s", per_block)
    return statistics.median(per_block)


def time_sequential(
    model: nn.Sequential,
    xs: torch.Tensor,
    ys: torch.Tensor | None,
    threads: int,
    *,
    samples: int,
    warmup: int,
    blocks: int,
    optimizer: OptimizerFactory = sgd,
    compile: bool = False,
) -> float:
    """Median ms per sample of the plain model, one sample at a time, with ``threads`` threads
    (learning from ``ys`` with ``optimizer``, unless ``ys`` is None); with ``compile``, of
    ``torch.compile(model, dynamic=False)``, compiled afresh at its first sample (in the warm-up)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if compile:
            torch._dynamo.reset()  # afresh: what compiled before counts towards dynamo's recompile limit
        step = plain_step(model, ys, optimizer, compiled=compile)

        def one(i: int) -> None:
            step(i, xs[i])

        return median_ms(_stamps(one, warmup + samples + 1), warmup, blocks)
    finally:
        torch.set_num_threads(before)


def time_pipeline(
    model: nn.Sequential,
    depth: int,
    executor: str,
    xs: torch.Tensor,
    ys: torch.Tensor | None,
    *,
    samples: int,
    warmup: int,
    blocks: int,
    optimizer: OptimizerFactory = sgd,
    compile: bool = False,
) -> tuple[float, Partition]:
    """Median ms per sample of ``Pipeline(model, depth, compile=compile)`` streaming ``xs`` (learning
    from ``ys`` with ``optimizer``, unless ``ys`` is None), and its partition."""
    learning: dict[str, Any] = {} if ys is None else dict(loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)
    before = torch.get_num_threads()
    # One thread here too: the layers are then profiled as the stages run them, and the caller,
    # which only copies samples in and results out, leaves the cores to the stages.
    torch.set_num_threads(1)
    try:
        # a name from the command line, as typed: the Pipeline refuses an unknown one with a ValueError
        name = cast(ExecutorName, executor)
        if compile:
            torch._dynamo.reset()  # afresh, as the stage processes do: the last stage compiles here
        with Pipeline(model, depth, executor=name, sample=xs[0], threads=1, compile=compile, **learning) as pipe:
            results = pipe.stream(iter(xs), None if ys is None else iter(ys))
            stamps = _stamps(lambda i: next(results), warmup + samples + 1)
            for _ in results:  # drain: the tail, and every gradient applied, before the pipe closes
                pass
            if pipe.partition is None:
                raise RuntimeError("the pipeline has no partition, though it was given a sample")
            return median_ms(stamps, warmup, blocks), pipe.partition
    finally:
        torch.set_num_threads(before)


def _stamps(one: Callable[[int], Any], n: int) -> list[float]:
    """The clock after each of ``n`` calls ``one(0)``, ``one(1)``, ..."""
    stamps = []
    for i in range(n):
        one(i)
        stamps.append(time.perf_counter())
    return stamps

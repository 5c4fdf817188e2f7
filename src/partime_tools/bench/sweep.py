"""Every contender over a sweep of frame sizes, interleaved in one run: ``partime bench --sizes``.

For each frame size and mode (learning: once per optimizer asked for), every contender
(``bench_contenders``) is opened once, then timed in ``rounds`` rounds that alternate them; each
round starts one contender later than the one before, so that none always runs first or right
after the same neighbour::

    round 0:  seq 1 | seq all | replicas | process | thread | piece 0 | piece 1 | tick 0 | tick 1 | floor
    round 1:  seq all | replicas | process | thread | piece 0 | piece 1 | tick 0 | tick 1 | floor | seq 1
    one run:  results  w w … w | block 0 | block 1 | … | block 4 | tail (untimed: the stream drains)

A contender's ``ms_per_sample`` is the median over rounds of the median ms per sample of
``blocks`` blocks after ``warmup`` results (``bench.median_ms``); its latencies are the
percentiles over the timed samples of every round (``bench_latency``). Each distinct cut the
pipelines chose has two figures, each stage of the cut timed alone in the same rounds:

- its *bound*: the slowest of the model's own pieces of the cut, run with plain torch, one forward
  per sample (``bench_bound``);
- *partime's own tick*: the slowest stage as partime's own ``Stage`` runs it, what its grad mode
  keeps for the product and the compensation included (``bench_contenders.own_tick``).

A cut of two stages or more also has its *Python floor*, timed in the same rounds: the simplest
Python pipeline of that cut (``floor.python_floor``), left out where ``floor.left_out`` says why.

It returns rows (dicts); printing and plotting are the CLI's job.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from typing import Any

from partime import GRAD_MODES, Partition
from partime.internals import DEFAULT_GRAD_MODE, keep_freed_memory

from .bound import piece_alone
from .clocks import cpu_clocks, others_busy
from .contenders import Contender, Opened, PipelineKind, Setting, Timing, own_tick, pipeline, replicas, sequential
from .floor import KIND as FLOOR
from .floor import left_out, python_floor
from .hop import measure_hop
from .latency import latencies
from .models import MODELS
from .runner import CLASSES, MODES, OPTIMIZERS, Progress, frames, median_ms, optimizer_named

log = logging.getLogger(__name__)

SIZES = (12, 24, 48, 72, 96)
"""The default sweep of frame sizes: with the default ``conv3_net`` at D = 2, from stages short enough
for a tick's own cost to matter to stages long enough for a pipeline to pay off (96x96 frames:
activations of 880 KB). Stage times measured: experiments/measured-and-not-kept.md."""

DEPTHS = (2,)
"""The default pipeline depths (and number of replicas) of the sweep."""

PIPELINES = (
    PipelineKind("process", "process"),
    PipelineKind("thread", "thread"),
    PipelineKind("process auto", "process", {"balance": "auto"}),
)
"""The pipeline contenders, in the order of the report (one more is one more line here): each
executor at each depth of the sweep, and the process executor with ``balance="auto"``, which
chooses its depth (up to the cores) and falls back to the model alone where no pipeline is faster.
Each has one torch thread per stage: the caller that hosts a stage keeps that stage's thread count
while the pipeline is open, so two pipelines open at once at other counts would slow each other.
The one stage ``auto`` falls back to has one thread too, as has the plain model it is measured
against."""


def contenders(depths: Sequence[int], cores: int, pipelines: Sequence[PipelineKind] = PIPELINES) -> list[Contender]:
    """Sequential with one torch thread and with ``cores``, then at each depth the replicas and
    each pipeline of ``pipelines`` (the bounds and own ticks are added once the pipelines have
    chosen their cuts)."""
    chosen = [sequential(threads) for threads in sorted({1, cores})]
    for depth in depths:
        chosen.append(replicas(depth))
        # a pipeline that is given its own balance (as "auto") is the same at every depth: once
        chosen += [pipeline(kind, depth) for kind in pipelines if "balance" not in kind.options or depth == depths[0]]
    return chosen


def groups(modes: Sequence[str], optimizers: Sequence[str]) -> list[tuple[str, str | None]]:
    """The interleaved runs of one frame size, in order: ``(mode, optimizer)``, inference once (no
    optimizer), learning once per optimizer of ``optimizers``."""
    runs: list[tuple[str, str | None]] = []
    for mode in modes:
        runs += [(mode, name) for name in optimizers] if mode == "learning" else [(mode, None)]
    return runs


def sweep_steps(sizes: Sequence[int], modes: Sequence[str], rounds: int, optimizers: Sequence[str] = ("sgd",)) -> int:
    """How many times ``run_sweep`` calls its ``progress`` (for a progress bar's total)."""
    return 1 + len(sizes) * (1 + len(groups(modes, optimizers)) * (1 + rounds))


def round_order(names: Sequence[str], rounds: int) -> Iterator[list[str]]:
    """The order of ``names`` in each of ``rounds`` rounds: each round starts one name later."""
    for r in range(rounds):
        start = r % len(names)
        yield [*names[start:], *names[:start]]


def run_sweep(
    *,
    model: str = "conv",
    sizes: Sequence[int] = SIZES,
    depths: Sequence[int] = DEPTHS,
    pipelines: Sequence[PipelineKind] = PIPELINES,
    layers: int = 8,
    channels: int = 24,
    modes: Sequence[str] = MODES,
    optimizers: Sequence[str] = ("sgd",),
    grad_mode: str = DEFAULT_GRAD_MODE,
    samples: int = 300,
    warmup: int = 20,
    blocks: int = 5,
    rounds: int = 5,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """One row per size, mode (learning: per optimizer of ``optimizers``, names of
    ``bench.OPTIMIZERS``, the pipelines and partime's own tick under ``grad_mode``) and contender,
    on ``conv3_net(layers, channels)`` (with a head of ``CLASSES`` logits when learning), or the
    model ``bench_models.MODELS`` names ``model`` (``"resnet"``: a ResNet-style network, which
    partime traces), and the same seeded frames (batch 1, 3 x size x size).

    Every row has the contender's ``ms_per_sample`` (and ``ms_per_round``), ``latency_p50_ms`` and
    ``latency_p99_ms``, its speed-ups over sequential with one thread and with every core
    (``speedup_vs_seq_1thread``, ``speedup_vs_seq_allcores``), ``optimizer`` and ``grad_mode``
    (None in inference), ``bound_stage_ms`` (the bound of the first pipeline at the first depth:
    the x of the plot), the per-hop cost of 64 KB and of one activation, and ``others_busy`` (the
    fraction of the CPUs that other processes kept busy during the interleaved run of its size
    and mode). A
    pipeline row has its cut (``partition``, ``balance``, the predicted ``stage_ms``), its cut's
    bound (``bound``: the row's name, ``bound_ms``, ``ms_over_bound``) and partime's own tick of
    it (``own_tick``, ``own_tick_ms``, ``ms_over_own_tick``), and the Python floor of it (``floor``,
    ``floor_ms``, ``ms_over_floor``; None where the floor is left out or the cut has one stage). A
    row of kind ``bound`` or ``own tick`` has each stage's ``stage_alone_ms``, its ``slowest_stage``
    and the ``pipelines`` that chose its cut; its ``ms_per_sample`` is its slowest stage's. A row
    of kind ``python floor`` has its cut and ``pipelines``. Every row has ``floor_left_out``: why
    the floor is left out (one line), or None.
    """
    # Every contender computes with the allocator partime gives its stages (``malloc.py``): the
    # sequential model too, and the replicas, rather than a sequential model taxed by page faults.
    keep_freed_memory()
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    if samples < blocks or blocks < 1 or warmup < 0 or rounds < 1:
        raise ValueError(
            f"need samples >= blocks >= 1, warmup >= 0 and rounds >= 1, "
            f"got samples={samples}, blocks={blocks}, warmup={warmup}, rounds={rounds}"
        )
    if not sizes or min(sizes) < 1:
        raise ValueError(f"give one or more frame sizes of at least 1, got {list(sizes)}")
    if not depths or any(d < 1 or d > layers + 1 for d in depths):
        raise ValueError(f"depths must be from 1 to layers + 1 = {layers + 1}, got {list(depths)}")
    if not pipelines:
        raise ValueError("give at least one pipeline contender")
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    if grad_mode not in GRAD_MODES:
        raise ValueError(f"unknown grad mode {grad_mode!r}; choose one of {', '.join(GRAD_MODES)}")
    if not optimizers or len(set(optimizers)) < len(optimizers):
        raise ValueError(f"give one or more distinct optimizers of {', '.join(OPTIMIZERS)}, got {list(optimizers)}")
    learners = {name: optimizer_named(name) for name in optimizers}
    factory = MODELS[model]
    report = progress or (lambda label: None)
    cores = os.cpu_count() or 1
    chosen = contenders(depths, cores, pipelines)
    report("hop cost of 64 KB")
    common: dict[str, Any] = dict(
        model=factory.__name__, layers=layers, channels=channels, samples=samples, warmup=warmup, blocks=blocks
    )
    common.update(rounds=rounds, cores=cores, hop_64kb_us=measure_hop(65536)["hop_us_median"])
    rows: list[dict[str, Any]] = []
    for size in sizes:
        report(f"{size}x{size}: hop cost of one activation")
        activation_bytes = channels * size * size * 4
        clocks = cpu_clocks()
        hop = measure_hop(activation_bytes)["hop_us_median"]
        at_size: dict[str, Any] = dict(size=size, activation_bytes=activation_bytes, hop_activation_us=hop)
        at_size["hop_others_busy"] = others_busy(clocks, cores)
        # the tail keeps the draining streams out of the timing: replicas pull up to 2 D - 1 ahead
        xs, ys = frames(size, warmup + samples + 1 + 2 * max(depths) + 2, seed)
        for mode, optimizer in groups(modes, optimizers):
            net = factory(layers, channels, classes=None if optimizer is None else CLASSES, seed=seed)
            if optimizer is None:
                setting, label = Setting(net, xs, None, warmup + samples + 1), f"{size}x{size} {mode}"
            else:
                setting = Setting(net, xs, ys, warmup + samples + 1, learners[optimizer], grad_mode)
                label = f"{size}x{size} {mode} ({optimizer})"
            clocks = cpu_clocks()
            mine = [c for c in chosen if not (setting.learning and c.inference_only)]
            floor_left_out = left_out(setting.model)  # the model as given: a traced one is left out
            found = _interleaved(setting, mine, rounds, (warmup, blocks), label, report, floor_left_out is None)
            busy = others_busy(clocks, cores)
            found = [
                dict(
                    mode=mode,
                    optimizer=optimizer,
                    grad_mode=None if optimizer is None else grad_mode,
                    **at_size,
                    **common,
                    **row,
                    others_busy=busy,
                    floor_left_out=floor_left_out,
                )
                for row in found
            ]
            rows += _compared(found, cores)
    return rows


def _interleaved(
    setting: Setting,
    chosen: list[Contender],
    rounds: int,
    timing: tuple[int, int],
    label: str,
    report: Progress,
    with_floor: bool,
) -> list[dict[str, Any]]:
    """Open every contender and the stages of each distinct cut (and, ``with_floor``, its Python
    floor), time them in alternating rounds, and return a row per contender, bound, own tick and
    floor (before the comparisons); ``timing`` is ``(warmup, blocks)``. Every contender is closed on
    leaving, also on an error."""
    with ExitStack() as stack:
        report(f"{label}: starting {len(chosen)} contenders")
        opened: dict[str, Opened] = {c.name: stack.enter_context(c.open(setting)) for c in chosen}
        bounds = _bounds(chosen, opened, with_floor)
        for _, stages in bounds.values():
            opened.update((s.name, stack.enter_context(s.open(setting))) for s in stages)
        runs: dict[str, list[Timing]] = {name: [] for name in opened}
        for r, order in enumerate(round_order(list(opened), rounds)):
            report(f"{label}: round {r + 1} of {rounds}")
            for name in order:
                runs[name].append(opened[name].run())
        partitions = {name: o.partition for name, o in opened.items() if o.partition is not None}
    return _rows(chosen, bounds, partitions, {name: _figures(timings, *timing) for name, timings in runs.items()})


Bounds = dict[str, tuple[Partition, list[Contender]]]
"""The figures of each distinct cut the pipelines chose, by their rows' names: the cut and its
contenders (its stages alone, pieces of kind ``bound`` or stages of kind ``own tick``; or the one
pipeline of kind ``python floor``)."""

FIGURES = {"bound": "bound", "own tick": "own_tick", FLOOR: "floor"}
"""The figures a cut has (a row kind), and the prefix of its keys in a pipeline's row."""

PER_STAGE = ("bound", "own tick")
"""The figures timed stage by stage, their slowest stage's time being the cut's."""


def _bounds(chosen: list[Contender], opened: dict[str, Opened], with_floor: bool) -> Bounds:
    """The bound and own tick of each distinct cut that the opened pipelines of ``chosen`` chose,
    and, ``with_floor``, the Python floor of each such cut of two stages or more."""
    bounds: Bounds = {}
    seen: set[tuple[int, ...]] = set()
    for c in chosen:
        partition = opened[c.name].partition
        if c.kind != "pipeline" or partition is None or partition.balance in seen:
            continue
        seen.add(partition.balance)
        # another cut at this depth: its figures are named by the pipeline that chose it
        suffix = f" ({c.name})" if f"bound D={partition.depth}" in bounds else ""
        for kind, (alone, part) in {"bound": (piece_alone, "piece"), "own tick": (own_tick, "stage")}.items():
            name = f"{kind} D={partition.depth}{suffix}"
            bounds[name] = (partition, [alone(f"{name}: {part} {i}", partition, i) for i in range(partition.depth)])
        if with_floor and partition.depth > 1:
            name = f"{FLOOR} D={partition.depth}{suffix}"
            bounds[name] = (partition, [python_floor(name, partition)])
    return bounds


def _rows(
    chosen: list[Contender], bounds: Bounds, partitions: dict[str, Partition], figures: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """A row per contender, then one per bound, own tick and floor; a pipeline's row names those of its cut."""
    bound_rows: list[dict[str, Any]] = []
    figure_of: dict[tuple[str, tuple[int, ...]], tuple[str | None, float | None]] = {}
    for name, (partition, stages) in bounds.items():
        kind = stages[0].kind
        alone = [figures[s.name] for s in stages]
        slowest = max(range(len(alone)), key=lambda i: alone[i]["ms_per_sample"])
        figure_of[kind, partition.balance] = name, alone[slowest]["ms_per_sample"]
        row = dict(
            contender=name,
            kind=kind,
            depth=partition.depth,
            threads=1,
            executor=None,
            **alone[slowest],
            partition=str(partition),
            balance=list(partition.balance),
            pipelines=[
                c.name for c in chosen if c.name in partitions and partitions[c.name].balance == partition.balance
            ],
        )
        if kind in PER_STAGE:
            row.update(stage_alone_ms=[f["ms_per_sample"] for f in alone], slowest_stage=slowest)
        bound_rows.append(row)
    contender_rows = []
    for c in chosen:
        row = dict(contender=c.name, kind=c.kind, depth=c.depth, threads=c.threads, executor=c.executor)
        row.update(figures[c.name])
        cut = partitions.get(c.name)
        if cut is not None:
            times = cut.stage_times
            row.update(
                depth=cut.depth,  # as many stages as it chose (balance="auto" chooses the depth too)
                partition=str(cut),
                balance=list(cut.balance),
                stage_ms=None if times is None else [t * 1e3 for t in times],
                max_stage_ms=None if times is None else max(times) * 1e3,
            )
            for kind, key in FIGURES.items():
                figure, ms = figure_of.get((kind, cut.balance), (None, None))  # no floor: left out, or one stage
                row.update(
                    {key: figure, f"{key}_ms": ms, f"ms_over_{key}": None if ms is None else row["ms_per_sample"] / ms}
                )
        contender_rows.append(row)
    return contender_rows + bound_rows


def _compared(rows: list[dict[str, Any]], cores: int) -> list[dict[str, Any]]:
    """The rows of one size and mode, each with its speed-ups and the size's ``bound_stage_ms`` (the
    first bound's)."""
    base = {row["threads"]: row["ms_per_sample"] for row in rows if row["kind"] == "sequential"}
    stage_ms = next(row["ms_per_sample"] for row in rows if row["kind"] == "bound")
    for row in rows:
        row.update(
            speedup_vs_seq_1thread=base[1] / row["ms_per_sample"],
            speedup_vs_seq_allcores=base[cores] / row["ms_per_sample"],
            bound_stage_ms=stage_ms,
        )
    return rows


def _figures(timings: list[Timing], warmup: int, blocks: int) -> dict[str, Any]:
    """A contender's figures from its runs, one per round: see the module."""
    per_round = [median_ms(t.handed_at, warmup, blocks) for t in timings]
    timed = slice(warmup + 1, None)  # the samples whose results were handed out in the timed blocks
    wait = latencies(
        [o for t in timings for o in t.offered_at[timed]], [h for t in timings for h in t.handed_at[timed]]
    )
    return dict(
        ms_per_sample=statistics.median(per_round),
        ms_per_round=per_round,
        latency_p50_ms=wait["p50_ms"],
        latency_p99_ms=wait["p99_ms"],
    )

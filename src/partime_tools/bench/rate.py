"""How fast a live source each way of running the stream keeps up with: ``partime bench --rate``.

On the bench's model (``bench.conv_net``: a stem and 12 blocks of 5x5 convolution, 32 channels,
on batch-1 frames of 32 x 32 by default), the contenders of ``bench_rate_contenders`` (the plain
model with one torch thread and with every core, the pipeline at each depth) are opened once, then
run one after the other in rounds, each round starting one contender later
(``bench_sweep.round_order``), in three parts:

1. recorded: each streams the frames as fast as it takes them; its ``ms_per_sample`` is the
   median over rounds of ``bench.median_ms``, and its inverse starts its search;
2. sustained (``rate=None``, ``--rate max``): in each round, the highest rate at which a run drops
   none of its timed frames (in one of two tries), each contender's search interleaved with the
   others' (``bench_rate_search``); ``sustained_fps`` is the median over rounds;
3. latency: runs at ``FRACTIONS`` of each contender's own sustained rate (or, ``--rate FPS``, at
   that rate for all), one of each per round: frames kept and dropped, and the p50 and p99
   latency of the kept frames over the timed frames of every round (``bench_latency``).

A run streams ``warmup`` frames, then the ``samples`` timed ones, then a tail that lets the
pipeline drain untimed; a frame's latency runs from its arrival on the source's clock to the
moment its result is handed out::

    frames:  w w … w | timed 0 … samples - 1 | tail

It returns rows (dicts); printing and plotting are the CLI's job.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from partime.internals import keep_freed_memory

from .clocks import cpu_clocks, others_busy
from .contenders import Setting
from .latency import latencies
from .models import conv_net
from .rate_contenders import Live, LiveContender, StreamTimes, pipelined, plain
from .rate_search import Probe, Search, sustained_rates
from .runner import CLASSES, Progress, frames, median_ms, optimizer_named
from .sweep import round_order

FRACTIONS = (0.5, 0.8, 0.95)
"""The rates of the latency runs of ``--rate max``, as fractions of each contender's sustained rate."""


def contenders(depths: Sequence[int], cores: int, executor: str = "process") -> list[LiveContender]:
    """The plain model with one torch thread and with ``cores``, then the pipeline at each depth."""
    return [plain(threads) for threads in sorted({1, cores})] + [pipelined(executor, d) for d in depths]


def run_rate(
    *,
    rate: float | None = None,
    depths: Sequence[int] = (2,),
    executor: str = "process",
    learning: bool = False,
    optimizer: str = "sgd",
    size: int = 32,
    layers: int = 12,
    channels: int = 32,
    samples: int = 300,
    warmup: int = 20,
    blocks: int = 5,
    rounds: int = 5,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """One row per contender and rate run (see the module), on ``conv_net(layers, channels)`` (with
    a head of ``CLASSES`` logits when ``learning``, which learns with the optimizer
    ``bench.OPTIMIZERS`` calls ``optimizer``) and the same seeded frames for all.

    Every row has the contender (``contender``, ``kind``, ``depth``, ``threads``, ``executor``; a
    pipeline its ``partition`` and ``balance``), its recorded ``ms_per_sample`` (and
    ``ms_per_round``), and for ``rate=None`` its ``sustained_fps`` (per round too, with the next
    rate up, which dropped, and every run of each search as ``[fps, drops]``; 0 where it dropped
    frames at every rate tried) and the ratios of that to the plain model's with one thread and
    with every core (None where theirs is 0); then the run's figures: ``fraction`` (of the
    sustained rate; None at a given ``rate``), ``offered_fps``, ``offered`` (timed frames, every
    round; 0, and None for the figures, where the sustained rate is 0), ``dropped``, ``kept_fps``
    (the offered rate times the share kept), ``latency_p50_ms`` and ``latency_p99_ms`` (None if
    none was kept) and ``p99_over_seq_ms``: the p99 over the recorded ms per sample of the plain
    model on one thread. ``others_busy`` is the fraction of the CPUs that other processes kept
    busy meanwhile.
    """
    # Every contender computes with the allocator partime gives its stages (``malloc.py``), as in the sweep.
    keep_freed_memory()
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number of frames per second above 0 (or None: search), got {rate}")
    if samples < blocks or blocks < 1 or warmup < 0 or rounds < 1:
        raise ValueError(
            f"need samples >= blocks >= 1, warmup >= 0 and rounds >= 1, "
            f"got samples={samples}, blocks={blocks}, warmup={warmup}, rounds={rounds}"
        )
    if not depths or any(d < 1 or d > layers + 1 for d in depths):
        raise ValueError(f"depths must be from 1 to layers + 1 = {layers + 1}, got {list(depths)}")
    report = progress or (lambda label: None)
    cores = os.cpu_count() or 1
    chosen = contenders(depths, cores, executor)
    xs, ys = frames(size, warmup + samples + 1 + 2 * max(depths) + 2, seed)  # the tail: the pipeline drains
    model = conv_net(layers, channels, classes=CLASSES if learning else None, seed=seed)
    setting = Setting(model, xs, ys if learning else None, warmup + samples, optimizer_named(optimizer))
    names = [c.name for c in chosen]
    clocks = cpu_clocks()
    with ExitStack() as stack:
        report(f"starting {len(chosen)} contenders")
        opened: dict[str, Live] = {c.name: stack.enter_context(c.open(setting)) for c in chosen}
        recorded: dict[str, list[float]] = {name: [] for name in names}
        for r, order in enumerate(round_order(names, rounds)):
            report(f"recorded stream, round {r + 1} of {rounds}")
            for name in order:
                recorded[name].append(median_ms(opened[name].run(None).handed[: warmup + samples + 1], warmup, blocks))
        ms = {name: statistics.median(per_round) for name, per_round in recorded.items()}
        searches: dict[str, list[Search]] = {name: [] for name in names}
        points: list[tuple[float | None, dict[str, float]]]
        if rate is None:
            starts = {name: 1e3 / ms[name] for name in names}  # as fast as it went on the recorded stream
            searches = _searched(opened, starts, rounds, (warmup, samples), report)
            sustained = {name: statistics.median(s.sustained for s in searches[name]) for name in names}
            points = [(f, {name: f * sustained[name] for name in names}) for f in FRACTIONS]
        else:
            points = [(None, dict.fromkeys(names, rate))]
        runs: dict[tuple[str, int], list[StreamTimes]] = {(name, p): [] for name in names for p in range(len(points))}
        for r, order in enumerate(round_order(names, rounds)):
            for p, (fraction, rates) in enumerate(points):
                at = "" if fraction is None else f" at {fraction:.0%} of each one's highest rate"
                report(f"latency{at}, round {r + 1} of {rounds}")
                for name in order:
                    if rates[name] > 0:  # 0: it kept up with no rate the search tried
                        runs[name, p].append(opened[name].run(rates[name]))
        partitions = {name: live.partition for name, live in opened.items()}
    common: dict[str, Any] = dict(
        mode="learning" if learning else "inference",
        optimizer=optimizer if learning else None,
        model=conv_net.__name__,
        size=size,
        layers=layers,
        channels=channels,
        samples=samples,
        warmup=warmup,
        blocks=blocks,
        rounds=rounds,
        cores=cores,
        others_busy=others_busy(clocks, cores),
    )
    seq = {c.threads: c.name for c in chosen if c.kind == "sequential"}
    rows = []
    for c in chosen:
        row: dict[str, Any] = dict(contender=c.name, kind=c.kind, depth=c.depth, threads=c.threads, executor=c.executor)
        cut = partitions[c.name]
        row.update(partition=None if cut is None else str(cut), balance=None if cut is None else list(cut.balance))
        row.update(ms_per_sample=ms[c.name], ms_per_round=recorded[c.name], **_sustained(c.name, searches, seq, cores))
        for p, (fraction, _) in enumerate(points):
            figures = point(runs[c.name, p], warmup, samples)
            p99 = figures["latency_p99_ms"]
            over = None if p99 is None else p99 / ms[seq[1]]
            rows.append(dict(**common, **row, fraction=fraction, **figures, p99_over_seq_ms=over))
    return rows


def _searched(
    opened: dict[str, Live], starts: dict[str, float], rounds: int, timing: tuple[int, int], report: Progress
) -> dict[str, list[Search]]:
    """Each contender's search from its start in each of ``rounds`` rounds, all interleaved in
    each round (``timing``: ``(warmup, samples)``)."""

    def probe(live: Live) -> Probe:
        return lambda fps: sum(timed(live.run(fps), *timing).dropped)

    probes = {name: probe(live) for name, live in opened.items()}
    searches: dict[str, list[Search]] = {name: [] for name in opened}
    for r in range(rounds):
        label = f"highest rate without a drop, round {r + 1} of {rounds}"

        def told(at: str, label: str = label) -> None:
            report(f"{label}: {at}")

        for name, search in sustained_rates(probes, starts, progress=told).items():
            searches[name].append(search)
    return searches


def _sustained(name: str, searches: dict[str, list[Search]], seq: dict[int, str], cores: int) -> dict[str, Any]:
    """A contender's sustained rate and its searches, and its ratios to the plain model's (None without a search)."""
    if not searches[name]:
        keys = ("sustained_fps", "sustained_fps_per_round", "dropped_at_fps_per_round", "probes")
        return dict.fromkeys((*keys, "sustained_vs_seq_1thread", "sustained_vs_seq_allcores"))

    def median(of: str) -> float:
        return statistics.median(s.sustained for s in searches[of])

    def over(base: str) -> float | None:
        return median(name) / median(base) if median(base) > 0 else None

    return dict(
        sustained_fps=median(name),
        sustained_fps_per_round=[s.sustained for s in searches[name]],
        dropped_at_fps_per_round=[s.dropped_at for s in searches[name]],
        probes=[[list(probe) for probe in s.probes] for s in searches[name]],
        sustained_vs_seq_1thread=over(seq[1]),
        sustained_vs_seq_allcores=over(seq[cores]),
    )


def timed(run: StreamTimes, warmup: int, samples: int) -> StreamTimes:
    """The ``samples`` frames of ``run`` after its ``warmup`` (a ValueError if it has fewer)."""
    if len(run.dropped) < warmup + samples:
        raise ValueError(f"a run of {len(run.dropped)} frames has no {samples} timed after a warm-up of {warmup}")
    cut = slice(warmup, warmup + samples)
    return StreamTimes(run.fps, run.arrived[cut], run.handed[cut], run.dropped[cut])


def point(runs: Sequence[StreamTimes], warmup: int, samples: int) -> dict[str, Any]:
    """The figures of ``runs`` at one rate, their timed frames taken together: ``offered_fps``,
    ``offered``, ``dropped``, ``kept_fps`` and the p50 and p99 latency of the kept frames (ms);
    without runs, 0 frames offered and None for the rest."""
    if not runs:
        return dict(offered_fps=None, offered=0, dropped=0, kept_fps=None, latency_p50_ms=None, latency_p99_ms=None)
    parts = [timed(run, warmup, samples) for run in runs]
    kept = [(a, h) for part in parts for a, h, d in zip(part.arrived, part.handed, part.dropped) if not d]
    offered = len(parts) * samples
    fps = parts[0].fps
    if fps is None:
        raise ValueError("a recorded run has no rate: its figures are bench.median_ms")
    wait = latencies([a for a, _ in kept], [h for _, h in kept]) if kept else dict(p50_ms=None, p99_ms=None)
    return dict(
        offered_fps=fps,
        offered=offered,
        dropped=offered - len(kept),
        kept_fps=fps * len(kept) / offered,
        latency_p50_ms=wait["p50_ms"],
        latency_p99_ms=wait["p99_ms"],
    )

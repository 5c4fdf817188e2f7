"""How fast the distributed executor goes on this host or cluster: ``partime bench --executor distributed``.

Every rank runs ``bench_distributed`` under torchrun; rank 0 times the sequential baselines and
the pipeline as ``bench.run_bench`` does for the other executors, and the hop cost of one link
(``measure_link_hop``), while the other ranks serve their stages. It returns rows; printing is
the CLI's job.
"""

from __future__ import annotations

import copy
import datetime
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partime import Pipeline
from partime.internals import KIND_DATA, LINK_TIMEOUT_S, RankLink, Run, TensorSpec, join_group

from .models import conv_net
from .runner import CLASSES, cpu_clocks, optimizer_named, others_busy, time_pipeline, time_sequential


def measure_link_hop(nbytes: int = 65536, rounds: int = 1000) -> dict[str, float] | None:
    """The cost of one hop of a float32 tensor of ``nbytes`` between ranks 0 and 1: over a bare
    gloo ``send``/``recv``, and over this executor's links (a frame with a header, sent at once; a
    receiving thread that queues it for ``get``).

    Every rank calls it (it makes process groups); rank 0 gets ``hop_us_median`` (links) and
    ``raw_hop_us_median`` (bare) in microseconds, each half the median round trip after as many
    warm-up rounds (at most 100); the other ranks get None.
    """
    if nbytes < 4 or nbytes % 4:
        raise ValueError(f"nbytes must be a positive multiple of 4 (float32), got {nbytes}")
    rank = join_group()
    if dist.get_world_size() < 2:
        return None
    run = Run(rank, dist.get_world_size())
    timeout = datetime.timedelta(seconds=LINK_TIMEOUT_S)
    run.groups = [dist.new_group([0, 1], timeout=timeout, backend="gloo") for _ in range(3)]
    if rank > 1:
        run.close()
        return None
    peer, cpu, payload = 1 - rank, torch.device("cpu"), {KIND_DATA: (TensorSpec((nbytes // 4,), torch.float32),)}
    there = RankLink("hop 0->1", run.groups[1], peer, rank == 0, payload, cpu, run.health.lost)
    back = RankLink("hop 1->0", run.groups[2], peer, rank == 1, payload, cpu, run.health.lost)
    run.links = {"there": there, "back": back}
    x, check = torch.randn(nbytes // 4), run.health.check

    def raw() -> None:
        if rank == 0:
            dist.send(x, 1, group=run.groups[0])
            dist.recv(x, 1, group=run.groups[0])
        else:
            dist.recv(x, 0, group=run.groups[0])
            dist.send(x, 0, group=run.groups[0])

    def linked() -> None:
        if rank == 0:
            there.put(KIND_DATA, 0, (x,), check=check)
            back.get(check=check)
        else:
            back.put(KIND_DATA, 0, there.get(check=check).tensors, check=check)

    figures = {}
    for name, one in (("raw_hop_us_median", raw), ("hop_us_median", linked)):
        hops = []
        for i in range(min(rounds, 100) + rounds):
            t0 = time.perf_counter()
            one()
            hops.append((time.perf_counter() - t0) / 2)
        figures[name] = sorted(hops[-rounds:])[rounds // 2] * 1e6
    run.close()
    return figures if rank == 0 else None


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def bench_distributed(
    samples: int = 300,
    size: int = 32,
    layers: int = 16,
    *,
    channels: int = 32,
    modes: Sequence[str] = ("inference", "learning"),
    warmup: int = 20,
    blocks: int = 5,
    seed: int = 0,
    optimizer: str = "sgd",
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]] | None:
    """``partime_tools.bench.runner.run_bench`` for this executor: every rank calls it, under torchrun.

    With D ranks, one row per mode for the sequential baselines (rank 0 alone, one thread and
    every core) and one for ``Pipeline(model, D, executor="distributed")``, keyed as
    ``run_bench``'s rows are (learning with the optimizer ``bench.OPTIMIZERS`` calls ``optimizer``),
    with the hop costs of this executor's links (``hop_64kb_us``, ``hop_activation_us``) and of a
    bare gloo send/recv (``hop_64kb_raw_us``) between ranks 0 and 1. Rank 0 gets the rows; the
    other ranks serve their stages and get None.
    """
    factory = optimizer_named(optimizer)
    rank = join_group()
    depth, cores = dist.get_world_size(), os.cpu_count() or 1
    store, call = dist.distributed_c10d._get_default_store(), Run.count  # the same on every rank
    report = progress if progress is not None and rank == 0 else (lambda label: None)
    report("hop cost")
    activation_bytes = channels * size * size * 4
    nan = dict(hop_us_median=float("nan"), raw_hop_us_median=float("nan"))  # one rank: no hop
    hop_64kb, hop_activation = (measure_link_hop(n) or nan for n in (65536, activation_bytes))
    gen = torch.Generator().manual_seed(seed)
    total = warmup + samples + depth
    xs = torch.randn(total, 1, 3, size, size, generator=gen)
    ys = torch.randint(0, CLASSES, (total, 1), generator=gen)
    timing: dict[str, Any] = dict(samples=samples, warmup=warmup, blocks=blocks, optimizer=factory)
    rows: list[dict[str, Any]] = []
    for mode in modes:
        learning = mode == "learning"
        model = conv_net(layers, channels, classes=CLASSES if learning else None, seed=seed)
        if rank > 0:  # serve this rank's stage while rank 0 times the baselines and the pipeline
            kw: dict[str, Any] = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=factory) if learning else {}
            cpu = _cpu_seconds()
            with Pipeline(model, depth, executor="distributed", threads=1, **kw):
                pass
            store.set(f"partime/bench/{call}/{mode}/cpu/{rank}", repr(_cpu_seconds() - cpu))
            continue
        base, first = {}, len(rows)
        for threads in sorted({1, cores}):
            report(f"{mode}: sequential, {threads} thread{'s' if threads > 1 else ''}")
            clocks = cpu_clocks()  # the other ranks wait meanwhile: what they use is others' work
            base[threads] = time_sequential(copy.deepcopy(model), xs, ys if learning else None, threads, **timing)
            rows.append(
                dict(
                    mode=mode,
                    depth=0,
                    executor=f"sequential ({threads} thr)",
                    threads=threads,
                    ms_per_sample=base[threads],
                    others_busy=others_busy(clocks, cores),
                )
            )
        report(f"{mode}: D={depth}, distributed")
        clocks = cpu_clocks()
        ms, partition = time_pipeline(
            copy.deepcopy(model), depth, "distributed", xs, ys if learning else None, **timing
        )
        busy = others_busy(clocks, cores)
        # One host: take the ranks' CPU out (busy is known only when clocks is: testing both tells mypy so).
        if busy is not None and clocks is not None and os.environ.get("LOCAL_WORLD_SIZE") == str(depth):
            keys = [f"partime/bench/{call}/{mode}/cpu/{r}" for r in range(1, depth)]
            store.wait(keys)
            ranks_cpu = sum(float(store.get(k)) for k in keys)
            wall = time.perf_counter() - clocks[0]  # as cpu_clocks() reads it
            busy = max(0.0, busy - ranks_cpu / (wall * cores))
        else:
            busy = None
        times = partition.stage_times or ()
        rows.append(
            dict(
                mode=mode,
                depth=depth,
                executor="distributed",
                threads=1,
                ms_per_sample=ms,
                others_busy=busy,
                partition=str(partition),
                balance=list(partition.balance),
                stage_ms=[t * 1e3 for t in times],
                max_stage_ms=max(times, default=float("nan")) * 1e3,
            )
        )
        for row in rows[first:]:
            row.update(
                optimizer=optimizer if learning else None,
                speedup_vs_seq_1thread=base[1] / row["ms_per_sample"],
                speedup_vs_seq_allcores=base[cores] / row["ms_per_sample"],
                samples=samples,
                size=size,
                layers=layers,
                channels=channels,
                activation_bytes=activation_bytes,
                hop_64kb_us=hop_64kb["hop_us_median"],
                hop_64kb_raw_us=hop_64kb["raw_hop_us_median"],
                hop_activation_us=hop_activation["hop_us_median"],
            )
    return rows if rank == 0 else None

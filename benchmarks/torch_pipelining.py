"""The stream of ``partime bench --sizes`` through ``torch.distributed.pipelining``: GPipe and 1F1B.

One process per stage under torchrun, on CPU with gloo, each with one torch thread::

    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/torch_pipelining.py --json torch_pipelining.json

The model, the frames and the cut are those of the bench: ``conv3_net`` (with a head of 10
logits when learning), the frames of ``bench.frames`` (batch-1 RGB frames, seeded), and the cut
that ``partime.Pipeline(model, world size)`` chooses for the same mode (chosen on rank 0 and sent
to every rank). torch's schedules take a batch and split it into microbatches: here a batch is
``M`` consecutive frames, one frame per microbatch, so a stage works on one frame at a time as
partime's do.

- inference: ``schedule.eval(batch)``, forward only (1F1B then runs its forwards alone, in its own order
  of sends and receives);
- learning: ``schedule.step(batch, target=labels)`` (cross-entropy averaged over the
  microbatches) and one SGD step per batch, where partime takes one per frame.

For each size and mode, rounds alternate sequential (the plain model on rank 0, one frame at a
time, one thread, as the bench times it, while the other ranks wait) and every schedule at every
``M``. A schedule's figure in a round is the time from a barrier before ``--samples`` frames (in
whole batches, after a warm-up of ``--warmup`` frames) to a barrier after them, per frame; each
row has the median over rounds, and the speed-up over sequential. Rank 0 prints a table and
writes the rows with ``--json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from partime import Pipeline
from partime_tools.bench.models import conv3_net
from partime_tools.bench.runner import CLASSES, LR, frames, median_ms, sgd

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
SEQUENTIAL = "sequential 1 thread"
BLOCKS = 5


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="12,24,48,72,96", help="frame sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--microbatches", default="4,8,32", help="microbatches per batch M (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=300, help="frames timed per figure (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="frames before the timing (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per size and mode (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="3x3 convolution blocks after the stem")
    parser.add_argument("--channels", type=int, default=24)
    parser.add_argument("--modes", default="inference,learning")
    parser.add_argument("--json", type=Path, help="write the rows (rank 0) to this JSON file")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.microbatches = [int(m) for m in args.microbatches.split(",")]
    args.modes = args.modes.split(",")
    if args.samples < BLOCKS or min(args.microbatches) < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("need --samples >= 5, microbatches >= 1, --warmup >= 0 and --rounds >= 1")
    return args


def the_cut(model: nn.Sequential, sample: torch.Tensor, learning: bool, world: int) -> list[int]:
    """The balance that partime chooses for this model and mode, on rank 0, sent to every rank."""
    chosen: list[Any] = [None]
    if dist.get_rank() == 0:
        extra: dict[str, Any] = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=sgd) if learning else {}
        with Pipeline(model, world, executor="inline", sample=sample, threads=1, **extra) as pipe:
            if pipe.partition is None:
                raise RuntimeError("partime chose no cut, though it was given a sample")
            chosen[0] = list(pipe.partition.balance)
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


class Contender:
    """One schedule at one microbatch count on this rank: its stage, its schedule and (learning) its optimizer."""

    def __init__(self, name: str, module: nn.Module, microbatches: int, learning: bool):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.name, self.microbatches, self.learning = name, microbatches, learning
        self.stage = PipelineStage(module, rank, world, torch.device("cpu"))
        loss_fn = nn.CrossEntropyLoss() if learning else None
        self.schedule = SCHEDULES[name](self.stage, microbatches, loss_fn=loss_fn)
        self.optimizer = torch.optim.SGD(module.parameters(), lr=LR) if learning else None

    def batch(self, xs: torch.Tensor, ys: torch.Tensor, first: int) -> None:
        """Run frames ``first`` .. ``first + M - 1`` through the pipeline (and learn from them)."""
        rank, last = dist.get_rank(), dist.get_world_size() - 1
        m = self.microbatches
        x = xs[first : first + m].flatten(0, 1)  # M frames of batch 1: one batch of M, one frame per microbatch
        inputs = (x,) if rank == 0 else ()
        if self.optimizer is None:
            with torch.no_grad():
                self.schedule.eval(*inputs)
            return
        target = ys[first : first + m].flatten() if rank == last else None
        self.optimizer.zero_grad()
        self.schedule.step(*inputs, target=target)
        self.optimizer.step()

    def time(self, xs: torch.Tensor, ys: torch.Tensor, warmup: int, samples: int) -> float:
        """Milliseconds per frame over ``samples`` frames (rounded up to whole batches) after ``warmup``."""
        m = self.microbatches
        warm, timed = math.ceil(warmup / m), math.ceil(samples / m)
        for b in range(warm):
            self.batch(xs, ys, b * m)
        dist.barrier()
        start = time.perf_counter()
        for b in range(warm, warm + timed):
            self.batch(xs, ys, b * m)
        dist.barrier()
        return (time.perf_counter() - start) * 1e3 / (timed * m)


def sequential_ms(model: nn.Sequential, xs: torch.Tensor, ys: torch.Tensor, learning: bool, args: Any) -> float:
    """Rank 0: the plain model, one frame at a time, timed as ``partime bench`` does (others wait)."""
    ms = math.nan
    if dist.get_rank() == 0:
        loss_fn, optimizer = nn.CrossEntropyLoss(), sgd(model.parameters())
        stamps = []
        for i in range(args.warmup + args.samples + 1):
            if learning:
                optimizer.zero_grad()
                loss_fn(model(xs[i]), ys[i]).backward()
                optimizer.step()
            else:
                with torch.no_grad():
                    model(xs[i])
            stamps.append(time.perf_counter())
        ms = median_ms(stamps, args.warmup, BLOCKS)
    dist.barrier()
    return ms


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for size in args.sizes:
        count = max(args.warmup + args.samples + 1, *(_frames_needed(m, args) for m in args.microbatches))
        xs, ys = frames(size, count)
        for mode in args.modes:
            learning = mode == "learning"
            # a fresh copy of the same seeded weights at every call
            model = functools.partial(conv3_net, args.layers, args.channels, classes=CLASSES if learning else None)

            balance = the_cut(model(), xs[0], learning, world)
            start = sum(balance[:rank])
            contenders = []
            for name in SCHEDULES:
                for m in args.microbatches:
                    if name == "1F1B" and m < world:
                        continue  # torch's 1F1B needs at least as many microbatches as stages
                    contenders.append(Contender(name, model()[start : start + balance[rank]], m, learning))
            sequential = (SEQUENTIAL, None)
            seen: dict[tuple[str, int | None], list[float]] = {sequential: []}
            for _ in range(args.rounds):
                seen[sequential].append(sequential_ms(model(), xs, ys, learning, args))
                for c in contenders:
                    per_round = seen.setdefault((c.name, c.microbatches), [])
                    per_round.append(c.time(xs, ys, args.warmup, args.samples))
            base = statistics.median(seen[sequential])
            for (schedule, microbatches), per_round in seen.items():
                ms = statistics.median(per_round)
                rows.append(
                    dict(
                        size=size,
                        mode=mode,
                        schedule=schedule,
                        microbatches=microbatches,
                        ms_per_sample=ms,
                        ms_per_round=per_round,
                        speedup_vs_seq_1thread=base / ms,
                        balance=balance,
                        world=world,
                        samples=args.samples,
                        warmup=args.warmup,
                        rounds=args.rounds,
                        layers=args.layers,
                        channels=args.channels,
                        torch=torch.__version__,
                    )
                )
    return rows


def _frames_needed(microbatches: int, args: argparse.Namespace) -> int:
    return (math.ceil(args.warmup / microbatches) + math.ceil(args.samples / microbatches)) * microbatches


def main() -> None:
    args = arguments()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rows = run(args)
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(f"| size | mode | schedule | M | ms/sample | x seq 1 thread | cut ({rows[0]['world']} ranks) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        m = "" if row["microbatches"] is None else row["microbatches"]
        print(
            f"| {row['size']} | {row['mode']} | {row['schedule']} | {m} | {row['ms_per_sample']:.3f} | "
            f"{row['speedup_vs_seq_1thread']:.2f} | {row['balance']} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"rows written to {args.json}")


if __name__ == "__main__":
    main()

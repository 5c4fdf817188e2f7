"""Fine-tuning the head of a frozen network: a D = 2 pipeline against the plain loop.

Every layer of the bench's conv model (a stem and ``--layers`` blocks of 3x3 convolution) is frozen
but its head (pooling and a linear layer to 10 classes), as when fine-tuning a bigger model's head
on a stream. A plain loop then runs the backbone forward, and the head's forward, backward and
step; autograd goes no further back. A pipeline cuts the backbone: its stages before the head run
their forwards without a graph and are sent no gradient, so its tick is a share of the forward.

The contenders take turns in each round, on the same frames (``--rounds`` rounds of
``--samples`` timed results each): the plain loop with one thread and with every core, and
``Pipeline(model, 2)`` under the process and thread executors with one thread per stage. Printed:
each one's median ms per sample over the rounds and the plain loop on every core's time over it.

    .venv/bin/python experiments/speed/head_fine_tuning.py --sizes 24,48,96 > experiments/speed/head_fine_tuning.txt
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

from torch import nn

from partime_tools.bench.contenders import PipelineKind, Setting, pipeline, sequential
from partime_tools.bench.models import conv3_net
from partime_tools.bench.runner import CLASSES, frames, median_ms


def head_only(layers: int) -> nn.Sequential:
    """The bench's conv model with a head, every parameter frozen but the head's."""
    model = conv3_net(layers, classes=CLASSES)
    for k, block in enumerate(model):
        block.requires_grad_(k == len(model) - 1)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="24,48,96", help="frame sizes, comma-separated")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    warmup, blocks = 20, 5
    print(f"head-only fine-tuning, conv3_net({args.layers}) + head, SGD; {cores} cores; median ms per sample")
    print(f"{'size':>5} {'contender':<24} {'ms':>8} {'x plain':>8}  balance")
    for size in (int(s) for s in args.sizes.split(",")):
        xs, ys = frames(size, warmup + args.samples + 4)
        setting = Setting(head_only(args.layers), xs, ys, warmup + args.samples)
        contenders = [sequential(1), sequential(cores)] + [
            pipeline(PipelineKind(name, name), 2) for name in ("process", "thread")
        ]
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(c.open(setting)) for c in contenders]
            per_round: list[list[float]] = [[] for _ in contenders]
            for _ in range(args.rounds):
                for times, one in zip(per_round, opened):
                    times.append(median_ms(one.run().handed_at, warmup, blocks))
        medians = [statistics.median(t) for t in per_round]
        plain = medians[1]
        for contender, one, ms in zip(contenders, opened, medians):
            balance = "" if one.partition is None else list(one.partition.balance)
            print(f"{size:>5} {contender.name:<24} {ms:8.3f} {plain / ms:8.2f}  {balance}")


if __name__ == "__main__":
    main()

"""Online learning on a stream with one pipeline stage per process, started by torchrun.

On one host, D = 2 stages (two processes)::

    torchrun --standalone --nproc-per-node=2 examples/distributed_stream.py

On two hosts, one stage each (rank 0, which reads the stream and prints, on host A)::

    host A$ torchrun --nnodes=2 --nproc-per-node=1 --node-rank=0 --rdzv-backend=static \
                --rdzv-endpoint=HOST_A:29500 examples/distributed_stream.py
    host B$ torchrun --nnodes=2 --nproc-per-node=1 --node-rank=1 --rdzv-backend=static \
                --rdzv-endpoint=HOST_A:29500 examples/distributed_stream.py

Every rank runs this script. Rank r hosts stage r; rank 0 reads the stream, and its
``pipe.stream`` yields the results. On the other ranks ``with pipe:`` serves their stage until
rank 0 closes the pipeline, and ``pipe.stream`` then yields nothing.
"""

import argparse
import json
import math
import os
import time
from collections.abc import Iterable

import torch
from torch import nn

import partime


def frames(n: int, size: int = 32, hold: int = 10, seed: int = 0):
    """A square gliding over a noisy frame, lit in one colour channel for ``hold`` frames at a time;
    the label is the channel (0 to 2)."""
    gen = torch.Generator().manual_seed(seed)
    colour = 0
    for t in range(n):
        if t % hold == 0:
            colour = int(torch.randint(3, (), generator=gen))
        cx = int((size - 16) * (0.5 + 0.5 * math.sin(t / 37)))
        cy = int((size - 16) * (0.5 + 0.5 * math.sin(t / 23 + 1)))
        x = 0.1 * torch.randn(1, 3, size, size, generator=gen)
        x[:, colour, cy : cy + 16, cx : cx + 16] += 1.0
        yield x, torch.tensor([colour])


def conv_net(blocks: int = 6, channels: int = 32, classes: int = 3) -> nn.Sequential:
    """Blocks of 5x5 convolution and ReLU, then a linear classifier of the pooled channels."""
    torch.manual_seed(0)  # rank 0 sends every rank its stage's weights anyway
    layers = [
        nn.Sequential(nn.Conv2d(3 if i == 0 else channels, channels, 5, padding=2), nn.ReLU()) for i in range(blocks)
    ]
    for block in layers:  # He initialisation: the signal keeps its scale through the stack
        nn.init.kaiming_normal_(block[0].weight, nonlinearity="relu")
        nn.init.zeros_(block[0].bias)
    return nn.Sequential(*layers, nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)))


def optimizer(params: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """Every stage's optimizer: SGD with momentum, of the stage's (name, parameter) pairs."""
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--save", help="write the trained weights here (rank 0)")
    parser.add_argument("--record", help="write the cut and every result's index and loss here, as JSON (rank 0)")
    args = parser.parse_args()
    depth, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))

    xs = (x for x, _ in frames(args.samples))
    ys = (y for _, y in frames(args.samples))
    with partime.Pipeline(
        conv_net(), depth, executor="distributed", loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer
    ) as pipe:
        losses, indices = [], []
        for result in pipe.stream(xs, ys):  # on ranks > 0: nothing, their stage has been served
            if not losses:
                start = time.perf_counter()  # the stages have started (which takes a few seconds)
            losses.append(result.loss)
            indices.append(result.index)
            if len(losses) % 100 == 0:
                print(f"sample {result.index + 1}: mean loss of the last 100 {sum(losses[-100:]) / 100:.3f}")
        if rank == 0:
            ms = (time.perf_counter() - start) / (len(losses) - 1) * 1e3
            print(f"{len(losses)} samples, {ms:.1f} ms per sample after the first, on {depth} ranks; {pipe.partition}")
            trained = pipe.module  # every stage's weights, fetched from its rank
            if args.save:
                torch.save(trained.state_dict(), args.save)
            if args.record:  # a float's repr reads back as the same float: the losses survive JSON exactly
                with open(args.record, "w") as f:
                    json.dump({"balance": list(pipe.partition.balance), "indices": indices, "losses": losses}, f)


if __name__ == "__main__":
    main()

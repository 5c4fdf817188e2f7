"""What a stage's statistics cost: reading them, and keeping them.

    python benchmarks/stats_cost.py [--samples 300] [--executor process] [--repeats 3]

A learning pipeline of two stages over an MLP of about 4M parameters. It reports the median time
of reading one lr through ``pipe.stats()`` and through ``pipe.state_dict()`` (the way there was
before statistics: a checkpoint, which waits for every stage and copies every state), each read in
the middle of a stream, and the time per sample of the stream with ``stats=False`` and with
``stats=True`` (which measures the gradient norm at every step): the least of ``--repeats`` runs
of each, alternated.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import partime


def mlp(width: int = 1024, layers: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def run(executor: str, samples: int, stats: bool, read: str | None) -> tuple[float, list[float]]:
    """Seconds per sample of a stream of ``samples``, and the times of the reads (``read``: "stats",
    "state_dict" or None) made every 20th result."""
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(samples, 4, 1024, generator=gen)
    ys = torch.randn(samples, 4, 1024, generator=gen)
    reads: list[float] = []
    pipe = partime.Pipeline(
        mlp(),
        [4, 4],
        executor=executor,
        threads=1,
        loss_fn=nn.MSELoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.999),
        stats=stats,
    )
    with pipe:
        started = None
        for result in pipe.stream(xs, ys):
            if result.index == 10:  # the first ticks start the workers: time the steady ones
                started = time.perf_counter()
            if read is not None and result.index % 20 == 19:
                before = time.perf_counter()
                if read == "stats":
                    lr = pipe.stats()[0].lr
                else:
                    state = pipe.state_dict()
                    assert state is not None
                    lr = state["stages"][0]["optimizer"]["param_groups"][0]["lr"]
                reads.append(time.perf_counter() - before)
                assert lr is not None and lr > 0
        assert started is not None
        per_sample = (time.perf_counter() - started) / (samples - 11)
    return per_sample, reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--executor", default="process", choices=partime.EXECUTORS)
    parser.add_argument("--repeats", type=int, default=3, help="runs with and without stats, alternated")
    args = parser.parse_args()
    params = sum(p.numel() for p in mlp().parameters())
    print(f"{params / 1e6:.1f}M parameters, {args.executor} executor, D = 2, {args.samples} samples")
    # alternated, the least of each kept: what the machine's other work adds is not the statistics'
    plain = kept = float("inf")
    for _ in range(args.repeats):
        plain = min(plain, run(args.executor, args.samples, False, None)[0])
        kept = min(kept, run(args.executor, args.samples, True, None)[0])
    _, by_stats = run(args.executor, args.samples, True, "stats")
    _, by_checkpoint = run(args.executor, args.samples, False, "state_dict")
    print(f"per sample: {1e3 * plain:.2f} ms without stats, {1e3 * kept:.2f} ms with stats=True")
    print(f"one lr through pipe.stats():      median {1e6 * statistics.median(by_stats):8.1f} us")
    print(f"one lr through pipe.state_dict(): median {1e6 * statistics.median(by_checkpoint):8.1f} us")


if __name__ == "__main__":
    main()

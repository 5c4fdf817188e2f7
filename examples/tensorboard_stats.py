"""Online learning on a long stream, watched: each stage's statistics in TensorBoard, and a progress bar.

    pip install "partime[tools]"        # tensorboard and rich
    python examples/tensorboard_stats.py runs/stats --samples 5000
    tensorboard --logdir runs/stats

Every ``--every`` results it reads ``pipe.stats()`` (no wait for any stage: each stage's worker
writes its statistics where the caller reads them) and writes, for each stage, its lr, the norm of
the gradient of its last step, and its mean tick and wait over those results, in milliseconds;
and the mean loss. The progress bar (rich) shows the samples done and the slowest stage's tick.

(Not ``tensorboard.py``: a script of that name, run from this folder, would be imported as the
``tensorboard`` package by ``torch.utils.tensorboard``.)
"""

import argparse
import math

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import partime


def stream(n: int, seed: int = 0):
    """A slowly turning linear map to learn: (x, y) pairs whose rule drifts over time."""
    gen = torch.Generator().manual_seed(seed)
    rule = torch.randn(8, 32, generator=gen)
    for t in range(n):
        x = torch.randn(16, 32, generator=gen)
        turn = torch.tensor(t / 500.0)
        y = x @ (rule * torch.cos(turn) + rule.roll(1, 0) * torch.sin(turn)).T
        yield x, y


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def mean_ms(now: partime.StageStats, before: partime.StageStats | None, field: str) -> float:
    """The mean of ``field`` (``tick`` or ``wait``) per tick between two reads, in milliseconds."""
    total = f"total_{field}_seconds"
    ticks = now.ticks - (before.ticks if before else 0)
    seconds = getattr(now, total) - (getattr(before, total) if before else 0.0)
    return 1000 * seconds / ticks if ticks else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logdir", help="where TensorBoard's event file goes")
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--every", type=int, default=10, help="results between two reads of the statistics")
    parser.add_argument("--executor", default="process", choices=partime.EXECUTORS)
    args = parser.parse_args()

    pipe = partime.Pipeline(
        model(),
        2,
        executor=args.executor,
        loss_fn=nn.MSELoss(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.998),
        stats=True,
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    before: dict[int, partime.StageStats] = {}
    losses: list[float] = []
    with SummaryWriter(args.logdir) as board, Progress(*columns) as progress, pipe:
        task = progress.add_task("learning", total=args.samples)
        for result in pipe.stream(stream(args.samples)):
            losses.append(result.loss)
            done = result.index + 1
            if done % args.every:
                continue
            slowest = 0.0
            for stats in pipe.stats():
                tag = f"stage{stats.stage}"
                tick_ms = mean_ms(stats, before.get(stats.stage), "tick")
                board.add_scalar(f"{tag}/lr", stats.lr, done)
                if stats.grad_norm is not None:  # None until the stage's first step
                    board.add_scalar(f"{tag}/grad_norm", stats.grad_norm, done)
                board.add_scalar(f"{tag}/tick_ms", tick_ms, done)
                board.add_scalar(f"{tag}/wait_ms", mean_ms(stats, before.get(stats.stage), "wait"), done)
                before[stats.stage] = stats
                slowest = max(slowest, tick_ms)
            board.add_scalar("loss", sum(losses) / len(losses), done)
            losses.clear()
            progress.update(task, completed=done, description=f"learning, slowest tick {slowest:.2f} ms")
    print(f"{args.samples} samples; statistics in {args.logdir}")


if __name__ == "__main__":
    main()

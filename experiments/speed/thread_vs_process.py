"""The thread executor against the process executor at D = 2, interleaved in one run.

For each model (the bench's convolution stack at two sizes, and two Linear(16, 16) stages for the
per-tick floor) and each mode (inference, learning), rounds alternate sequential, process and
thread; each figure is the median over rounds of the median ms per sample of 5 blocks. Run on an
otherwise idle machine::

    .venv/bin/python experiments/speed/thread_vs_process.py > experiments/speed/thread-vs-process.md
"""

import statistics
import time

import torch
from torch import nn

from partime import Pipeline
from partime_tools.bench.models import conv_net
from partime_tools.bench.runner import median_ms, sgd

ROUNDS = 5
SAMPLES = 200
WARMUP = 20
BLOCKS = 5


def frames(size: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 3, size, size, generator=gen), torch.randint(0, 10, (n, 1), generator=gen)


def vectors(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 16, generator=gen), torch.randint(0, 16, (n, 1), generator=gen)


def time_sequential(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor | None) -> float:
    torch.set_num_threads(1)
    loss_fn, optimizer = nn.CrossEntropyLoss(), sgd(model.parameters())
    stamps = []
    for i in range(WARMUP + SAMPLES + 1):
        if ys is None:
            with torch.no_grad():
                model(xs[i])
        else:
            optimizer.zero_grad()
            loss_fn(model(xs[i]), ys[i]).backward()
            optimizer.step()
        stamps.append(time.perf_counter())
    return median_ms(stamps, WARMUP, BLOCKS)


def time_pipeline(model: nn.Module, executor: str, xs: torch.Tensor, ys: torch.Tensor | None) -> float:
    torch.set_num_threads(1)
    learning = {} if ys is None else dict(loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    with Pipeline(model, 2, executor=executor, sample=xs[0], threads=1, **learning) as pipe:
        results = pipe.stream(iter(xs), None if ys is None else iter(ys))
        stamps = []
        for _ in range(WARMUP + SAMPLES + 1):
            next(results)
            stamps.append(time.perf_counter())
        for _ in results:
            pass
    return median_ms(stamps, WARMUP, BLOCKS)


def main() -> None:
    n = WARMUP + SAMPLES + 8
    models = {
        "two Linear(16, 16) stages (the per-tick floor)": (
            lambda: nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
            vectors(n),
        ),
        "4 conv blocks, 16x16 frames (small stages)": (lambda: conv_net(4, classes=10), frames(16, n)),
        "12 conv blocks, 32x32 frames (large stages)": (lambda: conv_net(12, classes=10), frames(32, n)),
    }
    print("| model | mode | sequential ms | process ms | thread ms | process speed-up | thread speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name, (make, (xs, ys)) in models.items():
        for mode in ("inference", "learning"):
            targets = ys if mode == "learning" else None
            seen: dict[str, list[float]] = {"sequential": [], "process": [], "thread": []}
            for _ in range(ROUNDS):
                seen["sequential"].append(time_sequential(make(), xs, targets))
                for executor in ("process", "thread"):
                    seen[executor].append(time_pipeline(make(), executor, xs, targets))
            ms = {k: statistics.median(v) for k, v in seen.items()}
            print(
                f"| {name} | {mode} | {ms['sequential']:.3f} | {ms['process']:.3f} | {ms['thread']:.3f} | "
                f"{ms['sequential'] / ms['process']:.2f}x | {ms['sequential'] / ms['thread']:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()

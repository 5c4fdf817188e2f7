"""Inference at D = 2 with the caller's hosted stage one tick behind the workers (decoupled, the
default) and in lockstep, beside the physical bound: the slower of the model's own halves alone.
Beside them, both halves at once, each in a process of its own with plain torch and nothing handed
between them: what the machine's two cores give two halves that run together, with no pipeline.

The model is 8 × Conv3×3 with 24 channels and ReLU (16 layers, cut [8, 8]), on 24 × 24, 32 × 32
and 48 × 48 frames (stages of about 0.5, 1 and 2 ms here); one torch thread per stage. Each round
runs every contender once, in turn (each round starting one contender later), on the same 300
frames after 50 to warm up; the figures are medians over the rounds, in ms per sample. "of the
bound" is the slower half's time over the pipeline's (1.00: as fast as the slower half alone).

Run with nothing else on the machine: ``.venv/bin/python experiments/speed/decoupled.py`` (the table in
``decoupled.txt`` came from it).
"""

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.multiprocessing as mp
from torch import nn

import partime
from partime.internals import Driver
from partime_tools.bench.sweep import round_order

ROUNDS = 5
FRAMES = 300
WARM = 50


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Conv2d(24, 24, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers)


def alone(piece: nn.Module, xs: list[torch.Tensor]) -> float:
    """ms per sample of ``piece`` alone on ``xs``, under inference mode, one thread."""
    with torch.inference_mode():
        for x in xs[:WARM]:
            piece(x)
        start = time.perf_counter()
        for x in xs[WARM:]:
            piece(x)
    return (time.perf_counter() - start) / (len(xs) - WARM) * 1e3


def one_half(half: int, size: int, start: mp.Barrier, times: mp.Queue) -> None:
    """In a process of its own: half ``half`` of the model alone on frames of ``size``, once the
    other half is ready too; its ms per sample goes to ``times``."""
    torch.set_num_threads(1)
    whole = model()
    piece = whole[:8] if half == 0 else whole[8:]
    xs = [torch.randn(1, 24, size, size) for _ in range(FRAMES + WARM)]
    start.wait()
    times.put(alone(piece, xs))


def halves_at_once(size: int, run_half=one_half) -> float:
    """ms per sample of the slower of the two halves, run at the same time in two processes:
    ``run_half(half, size, start, times)`` in each (``one_half``: inference)."""
    ctx = mp.get_context("spawn")
    start, times = ctx.Barrier(2), ctx.Queue()
    workers = [ctx.Process(target=run_half, args=(half, size, start, times)) for half in (0, 1)]
    for worker in workers:
        worker.start()
    slower = max(times.get() for _ in workers)
    for worker in workers:
        worker.join()
    return slower


def slower_half(whole: nn.Sequential, xs: list[torch.Tensor]) -> float:
    """ms per sample of the slower of ``whole``'s halves, each alone."""
    return max(alone(whole[:8], xs), alone(whole[8:], xs))


def pipelined(executor: str, decoupled: bool, xs: list[torch.Tensor]) -> float:
    Driver.decoupled = decoupled
    with partime.Pipeline(model(), [8, 8], executor=executor, threads=1) as pipe:
        for _ in pipe.stream(xs[:WARM]):
            pass
        start = time.perf_counter()
        for _ in pipe.stream(xs[WARM:]):
            pass
        return (time.perf_counter() - start) / (len(xs) - WARM) * 1e3  # before close: not a tick's work


def in_rounds(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """What each contender returns (its ms per sample) in each of ``rounds`` rounds, each round
    starting one contender later than the one before (``round_order``, as the bench runs them)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for order in round_order(list(contenders), rounds):
        for name in order:
            times[name].append(contenders[name]())
    return times


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'frames':>8} {'contender':>22} {'ms/sample':>10} {'of the bound':>13}")
    for size in (24, 32, 48):
        xs = [torch.randn(1, 24, size, size) for _ in range(FRAMES + WARM)]
        whole = model()
        contenders = {
            "slower half alone": partial(slower_half, whole, xs),
            "plain model": partial(alone, whole, xs),
            "halves at once": partial(halves_at_once, size),
        }
        for executor in ("process", "thread"):
            for decoupled in (True, False):
                name = f"{executor} {'decoupled' if decoupled else 'lockstep'}"
                contenders[name] = partial(pipelined, executor, decoupled, xs)
        times = in_rounds(contenders, ROUNDS)
        bound = statistics.median(times["slower half alone"])
        for name, values in times.items():
            ms = statistics.median(values)
            print(f"{size:>5}x{size:<2} {name:>22} {ms:10.3f} {bound / ms:13.2f}")


if __name__ == "__main__":
    main()

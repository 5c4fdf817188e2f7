"""Online learning at D = 2 with ``grad_mode="partime"`` and with the default grad mode, beside the
physical bound: the slower of the model's own halves alone, each doing one forward, its backward
and an SGD step per sample with plain torch. Beside them, both halves at once, each in a process
of its own with plain torch and nothing handed between them: what the machine's two cores give two
halves that learn together, with no pipeline.

The model is 8 × Conv3×3 with 24 channels and ReLU (16 layers, cut [8, 8]) learning a regression
onto random frames (mean squared error, SGD at 1e-3), on 24 × 24 and 48 × 48 frames; one torch
thread per stage. ``grad_mode="partime"`` runs with no compensation (the delayed stage's own
work is then its forward, backward and step alone) and with the default one; the default grad
mode with the default compensation. Each round runs every contender once, in turn (each round
starting one contender later), on the same frames after a warm-up; the figures are medians over
the rounds, in ms per sample. "of the bound" is the slower half's time over the contender's.

Run with nothing else on the machine: ``.venv/bin/python experiments/speed/learning_partime.py``
(the table in ``learning_partime.txt`` came from it).
"""

import copy
import statistics
import time
from functools import partial

import torch
import torch.multiprocessing as mp
from decoupled import halves_at_once, in_rounds, model  # the same 8 × Conv3×3, beside this script
from torch import nn

import partime

ROUNDS = 4
FRAMES = 400
WARM = 40


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


def loss_fn(out, y):
    return (out - y).pow(2).mean()


def half_alone(piece: nn.Module, xs: list, ys: list, first: bool, last: bool) -> float:
    """ms per sample of ``piece`` alone: forward, backward (from the loss at the last half, from a
    fixed gradient before it) and the step, one thread."""
    piece = copy.deepcopy(piece)
    optimizer = sgd(piece.parameters())
    with torch.no_grad():
        grad = torch.randn_like(piece(xs[0]))

    def one(x, y):
        out = piece(x if first else x.clone().requires_grad_())
        if last:
            loss_fn(out, y).backward()
        else:
            out.backward(grad)
        optimizer.step()
        optimizer.zero_grad()

    for x, y in zip(xs[:WARM], ys):
        one(x, y)
    start = time.perf_counter()
    for x, y in zip(xs[WARM:], ys[WARM:]):
        one(x, y)
    return (time.perf_counter() - start) / (len(xs) - WARM) * 1e3


def slower_half(whole: nn.Sequential, xs: list, ys: list, middles: list) -> float:
    """ms per sample of the slower of ``whole``'s halves, each learning alone."""
    return max(half_alone(whole[:8], xs, ys, True, False), half_alone(whole[8:], middles, ys, False, True))


def frames(size: int) -> tuple[list, list, list]:
    """The inputs, the targets and what the first half makes of each input, on frames of ``size``."""
    generator = torch.Generator().manual_seed(size)
    xs = [torch.randn(1, 24, size, size, generator=generator) for _ in range(FRAMES + WARM)]
    ys = [torch.randn(1, 24, size, size, generator=generator) for _ in range(FRAMES + WARM)]
    with torch.no_grad():
        middles = [model()[:8](x) for x in xs]
    return xs, ys, middles


def one_half(half: int, size: int, start: mp.Barrier, times: mp.Queue) -> None:
    """In a process of its own: half ``half`` learning alone on frames of ``size``, once the other
    half is ready too; its ms per sample goes to ``times``."""
    torch.set_num_threads(1)
    xs, ys, middles = frames(size)
    whole = model()
    start.wait()
    if half == 0:
        times.put(half_alone(whole[:8], xs, ys, True, False))
    else:
        times.put(half_alone(whole[8:], middles, ys, False, True))


def pipelined(xs: list, ys: list, grad_mode: str, compensation: str | tuple[str, ...]) -> float:
    pipe = partime.Pipeline(
        model(),
        [8, 8],
        executor="process",
        threads=1,
        loss_fn=loss_fn,
        optimizer=sgd,
        grad_mode=grad_mode,
        compensation=compensation,
    )
    with pipe:
        for _ in pipe.stream(xs[:WARM], ys[:WARM]):
            pass
        start = time.perf_counter()
        for _ in pipe.stream(xs[WARM:], ys[WARM:]):
            pass
        return (time.perf_counter() - start) / (len(xs) - WARM) * 1e3  # before close: not a tick's work


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'frames':>8} {'contender':>38} {'ms/sample':>10} {'of the bound':>13}")
    contenders = {
        "process D=2, partime, no compensation": ("partime", ()),
        "process D=2, partime": ("partime", "auto"),
        "process D=2, graph-stash": ("graph-stash", "auto"),
    }
    for size in (24, 48):
        xs, ys, middles = frames(size)
        whole = model()
        runs = {
            "slower half alone": partial(slower_half, whole, xs, ys, middles),
            "halves at once": partial(halves_at_once, size, one_half),
        }
        for name, (grad_mode, compensation) in contenders.items():
            runs[name] = partial(pipelined, xs, ys, grad_mode, compensation)
        times = in_rounds(runs, ROUNDS)
        bound = statistics.median(times["slower half alone"])
        for name, values in times.items():
            ms = statistics.median(values)
            print(f"{size:>5}x{size:<2} {name:>38} {ms:10.3f} {bound / ms:13.2f}")


if __name__ == "__main__":
    main()

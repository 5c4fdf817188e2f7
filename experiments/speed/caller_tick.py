"""What the caller's learning tick costs on small stages, against the same last stage alone.

The process executor runs its last stage in the caller, so at D = 2 a learning tick of the caller
is that stage's forward, loss, backward and step, plus the pipeline's own work (feeding stage 0,
the links, the checks, the ``Result``). When the caller is the slower side, its tick is the
pipeline's time per sample. Here, for two models whose last stage learns in under 2 ms, in one
process and in rounds (each round starting one contender later), per sample:

- **plain torch**: the last stage's layers alone, one forward from a stored activation, the loss,
  the gradient of the weights and of the input, and the SGD step;
- **Stage alone**: the same layers as partime's ``Stage`` runs them (``forward`` then ``learn``);
- **pipeline**: the D = 2 process pipeline with its defaults (``graph-stash``,
  ``compensation="auto"``), its time per sample, the caller's CPU time (``time.thread_time``) and,
  of that, the time inside the hosted ``Stage``'s ``forward`` and ``learn``; "the rest" is the
  caller's CPU time outside them.

Cases: the live view's moving-digits CNN (``partime fidelity --live``; cut [3, 7], cross-entropy,
SGD at 0.1) and 8 × Conv3×3 with 24 channels at 24 × 24 (``decoupled.model``; cut [8, 8], mean
squared error to random frames, SGD at 1e-3). One torch thread in every contender.

Run with nothing else on the machine: ``.venv/bin/python experiments/speed/caller_tick.py`` (the table
in ``caller_tick.txt`` came from it).
"""

import copy
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import partime
from partime.internals import Stage, StageConfig
from partime_tools.bench.sweep import round_order
from partime_tools.fidelity.live_runs import stream_items
from partime_tools.fidelity.models import digits_model

ROUNDS = 5
SAMPLES = 400
WARM = 100

inside = {"seconds": 0.0}  # time inside Stage.forward and Stage.learn, in this process


def _timed(method: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            inside["seconds"] += time.perf_counter() - start

    return wrapped


Stage.forward = _timed(Stage.forward)  # both the Stage alone and the pipeline's hosted stage pay the wrapper
Stage.learn = _timed(Stage.learn)


def digits_case() -> tuple[nn.Sequential, list[int], list, list, nn.Module, float]:
    items = list(stream_items("digits", 0, WARM + SAMPLES))
    torch.manual_seed(0)
    return digits_model(), [3, 7], [x for x, _ in items], [y for _, y in items], nn.CrossEntropyLoss(), 0.1


class SquaredError(nn.Module):
    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out - y).pow(2).mean()


def conv_case() -> tuple[nn.Sequential, list[int], list, list, nn.Module, float]:
    sys.path.insert(0, os.path.dirname(__file__))
    from decoupled import model

    generator = torch.Generator().manual_seed(24)
    xs = [torch.randn(1, 24, 24, 24, generator=generator) for _ in range(WARM + SAMPLES)]
    ys = [torch.randn(1, 24, 24, 24, generator=generator) for _ in range(WARM + SAMPLES)]
    return model(), [8, 8], xs, ys, SquaredError(), 1e-3


def contenders(case: Callable) -> tuple[dict[str, Callable[[], dict[str, float]]], partime.Pipeline]:
    net, cut, xs, ys, loss_fn, lr = case()
    last = copy.deepcopy(net[cut[0] :])
    with torch.no_grad():
        middles = [net[: cut[0]](x) for x in xs]

    def sgd(params):
        return torch.optim.SGD(params, lr=lr)

    params = list(last.parameters())
    optimizer = sgd(params)

    def plain() -> dict[str, float]:
        start = time.perf_counter()
        for middle, y in zip(middles[WARM:], ys[WARM:]):
            into = middle.clone().requires_grad_()
            loss = loss_fn(last(into), y)
            grads = torch.autograd.grad([loss], [*params, into])
            for p, g in zip(params, grads):
                p.grad = g
            optimizer.step()
            loss.item()
        return {"ms": (time.perf_counter() - start) / SAMPLES * 1e3}

    config = StageConfig(2, loss_fn=loss_fn, optimizer=sgd, supervised=True)
    stage, count = Stage(1, copy.deepcopy(net[cut[0] :]), config), [0]

    def alone() -> dict[str, float]:
        start = time.perf_counter()
        for middle, y in zip(middles[WARM:], ys[WARM:]):
            stage.forward(count[0], middle)
            stage.learn(count[0], y)
            count[0] += 1
        return {"ms": (time.perf_counter() - start) / SAMPLES * 1e3}

    pipe = partime.Pipeline(net, cut, executor="process", threads=1, loss_fn=loss_fn, optimizer=sgd).open()
    for _ in pipe.stream(xs[:WARM], ys[:WARM]):
        pass

    def pipelined() -> dict[str, float]:
        inside["seconds"] = 0.0
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in pipe.stream(xs[WARM:], ys[WARM:]):
            pass
        ms = (time.perf_counter() - start) / SAMPLES * 1e3
        cpu_ms = (time.thread_time() - cpu) / SAMPLES * 1e3
        in_stage = inside["seconds"] / SAMPLES * 1e3
        return {"ms": ms, "caller CPU": cpu_ms, "in Stage": in_stage, "rest": cpu_ms - in_stage}

    plain()
    alone()
    return {"plain torch": plain, "Stage alone": alone, "pipeline": pipelined}, pipe


def main() -> None:
    torch.set_num_threads(1)
    for name, case in (("moving digits, cut [3, 7]", digits_case), ("8 x Conv3x3 at 24 x 24, cut [8, 8]", conv_case)):
        runs, pipe = contenders(case)
        figures: dict[str, list[dict[str, float]]] = {contender: [] for contender in runs}
        try:
            for order in round_order(list(runs), ROUNDS):
                for contender in order:
                    figures[contender].append(runs[contender]())
        finally:
            pipe.close()
        plain_ms = statistics.median(f["ms"] for f in figures["plain torch"])
        print(f"{name}: the last stage's learning tick, ms per sample (median of {ROUNDS} rounds of {SAMPLES})")
        for contender, rounds in figures.items():
            medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
            parts = ", ".join(f"{key} {value:.3f}" for key, value in medians.items() if key != "ms")
            ratio = medians["ms"] / plain_ms
            print(f"  {contender:12s} {medians['ms']:.3f}  ({ratio:.2f} x plain torch){'; ' + parts if parts else ''}")


if __name__ == "__main__":
    main()

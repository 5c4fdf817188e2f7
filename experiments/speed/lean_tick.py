"""Online learning at D = 2: partime against the bound, the plain loop and the Python floor.

For each model and cut, in one process and in rounds (each round starting one contender later),
medians of the time per sample over ``--samples`` samples after a warm-up:

- **plain loop**: the whole model learning one sample at a time (forward, cross-entropy, backward,
  the optimizer's step), one torch thread;
- **bound**: the slower of the cut's two pieces alone with plain torch, one thread (its forward, its
  backward from a fixed output gradient or from the loss, its step): the time per sample of a
  pipeline whose ticks cost nothing but the model's own work;
- **Python floor**: ``benchmarks/python_floor.py``, the simplest Python pipeline that does the same
  work (a process for stage 0, the last stage in the caller, shared-memory rings, one forward per
  sample, each sample's graph kept for its late gradient, no compensation, no checks);
- **partime**: ``Pipeline(model, cut, executor="process", threads=1)`` with the defaults
  (``graph-stash``, ``compensation="auto"``), and with ``compensation=()``, fed by ``stream``.

Cases: the moving-digits CNN of ``partime fidelity`` (``digits_model``, 24 × 24 digits, cut [3, 7])
and the bench's conv model (``conv3_net(8, 24, classes=10)``, cut [5, 5]) at 12, 24 and 48 px, each
with SGD and Adam (lr 1e-3). Run it with nothing else on the machine::

    .venv/bin/python experiments/speed/lean_tick.py > experiments/speed/lean_tick.txt
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import Tensor, nn

import partime
from partime_tools.bench.models import conv3_net
from partime_tools.bench.sweep import round_order
from partime_tools.fidelity.live_runs import stream_items
from partime_tools.fidelity.models import digits_model

FLOOR = Path(__file__).resolve().parents[2] / "benchmarks" / "python_floor.py"
OPTIMIZERS = {  # by reference: the Python floor's worker is spawned with its factory
    "SGD": functools.partial(torch.optim.SGD, lr=1e-3),
    "Adam": functools.partial(torch.optim.Adam, lr=1e-3),
}


def load_floor():
    spec = importlib.util.spec_from_file_location("python_floor", FLOOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["python_floor"] = module
    spec.loader.exec_module(module)
    return module


def case_items(case: str, count: int) -> tuple[nn.Sequential, list[int], list[Tensor], list[Tensor]]:
    torch.manual_seed(0)
    if case == "digits":
        items = list(stream_items("digits", 0, count))
        return digits_model(), [3, 7], [x for x, _ in items], [y for _, y in items]
    size = int(case.split()[-1])
    generator = torch.Generator().manual_seed(size)
    xs = [torch.randn(1, 3, size, size, generator=generator) for _ in range(count)]
    ys = [torch.randint(0, 10, (1,), generator=generator) for _ in range(count)]
    return conv3_net(8, 24, classes=10), [5, 5], xs, ys


def plain_loop(model: nn.Sequential, optimizer: Callable, xs: list[Tensor], ys: list[Tensor]) -> Callable[[int], None]:
    """The whole model learning sample ``i`` (forward, loss, backward, step), one call per sample."""
    model = copy.deepcopy(model)
    step, loss_fn = optimizer(model.parameters()), nn.CrossEntropyLoss()

    def one(i: int) -> None:
        step.zero_grad()
        loss = loss_fn(model(xs[i]), ys[i])
        loss.backward()
        step.step()
        loss.item()

    return one


def piece(
    model: nn.Sequential, cut: list[int], stage: int, optimizer: Callable, xs: list[Tensor], ys: list[Tensor]
) -> Callable[[int], None]:
    """Stage ``stage`` of the cut alone with plain torch, learning sample ``i``: its forward, its
    backward (from a fixed output gradient, or from the loss at the last stage) and its step; the
    last stage's inputs are made beforehand."""
    model = copy.deepcopy(model)
    head, tail = model[: cut[0]], model[cut[0] :]
    part = head if stage == 0 else tail
    step, loss_fn = optimizer(part.parameters()), nn.CrossEntropyLoss()
    with torch.no_grad():
        intos = [head(x) for x in xs]
    grad = torch.randn_like(intos[0])

    def one(i: int) -> None:
        step.zero_grad()
        if stage == 0:
            part(xs[i]).backward(grad)
        else:
            into = intos[i].detach().requires_grad_()
            loss = loss_fn(part(into), ys[i])
            loss.backward()
            loss.item()
        step.step()

    return one


def timed_loop(one: Callable[[int], None], count: int, warm: int) -> float:
    for i in range(warm):
        one(i)
    start = time.perf_counter()
    for i in range(warm, count):
        one(i)
    return (time.perf_counter() - start) / (count - warm) * 1e3


def timed_stream(stream: Callable[[list, list], Iterator], xs: list, ys: list, warm: int) -> float:
    for _ in stream(xs[:warm], ys[:warm]):
        pass
    start = time.perf_counter()
    for _ in stream(xs[warm:], ys[warm:]):
        pass
    return (time.perf_counter() - start) / (len(xs) - warm) * 1e3


def run_case(case: str, name: str, samples: int, warm: int, rounds: int, floor) -> dict[str, float]:
    model, cut, xs, ys = case_items(case, samples + warm)
    optimizer = OPTIMIZERS[name]
    with ExitStack() as stack:
        loops = {
            "plain loop": plain_loop(model, optimizer, xs, ys),
            "stage 0 alone": piece(model, cut, 0, optimizer, xs, ys),
            "stage 1 alone": piece(model, cut, 1, optimizer, xs, ys),
        }
        floor_pipe = stack.enter_context(floor.PythonFloor(copy.deepcopy(model), cut, xs[0], optimizer=optimizer))
        compensations = {"partime defaults": "auto", "partime, compensation=()": ()}
        pipes = {
            key: partime.Pipeline(
                copy.deepcopy(model),
                cut,
                executor="process",
                threads=1,
                loss_fn=nn.CrossEntropyLoss(),
                optimizer=optimizer,
                compensation=compensation,
            )
            for key, compensation in compensations.items()
        }
        for pipe in pipes.values():
            stack.enter_context(pipe)
        runs: dict[str, Callable[[], float]] = {
            key: (lambda one=one: timed_loop(one, len(xs), warm)) for key, one in loops.items()
        }
        runs["Python floor"] = lambda: timed_stream(floor_pipe.stream, xs, ys, warm)
        for key, pipe in pipes.items():
            runs[key] = lambda pipe=pipe: timed_stream(pipe.stream, xs, ys, warm)
        figures: dict[str, list[float]] = {key: [] for key in runs}
        torch.set_num_threads(1)
        for order in round_order(list(runs), rounds):
            for key in order:
                figures[key].append(runs[key]())
    return {key: statistics.median(values) for key, values in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="digits,conv 12,conv 24,conv 48")
    parser.add_argument("--optimizers", default="SGD,Adam")
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--warm", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    floor = load_floor()
    print(f"$ .venv/bin/python experiments/speed/lean_tick.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads at start; medians of {args.rounds} rounds")
    print(f"of {args.samples} samples after {args.warm}, ms per sample (÷ bound: the bound's time over it)")
    header = f"{'case':8s} {'opt':5s} {'plain':>7s} {'bound':>7s} {'floor':>13s} {'partime':>21s} {'partime ()':>21s}"
    print(header)
    for case, name in itertools.product(args.cases.split(","), args.optimizers.split(",")):
        m = run_case(case, name, args.samples, args.warm, args.rounds, floor)
        print(row(case, name, m), flush=True)


def row(case: str, name: str, m: dict[str, float]) -> str:
    """One line of the table: each contender's ms per sample, over the bound, and partime's over the floor."""
    bound = max(m["stage 0 alone"], m["stage 1 alone"])

    def cell(key: str) -> str:
        return f"{m[key]:.3f} ({bound / m[key]:.2f})"

    def vs_floor(key: str) -> str:
        return f"{cell(key)} {m[key] / m['Python floor']:.2f}×fl"

    return (
        f"{case:8s} {name:5s} {m['plain loop']:7.3f} {bound:7.3f} {cell('Python floor'):>13s} "
        f"{vs_floor('partime defaults'):>21s} {vs_floor('partime, compensation=()'):>21s}"
    )


if __name__ == "__main__":
    main()

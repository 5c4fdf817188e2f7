"""What each delay compensation costs a learning tick of a delayed stage.

Stage 0 of a pipeline of depth 2 (delay 2) holds ``layers[0:5]`` of the bench's ``conv3_net``;
a tick is what ``Stage`` runs per sample there: a forward, the late backward of the sample two
ticks before, and the compensated step. Each compensation option is timed alone, and ``"auto"``,
against none, interleaved in rounds (one torch thread); the medians, in ms per tick.

    python experiments/speed/compensation_cost.py --sizes 12 24 48 --rounds 7 --ticks 200
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

from partime.internals import Stage, StageConfig, check_compensation, fused
from partime_tools.bench.models import conv3_net

OPTIONS = ["none", "step-scale", "delay-correction", "optimizer-prediction", "long-momentum", "auto"]
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}


def stage_tick(layers: nn.Sequential, size: int, option: str, optimizer: str):
    """One learning tick of stage 0 of 2 with ``option`` (a function of the tick's number)."""
    compensation = () if option == "none" else check_compensation(option)
    config = StageConfig(
        2,
        compensation=compensation,
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=OPTIMIZERS[optimizer],
        grad_mode="graph-stash",
        supervised=True,
    )
    (module,) = fused([copy.deepcopy(layers[0:5])])
    stage = Stage(0, module, config)
    inputs = [torch.randn(1, 3, size, size) for _ in range(8)]
    with torch.no_grad():
        grad = torch.randn_like(layers[0:5](inputs[0]))
    samples = itertools.count()

    def tick(i: int) -> None:
        sample = next(samples)
        stage.forward(sample, inputs[i % len(inputs)])
        if sample >= 2:
            stage.backward(sample - 2, grad)

    return tick


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[12, 24, 48], help="input side, px")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    parser.add_argument("--ticks", type=int, default=200, help="ticks timed per option per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = conv3_net(8, 24, classes=10)
    print(f"{'px':>4} {'optimizer':>9} {'compensation':>20} {'ms/tick':>8} {'cost ms':>8} {'cost %':>7}")
    for size in args.sizes:
        for optimizer in OPTIMIZERS:
            ticks = {option: stage_tick(layers, size, option, optimizer) for option in OPTIONS}
            times: dict[str, list[float]] = {option: [] for option in OPTIONS}
            for _ in range(args.rounds):
                for option, tick in ticks.items():
                    for i in range(20):  # warm up
                        tick(i)
                    start = time.perf_counter()
                    for i in range(args.ticks):
                        tick(i)
                    times[option].append((time.perf_counter() - start) / args.ticks * 1e3)
            base = statistics.median(times["none"])
            for option in OPTIONS:
                ms = statistics.median(times[option])
                print(
                    f"{size:>4} {optimizer:>9} {option:>20} {ms:8.3f} {ms - base:8.3f} {100 * (ms - base) / base:6.1f}%"
                )


if __name__ == "__main__":
    print("# python " + " ".join(sys.argv))
    print(f"# {platform.machine()}, {os.cpu_count()} cores, {platform.system()}, torch {torch.__version__}, 1 thread")
    main()

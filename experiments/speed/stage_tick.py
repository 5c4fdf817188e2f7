"""One learning tick of stage 0 of the bench's conv model at D = 2, on 24 x 24 and 72 x 72 frames,
as partime's own ``Stage`` runs it under each grad mode and compensation, beside the same layers'
forward, backward and step in plain torch: what the machinery adds to a tick, with SGD and with
Adam (``compensation="auto"``: ``step-scale`` and ``delay-correction`` for SGD, ``step-scale``,
``optimizer-prediction`` and ``long-momentum`` for Adam).

Every contender computes with the allocator that partime gives the processes that run stages
(``executors.malloc.keep_freed_memory``): without it, a stage that keeps the graphs of three
samples (``graph-stash`` at delay 2) maps and unmaps its activations at every tick, and the cost
measured is the allocator's.

Run with nothing else on the machine: ``.venv/bin/python experiments/speed/stage_tick.py``
(the figures in ``stage_tick.txt`` and the README came from it).
"""

import copy
import statistics
import time

import torch
from torch import nn

from partime.internals import Stage, StageConfig, keep_freed_memory
from partime_tools.bench.models import conv3_net

SIZES = (24, 72)
"""Frame sizes: stage 0 takes about 1.5 and 10 ms a learning tick on the 2-core VM."""

torch.set_num_threads(1)
keep_freed_memory()
torch.manual_seed(0)
stage0 = conv3_net(classes=10)[:5]  # the cut balance=2 chooses: [5, 5]


def sgd(params):
    return torch.optim.SGD(params, lr=0.01)


def adam(params):
    return torch.optim.Adam(params, lr=0.001)


def partime_tick(x, grad, mode, compensation, optimizer=sgd):
    config = StageConfig(2, nn.CrossEntropyLoss(), optimizer, mode, True, compensation)
    stage, count = Stage(0, copy.deepcopy(stage0), config), [0]

    def tick():  # the forward of sample i, then the product of sample i - 2's gradient and the step
        i = count[0]
        stage.forward(i, x)
        if i >= 2:
            stage.backward(i - 2, grad)
        count[0] += 1

    return tick


def plain_tick(x, grad, make=sgd):
    model = copy.deepcopy(stage0)
    optimizer = make(model.parameters())

    def tick():
        optimizer.zero_grad()
        model(x).backward(grad)
        optimizer.step()

    return tick


def contenders(size):
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        grad = torch.randn_like(stage0(x))
    return {
        "plain torch": plain_tick(x, grad),
        "graph-stash, no compensation": partime_tick(x, grad, "graph-stash", ()),
        "graph-stash + step-scale": partime_tick(x, grad, "graph-stash", ("step-scale",)),
        "graph-stash + step-scale + delay-correction": partime_tick(
            x, grad, "graph-stash", ("step-scale", "delay-correction")
        ),
        "stash + step-scale + delay-correction": partime_tick(x, grad, "stash", ("step-scale", "delay-correction")),
        "weight-stash, no compensation": partime_tick(x, grad, "weight-stash", ()),
        "partime, no compensation": partime_tick(x, grad, "partime", ()),
        "Adam: plain torch": plain_tick(x, grad, adam),
        "Adam: graph-stash, no compensation": partime_tick(x, grad, "graph-stash", (), adam),
        "Adam: graph-stash, compensation auto": partime_tick(x, grad, "graph-stash", ("auto",), adam),
    }


def main() -> None:
    for size in SIZES:
        ticks = contenders(size)
        times = {name: [] for name in ticks}
        for tick in ticks.values():
            for _ in range(20):
                tick()
        for _ in range(5):  # rounds that alternate the contenders
            for name, tick in ticks.items():
                laps = []
                for _ in range(100):
                    start = time.perf_counter()
                    tick()
                    laps.append(time.perf_counter() - start)
                times[name].append(statistics.median(laps) * 1e3)
        print(f"{size} x {size} frames")
        plain = {"": statistics.median(times["plain torch"]), "Adam: ": statistics.median(times["Adam: plain torch"])}
        for name, laps in times.items():
            ms = statistics.median(laps)
            base = plain["Adam: " if name.startswith("Adam: ") else ""]
            print(f"  {name:45s} {ms:7.3f} ms  {ms / base:5.2f} x plain torch")


if __name__ == "__main__":
    main()

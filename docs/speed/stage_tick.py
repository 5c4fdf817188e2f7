"""One learning tick of stage 0 of the bench's conv model at D = 2, 24 x 24 frames, as partime's
own ``Stage`` runs it under each grad mode and compensation, beside the same layers' forward,
backward and step in plain torch: what the machinery adds to a tick, with SGD and with Adam
(``compensation="auto"``: ``step-scale`` and ``delay-correction`` for SGD, ``step-scale``,
``optimizer-prediction`` and ``long-momentum`` for Adam).

Run with nothing else on the machine: ``.venv/bin/python docs/speed/stage_tick.py``
(the figures in ``stage_tick.txt`` and the README came from it).
"""

import copy
import statistics
import time

import torch
from torch import nn

from partime.core.stage import Stage, StageConfig
from partime.tools.bench.models import conv3_net

torch.set_num_threads(1)
torch.manual_seed(0)
stage0 = conv3_net(classes=10)[:5]  # the cut balance=2 chooses: [5, 5]
x = torch.randn(1, 3, 24, 24)
with torch.no_grad():
    grad = torch.randn_like(stage0(x))


def sgd(params):
    return torch.optim.SGD(params, lr=0.01)


def adam(params):
    return torch.optim.Adam(params, lr=0.001)


def partime_tick(mode, compensation, optimizer=sgd):
    config = StageConfig(2, nn.CrossEntropyLoss(), optimizer, mode, True, compensation)
    stage, count = Stage(0, copy.deepcopy(stage0), config), [0]

    def tick():  # the forward of sample i, then the product of sample i - 2's gradient and the step
        i = count[0]
        stage.forward(i, x)
        if i >= 2:
            stage.backward(i - 2, grad)
        count[0] += 1

    return tick


def plain_tick(make=sgd):
    model = copy.deepcopy(stage0)
    optimizer = make(model.parameters())

    def tick():
        optimizer.zero_grad()
        model(x).backward(grad)
        optimizer.step()

    return tick


contenders = {
    "plain torch": plain_tick(),
    "graph-stash, no compensation": partime_tick("graph-stash", ()),
    "graph-stash + step-scale": partime_tick("graph-stash", ("step-scale",)),
    "graph-stash + step-scale + delay-correction": partime_tick("graph-stash", ("step-scale", "delay-correction")),
    "stash + step-scale + delay-correction": partime_tick("stash", ("step-scale", "delay-correction")),
    "weight-stash, no compensation": partime_tick("weight-stash", ()),
    "Adam: plain torch": plain_tick(adam),
    "Adam: graph-stash, no compensation": partime_tick("graph-stash", (), adam),
    "Adam: graph-stash, compensation auto": partime_tick("graph-stash", ("auto",), adam),
}
times = {name: [] for name in contenders}
for tick in contenders.values():
    for _ in range(20):
        tick()
for _ in range(5):  # rounds that alternate the contenders
    for name, tick in contenders.items():
        laps = []
        for _ in range(100):
            start = time.perf_counter()
            tick()
            laps.append(time.perf_counter() - start)
        times[name].append(statistics.median(laps) * 1e3)
for name, laps in times.items():
    print(f"{name:45s} {statistics.median(laps):.3f} ms")

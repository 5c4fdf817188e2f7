"""The inline executor against the plain model it runs, in inference, one sample at a time on one
thread: what partime's own work adds when nothing runs in parallel (the bench's conv model at D = 2,
48 x 48 frames). Beside them, the plain model under ``torch.inference_mode()`` instead of
``torch.no_grad()``. The contenders run in turn, in rounds, each round starting one contender
later than the one before; the figures are medians over rounds, of the time per sample and of its
ratio to the plain model's in the same round.

Run in a fresh process with nothing else on the machine: ``.venv/bin/python experiments/speed/inline_vs_plain.py``
(the figures in ``inline_vs_plain.txt`` came from it).
"""

import statistics
import time

import torch

import partime
from partime.internals import Stage, StageConfig
from partime_tools.bench.models import conv3_net
from partime_tools.bench.sweep import round_order

torch.set_num_threads(1)
torch.manual_seed(0)
model = conv3_net(classes=10).eval()
xs = [torch.randn(1, 3, 48, 48) for _ in range(200)]


def plain(grad_off):
    def go():
        with grad_off():
            for x in xs:
                model(x)

    return go


def inline():
    pipe = partime.Pipeline(model, [5, 5], executor="inline", threads=1)
    pipe.open()

    def go():
        for _ in pipe.stream(xs):
            pass

    return go, pipe


def stages_in_order():
    first, second = (Stage(i, module, StageConfig(2)) for i, module in enumerate((model[:5], model[5:])))

    def go():
        before = None
        for s, x in enumerate(xs):
            out = first.forward(s, x.clone())
            if before is not None:
                second.forward(s - 1, before)
            before = out
        second.forward(len(xs) - 1, before)

    return go


contenders = {"plain, no_grad": plain(torch.no_grad), "plain, inference_mode": plain(torch.inference_mode)}
run_inline, pipe = inline()
contenders["stages in the inline order"] = stages_in_order()
contenders["inline, D = 2"] = run_inline
times = {name: [] for name in contenders}
# each round starts one contender later: every contender runs after every other as often, since
# what ran just before moves a contender's time by a few percent on this machine
for round_, order in enumerate(round_order(list(contenders), 16)):
    for name in order:
        start = time.perf_counter()
        contenders[name]()
        if round_:  # the first round warms up
            times[name].append((time.perf_counter() - start) / len(xs) * 1e3)
pipe.close()
base = times["plain, no_grad"]
for name, ts in times.items():
    ratio = statistics.median(t / b for t, b in zip(ts, base))  # against the plain model in the same round
    print(f"{name:28s} {statistics.median(ts):.3f} ms per sample  ({ratio:.3f} x plain, no_grad, in the same round)")

"""Where the caller's time goes in a D = 2 process pipeline, by sampling it with py-spy.

The process executor runs its last stage in the caller, so the caller's tick is that stage's work
plus the pipeline's own (feeding, checks, links, results). Each case below streams in a process
of its own; py-spy (a sampling profiler, not one of partime's dependencies: ``.venv/bin/pip install
py-spy``) records that process for 12 s once it is warm, and the samples are sorted into: inside
the hosted stage (its module's forward, backward and step: partime's ``Stage.forward`` and
``Stage.learn``), waiting on a link, and the rest by the function that was running, the largest
first. Cases:

- ``bench-infer-48``: the bench's conv model (``conv3_net``) at 48 × 48, inference, ``balance=2``;
- ``conv-learn-24``: 8 × Conv3×3 at 24 channels (``decoupled.model``) at 24 × 24, cut [8, 8],
  learning with SGD under ``grad_mode="partime"`` and no compensation;
- ``digits-sgd`` and ``camera-adam``: the live view's models (``partime fidelity --live``) with its
  cuts, learning with the defaults.

Run with nothing else on the machine: ``.venv/bin/python experiments/speed/caller_profile.py``
(the figures in ``caller_profile.txt`` came from it).
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

import torch
from torch import nn

import partime

CASES = ("bench-infer-48", "conv-learn-24", "digits-sgd", "camera-adam")
SECONDS = 12


def pipeline_and_items(case: str) -> tuple[partime.Pipeline, list, list | None]:
    """The pipeline of ``case``, its samples, and their targets (None: in the samples, or inference)."""
    if case == "bench-infer-48":
        from partime_tools.bench.models import conv3_net

        xs = [torch.randn(1, 3, 48, 48) for _ in range(300)]
        return partime.Pipeline(conv3_net(), 2, executor="process", threads=1), xs, None
    if case == "conv-learn-24":
        sys.path.insert(0, os.path.dirname(__file__))
        from decoupled import model

        xs = [torch.randn(1, 24, 24, 24) for _ in range(300)]
        ys = [torch.randn(1, 24, 24, 24) for _ in range(300)]
        pipe = partime.Pipeline(
            model(),
            [8, 8],
            executor="process",
            threads=1,
            loss_fn=lambda out, y: (out - y).pow(2).mean(),
            optimizer=lambda params: torch.optim.SGD(params, lr=1e-3),
            grad_mode="partime",
            compensation=(),
        )
        return pipe, xs, ys
    from partime_tools.fidelity.live_runs import stream_items
    from partime_tools.fidelity.models import camera_model, digits_model, next_frame_error
    from partime_tools.fidelity.runs import optimizer_factory

    stream, optimizer, lr = ("digits", "sgd", 0.1) if case == "digits-sgd" else ("camera", "adam", 0.001)
    torch.manual_seed(0)
    model, balance = (digits_model(), [3, 7]) if stream == "digits" else (camera_model(), [4, 4])
    loss_fn = next_frame_error if stream == "camera" else nn.CrossEntropyLoss()
    pipe = partime.Pipeline(
        model, balance, executor="process", loss_fn=loss_fn, optimizer=optimizer_factory(optimizer, lr)
    )
    return pipe, list(stream_items(stream, 0, 300)), None


def stream_forever(case: str) -> None:
    """Stream ``case`` until interrupted (SIGINT); say when it is warm, then its ms per sample every 300 samples."""
    torch.set_num_threads(1)
    pipe, xs, ys = pipeline_and_items(case)
    with pipe:
        for _ in pipe.stream(xs, ys):
            pass
        print("warm", flush=True)
        try:
            while True:
                start = time.perf_counter()
                for _ in pipe.stream(xs, ys):
                    pass
                print(f"{(time.perf_counter() - start) / len(xs) * 1e3:.3f}", flush=True)
        except KeyboardInterrupt:  # how ``profile`` stops it: the pipeline then closes as it should
            pass


def summary(raw: str) -> tuple[float, float, Counter]:
    """From py-spy's raw output: the shares inside the hosted stage and waiting on a link, and the
    rest by the function that was running."""
    stage = waiting = total = 0
    rest: Counter = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = stack.split(";")
        if any(f.startswith(("Stage.forward ", "Stage.learn ")) for f in frames):
            stage += n
        elif frames[-1].startswith("wait (") and "shared_memory.py" in frames[-1]:
            waiting += n
        else:
            rest[frames[-1].split(" (")[0]] += n
    return stage / total, waiting / total, Counter({k: v / total for k, v in rest.items()})


def profile(case: str) -> None:
    worker = subprocess.Popen([sys.executable, __file__, case], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        worker.stdout.readline()  # warm
        with tempfile.NamedTemporaryFile("r", suffix=".txt") as out:
            spy = [os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "-p", str(worker.pid)]
            spy += ["-d", str(SECONDS), "-r", "500", "-f", "raw", "-o", out.name, "--nonblocking"]
            subprocess.run(spy, check=True, capture_output=True)
            stage, waiting, rest = summary(out.read())
        worker.send_signal(signal.SIGINT)
        timings = [float(line) for line in worker.communicate(timeout=60)[0].split()]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    ms = sorted(timings)[len(timings) // 2] if timings else float("nan")
    print(f"{case}: {ms:.3f} ms per sample (median over {len(timings)} runs of 300)")
    print(f"  {stage * 100:5.1f} %  inside the hosted stage (its module's forward, backward, step)")
    print(f"  {waiting * 100:5.1f} %  waiting on a link")
    for name, share in rest.most_common(8):
        print(f"  {share * 100:5.1f} %  {name}")
    print(f"  {sum(rest.values()) * 100:5.1f} %  everything else in all")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        stream_forever(sys.argv[1])
    else:
        for case in CASES:
            profile(case)

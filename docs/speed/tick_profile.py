"""Where a tick goes, in every thread of a pipeline: the process and thread executors at D = 2 on
the model of 2 ms stages (8 × Conv3×3, 24 channels, 48 × 48 frames, balance [8, 8] of its
16 layers: about 2 ms per stage), in inference and in learning with ``grad_mode="partime"``.

Each stage's worker (a process, or a thread) and the caller (which runs the last stage itself)
have their time split, per tick, into:

- **compute**: the stage's tick halves (``tick.forward_half``, ``tick.backward_half``): its
  forward, loss, backward and step, with partime's ``Stage`` around them;
- **wait in / wait out**: blocked for a message (an activation, a gradient, a result) or for a
  free slot to send one (``waiting.wait`` inside a link, ``Handoff.get``'s queue);
- **copy in / copy out**: a link's copies of the tensors it carries, out of a shared-memory slot
  and into one (``Channel.get``/``put`` without their waits; ``Handoff.put``'s ``contiguous``);
- **permit**: a worker waiting for the caller to offer the next tick;
- **rest**: everything else between the thread's first and last tick: Python of the loop, of the
  pipeline (``Pipeline.stream``, ``Result``), the checks.

The hooks are the functions named above, wrapped with ``time.perf_counter`` in every process: the
spawned workers load them from a ``sitecustomize`` that this script writes in a temporary
directory on their ``PYTHONPATH``. Each process writes its figures every ``WRITE_EVERY`` ticks. The wrappers
add about 1 µs per call.

Run with nothing else on the machine: ``.venv/bin/python docs/speed/tick_profile.py`` (the table in
``tick_profile.txt`` came from it).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HOOKS = "PARTIME_TICK_PROFILE"
"""The environment variable that holds the directory each process writes its figures to."""

SKIP = 50
"""Ticks of each thread not counted: the first ones, while the allocator and the caches warm up."""

WRITE_EVERY = 25
"""Ticks between two writes of a process's figures (the last ticks after a write are not counted)."""

CATEGORIES = ("compute", "wait in", "copy in", "wait out", "copy out", "permit", "rest")


def install(out: str) -> None:
    """Wrap the hooks (see the module) in this process; write its figures to ``out`` after every tick."""
    from partime.executors import handoff, worker_loop
    from partime.executors.process import shared_memory

    spent: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    ticks: collections.Counter[str] = collections.Counter()
    span: dict[str, list[float]] = {}
    inside = threading.local()
    path = Path(out, f"{os.getpid()}.json")

    def who() -> str:
        return f"{os.getpid()}:{threading.current_thread().name}"

    def note(category: str, seconds: float) -> None:
        name = who()
        if ticks[name] >= SKIP:
            spent[name][category] += seconds

    def timed(fn, category):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                note(category, time.perf_counter() - start)

        return wrapped

    def link_call(fn, copy, wait):
        """A link's put or get: its waits (noted by ``wait_in_link``) apart from its copies."""

        def wrapped(*args, **kwargs):
            inside.waited, inside.wait_category = 0.0, wait
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - start
                note(wait, inside.waited)
                note(copy, total - inside.waited)
                inside.wait_category = None

        return wrapped

    original_wait = shared_memory.wait

    def wait_in_link(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original_wait(*args, **kwargs)
        finally:
            if getattr(inside, "wait_category", None) is not None:
                inside.waited += time.perf_counter() - start

    def permit(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original_wait(*args, **kwargs)
        finally:
            note("permit", time.perf_counter() - start)

    original_play = worker_loop.play_tick

    def play_tick(*args, **kwargs):
        try:
            return original_play(*args, **kwargs)
        finally:
            name = who()
            ticks[name] += 1
            now = time.perf_counter()
            if ticks[name] == SKIP:
                span[name] = [now, now]
            elif ticks[name] > SKIP:
                span[name][1] = now
            if ticks[name] % WRITE_EVERY == 0:
                counted = {n: ticks[n] - SKIP for n in span}
                figures = {n: {"ticks": counted[n], "span": span[n][1] - span[n][0], **spent[n]} for n in span}
                # threads of one process write in turn, each whole: a file half written is never read
                partial = path.with_name(f"{path.name}.{threading.get_ident()}")
                partial.write_text(json.dumps(figures))
                os.replace(partial, path)

    def handoff_get(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original_handoff_get(self, *args, **kwargs)
        finally:
            note("wait in", time.perf_counter() - start)

    original_handoff_get = handoff.Handoff.get
    worker_loop.forward_half = timed(worker_loop.forward_half, "compute")
    worker_loop.backward_half = timed(worker_loop.backward_half, "compute")
    worker_loop.play_tick = play_tick
    worker_loop.wait = permit
    shared_memory.wait = wait_in_link
    shared_memory.Channel.get = link_call(shared_memory.Channel.get, "copy in", "wait in")
    shared_memory.Channel.put = link_call(shared_memory.Channel.put, "copy out", "wait out")
    handoff.Handoff.get = handoff_get
    handoff.Handoff.put = timed(handoff.Handoff.put, "copy out")


def model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Conv2d(24, 24, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers)


def profile(executor: str, learning: bool, samples: int = 400) -> dict[str, dict[str, float]]:
    """Each thread's figures for one run: ms per tick in each category, and its ticks."""
    import torch

    import partime

    with tempfile.TemporaryDirectory() as out:
        site = Path(out, "site")
        site.mkdir()
        site.joinpath("sitecustomize.py").write_text(
            f"import os, sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            f"import tick_profile\ntick_profile.install(os.environ[{HOOKS!r}])\n"
        )
        os.environ[HOOKS] = out
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        install(out)
        xs = [torch.randn(1, 24, 48, 48) for _ in range(samples)]
        kw = {}
        if learning:
            kw = dict(loss_fn=lambda out: out.pow(2).mean(), optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
            kw["grad_mode"] = "partime"
        with partime.Pipeline(model(), [8, 8], executor=executor, threads=1, **kw) as pipe:
            for _ in pipe.stream(xs[:SKIP]):  # started, and warm: the hooks skip these ticks
                pass
            start = time.perf_counter()
            for _ in pipe.stream(xs[SKIP:]):
                pass
            per_sample = (time.perf_counter() - start) / (samples - SKIP) * 1e3
        figures = {}
        for file in Path(out).glob("*.json"):
            figures.update(json.loads(file.read_text()))
    table = {}
    for name, f in figures.items():
        n = max(f["ticks"], 1)
        row = {c: f.get(c, 0.0) / n * 1e3 for c in CATEGORIES[:-1]}
        row["rest"] = f["span"] / n * 1e3 - sum(row.values())
        row["tick"] = f["span"] / n * 1e3
        table[name] = row
    table["(pipeline)"] = {"tick": per_sample}
    return table


def main() -> None:
    if len(sys.argv) == 1:  # every run, each in a process of its own
        import subprocess

        for executor in ("process", "thread"):
            for mode in ("inference", "learning"):
                subprocess.run([sys.executable, __file__, executor, mode], check=True)
                print()
        return
    executor, learning = sys.argv[1], sys.argv[2] == "learning"
    table = profile(executor, learning)
    caller = f"{os.getpid()}:MainThread"
    mode = 'learning (grad_mode="partime", SGD)' if learning else "inference"
    print(f"{executor} executor, {mode}: ms per tick ({table.pop('(pipeline)')['tick']:.3f} ms per sample overall)")
    print(f"{'thread':28}" + "".join(f"{c:>10}" for c in (*CATEGORIES, "tick")))
    for name, row in sorted(table.items(), key=lambda item: item[0] == caller):
        label = "caller (stage 1, hosted)" if name == caller else f"worker {name.split(':')[1]} (stage 0)"
        if name.endswith("MainThread") and name != caller:
            label = "worker process (stage 0)"
        print(f"{label:28}" + "".join(f"{row[c]:10.3f}" for c in (*CATEGORIES, "tick")))


if __name__ == "__main__":
    main()

"""The body of a process executor's worker, and what it is started with.

A worker rebuilds its stage (``spawning.ByValue``), resumes it from its part of a checkpoint if it
has one, or else warms it up on what it took in when the layout was learnt (``Stage.warm_up``), reports
that it is ready, and runs ``worker_loop.run_stage`` over its channels until the
caller stops it or is gone. Between two ticks it answers a request for its part of a checkpoint.
It reports on a pipe of its own to the caller, as ``(kind, payload)``.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch

from ...checkpoint.files import from_bytes, to_bytes
from ...core.boundary_values import rebuild
from ...core.stage import Stage, StageConfig
from ..in_flight import resume, stage_answer
from ..malloc import keep_freed_memory
from ..spawning import ByValue
from ..waiting import Aborted
from ..worker_loop import Links, Sent, Where, run_stage
from .shared_memory import Flag

# What a worker reports on its pipe: (kind, payload).
READY = "ready"  # None: the stage is built (and resumed), its first tick may come
FAILED = "failed"  # the arguments of a StageError
STATE = "state"  # its part of a checkpoint, as bytes of torch.save


@dataclass
class WorkerArgs:
    """Everything one worker process is started with."""

    module: ByValue  # the stage's module, its parameters in shared memory
    config: bytes  # the StageConfig, by cloudpickle: loss functions and factories may be lambdas
    threads: int
    links: Links
    stop: Flag  # every worker leaves at its next wait
    parent: int  # the caller's pid: a worker whose caller is gone leaves
    asks: Any  # a semaphore the caller releases to ask for this stage's state, between two ticks
    reports: Any  # the sending end of this worker's pipe to the caller: (kind, payload)
    resume: bytes | None = None  # torch.save of {"stage", "tick", "activation", "gradient"}
    warm: bytes | None = None  # torch.save of the tensors the stage took in when the layout was learnt


def work(w: WorkerArgs) -> None:
    """The body of a stage's process: run segments until told to stop, then leave at once."""
    # Ctrl-C reaches every process of the terminal's group: the caller handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(w.threads)
    keep_freed_memory()  # no page faults for the activations of every tick
    where = Where()
    sent = Sent()

    def check() -> None:
        if w.stop.is_set() or os.getppid() != w.parent:
            raise Aborted
        if w.asks.acquire(False):  # the caller asks for this stage's state: every stage is between two ticks
            phase, where.phase = where.phase, "checkpoint"
            w.reports.send((STATE, to_bytes(stage_answer(stage, sent))))
            where.phase = phase

    code = 0
    try:
        config: StageConfig = cloudpickle.loads(w.config)
        if config.compile is not None:
            # inductor's own pool of compiling processes would outlive this process's os._exit
            # below, its semaphores left to the resource tracker: a stage compiles in its own thread
            from torch._inductor import config as inductor

            inductor.compile_threads = 1
        stage = Stage(w.links.index, w.module.load(), config)
        links, tick = w.links, 0
        if w.resume is not None:
            where.phase = "resume"
            links, tick = resume(stage, links, from_bytes(w.resume))
        if w.warm is not None:
            value = rebuild(links.layout.into(links.index), tuple(from_bytes(w.warm)))
            stage.warm_up(value)
        w.reports.send((READY, None))
        run_stage(stage, w.links, check, where, sent, first=links, tick=tick)
    except Aborted:
        pass
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller as data
        try:
            w.reports.send((FAILED, where.report(w.links.index, exc)))
        except OSError:  # the caller is gone
            pass
        w.stop.set()
        code = 1
    # Everything this process shares belongs to the caller, and the report (if any) is already in
    # the pipe: skip the interpreter's teardown, which takes about half a second with torch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

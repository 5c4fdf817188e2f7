"""The process executor: one OS process per stage, on the CPU (internal module).

Each stage runs in its own process (``spawn``), with its own torch thread count. Stages hand
activations forward and gradients back through shared-memory ``Channel``s; the caller feeds
samples (and targets, for the last stage) and reads results through channels of its own::

    caller ──x──► stage 0 ──a──► stage 1 ──a──► … ──► stage D-1 ──result──► caller
                  stage 0 ◄──g── stage 1 ◄──g── … ◄── stage D-1 ◄──target── caller

A worker runs ``worker.run_segment`` (the loop every executor with stages of their own shares)
over these channels. A worker starts a tick only when the caller has offered it (a permit semaphore)
and counts its finished ticks on another, which is how ``sync`` knows that every stage is
between the same two ticks.

The stages' parameters live in shared memory, so the caller reads the trained weights in place;
optimizer states stay in the workers. A failure in a worker travels back as data (stage, sample,
phase, traceback) on an error queue; the worker then sets the stop event, every other worker
leaves at its next wait, and the caller raises the error as a ``StageError``. A worker that
ends without a word (killed from outside) is noticed by the caller at its next wait (within
``transport.POLL_S``) and raised as a ``WorkerDiedError`` naming the tick the stage had not
finished and that tick's sample: the caller knows every tick it offered and counts each stage's
finished ticks. A worker whose caller is gone leaves at its next wait too. ``close`` always
stops and joins every worker.

For a checkpoint the caller asks every worker, between two ticks, for its state (an "ask"
semaphore, read in the worker's abort check while it waits for the next tick); each answers on a
pipe with its ``Stage.state_dict()`` and what it sent during the last tick. Resumed workers load
their state before their first tick.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing as mp
from torch import nn

from .. import schedule
from ..checkpoint import from_bytes, to_bytes
from ..errors import StageError, WorkerDiedError
from ..stage import Stage, StageConfig
from ..transport import POLL_S, Aborted, Channel, wait
from ..worker import (
    Feeder,
    Links,
    Sent,
    Where,
    executor_state,
    result_of,
    resume,
    run_segment,
    stage_answer,
    stage_resume,
)
from .base import LOOKAHEAD, Executor, Layout, Result

log = logging.getLogger(__name__)

CAPACITY = 2
"""Slots per channel between stages: one being read while the next is written."""

JOIN_S = 5.0
"""How long ``close`` waits for a worker to leave before it terminates it."""


@dataclass
class _Worker:
    """Everything one worker process is started with."""

    module: nn.Module
    config: bytes  # the StageConfig, by cloudpickle: loss functions and factories may be lambdas
    threads: int
    links: Links
    stop: Any  # an event: every worker leaves at its next wait
    errors: Any  # a queue of failures, as dicts
    parent: int  # the caller's pid: a worker whose caller is gone leaves
    asks: Any  # a semaphore the caller releases to ask for this stage's state, between two ticks
    answers: Any  # the sending end of a pipe: the state, as bytes of torch.save
    resume: bytes | None = None  # torch.save of {"stage", "tick", "activation", "gradient"}


class ProcessExecutor(Executor):
    """Runs each stage in its own process; see the module docstring."""

    checkpoints = True

    def start(self, layout: Layout, state: dict[str, Any] | None = None) -> None:
        ctx = mp.get_context("spawn")
        depth, learning = self.depth, self.config.learning
        self._layout = layout
        self._stop = ctx.Event()
        self._errors = ctx.SimpleQueue()
        self._permits = [ctx.Semaphore(0) for _ in range(depth)]
        self._ticks = [ctx.Semaphore(0) for _ in range(depth)]
        self._seen = [0] * depth  # ticks of each worker counted by sync
        self._offered = 0  # ticks offered to the stages, over all segments
        self._asks = [ctx.Semaphore(0) for _ in range(depth)]
        pipes = [ctx.Pipe(duplex=False) for _ in range(depth)]
        self._answers = [receiver for receiver, _ in pipes]
        transit = state["transit"] if state is not None else None
        # The current segment: [first tick, first sample index, samples (None until it ends)]. Every
        # stage has finished the ticks of the segments before (flush syncs), so it is the only one.
        self._segment: list[Any] | None = None
        # The caller's own channels do not spin: on a machine with one core per stage, a caller
        # spinning for its result would take a core from a stage.
        acts = [Channel(ctx, layout.input.tensors, CAPACITY, name="input", spin_s=0)]
        acts += [Channel(ctx, spec.tensors, CAPACITY, name=f"activation {i}->{i + 1}")
                 for i, spec in enumerate(layout.activations)]
        grads = [Channel(ctx, spec.tensors, CAPACITY, name=f"gradient {i + 1}->{i}")
                 for i, spec in enumerate(layout.activations)] if learning else []
        self._targets = None
        if layout.target is not None:
            # the caller is ahead of the last stage by up to D ticks (and the lookahead) of targets
            self._targets = Channel(ctx, layout.target.tensors, depth + 1 + LOOKAHEAD, name="target", spin_s=0)
        self._results = Channel(ctx, layout.output.tensors, CAPACITY, name="result", spin_s=0)
        self._inputs = acts[0]
        self._feeder = Feeder(self._inputs, self._targets, depth)
        # Held for the executor's life: a semaphore the caller lets go of is unlinked, and a worker
        # that opens it later (the spawn start method rebuilds them in the child) fails.
        self._channels = [*acts, *grads, self._results] + ([self._targets] if self._targets else [])
        config = cloudpickle.dumps(self.config)
        self._procs: list[Any] = []
        for i, module in enumerate(self.stages):
            last = i == depth - 1
            module.share_memory()  # the caller reads the trained weights in place
            links = Links(
                index=i, layout=layout, act_in=acts[i], act_out=None if last else acts[i + 1],
                grad_in=grads[i] if learning and not last else None,
                grad_out=grads[i - 1] if learning and i > 0 else None,
                targets=self._targets if last else None, results=self._results if last else None,
                permits=self._permits[i], ticks=self._ticks[i],
            )
            resume = None if state is None else to_bytes(stage_resume(state, i))
            worker = _Worker(module, config, self.threads, links, self._stop, self._errors, os.getpid(),
                             self._asks[i], pipes[i][1], resume)
            proc = ctx.Process(target=_work, args=(worker,), name=f"partime-stage-{i}", daemon=True)
            self._procs.append(proc)
        try:
            for proc in self._procs:
                proc.start()
        except BaseException:
            self.close()
            raise
        log.debug("started %d stage processes: %s", depth, [p.pid for p in self._procs])
        self._feeder.resume(transit, self._check)

    def feed(self, index: int, x: Any, y: Any) -> None:
        """Offer sample ``index``; ``x`` None is a skipped sample: a hole, sent without a target."""
        if self._segment is None or self._segment[2] is not None:
            # a new segment begins with this sample (or, resumed from a checkpoint, ``fed`` ticks ago)
            fed = self._feeder.fed
            self._segment = [self._offered - fed, index - fed, None]
        self._feeder.feed(index, x, y, self._check)
        self._offer(1)

    def end(self) -> None:
        samples = self._feeder.end(self._check)
        if self._segment is not None:
            self._segment[2] = samples
        self._offer(schedule.segment_ticks(samples, self.depth, self.config.learning) - samples)

    def state_dict(self) -> dict[str, Any]:
        self.sync()
        for asks in self._asks:
            asks.release()
        answers = []
        for pipe in self._answers:
            while not pipe.poll(POLL_S):
                self._check()
            answers.append(from_bytes(pipe.recv_bytes()))
        return executor_state(answers, self._feeder.fed, self._feeder.in_transit())

    def _offer(self, ticks: int) -> None:
        """Let every stage run ``ticks`` more ticks."""
        for permits in self._permits:
            for _ in range(ticks):
                permits.release()
        self._offered += ticks

    def next_result(self) -> Result:
        return result_of(self._results.get(check=self._check), self._layout.output, self.config.learning)

    def sync(self) -> None:
        for i, ticks in enumerate(self._ticks):
            while self._seen[i] < self._offered:
                wait(ticks, self._check)
                self._seen[i] += 1

    def close(self) -> None:
        procs, self._procs = getattr(self, "_procs", []), []
        if not procs:
            return
        self._stop.set()
        for proc in procs:
            if proc.pid is None:
                continue
            proc.join(JOIN_S)
            if proc.is_alive():
                log.warning("stage process %s did not stop within %.0f s; terminating it", proc.name, JOIN_S)
                proc.kill()
                proc.join()
        self._errors.close()
        # Let go of the channels and semaphores, so that their segments are unlinked now.
        self._channels = self._inputs = self._targets = self._results = self._feeder = None
        self._permits = self._ticks = self._asks = self._answers = []

    def _check(self) -> None:
        """Called while the caller waits: raise a worker's failure, if there is one."""
        if not self._errors.empty():
            raise StageError(**self._errors.get())
        for i, proc in enumerate(self._procs):
            if proc.exitcode is not None:
                if not self._errors.empty():  # it reported its failure just before it left
                    raise StageError(**self._errors.get())
                raise self._died(i, proc)

    def _died(self, i: int, proc: Any) -> WorkerDiedError:
        """The error for stage ``i``, whose process ended without a word: at the tick it had not finished."""
        finished = self._seen[i]
        while self._ticks[i].acquire(False):
            finished += 1
        sample, phase, doing = self._work_at(i, finished)
        return WorkerDiedError(i, sample, phase, f"{_death(proc)} {doing}", "")

    def _work_at(self, i: int, tick: int) -> tuple[int | None, str, str]:
        """Stage ``i``'s work at ``tick`` (counted over every segment): its sample, phase, and a sentence."""
        if self._segment is None or tick < self._segment[0]:
            return None, "start", "before its first tick"
        start, base, n = self._segment
        local = tick - start
        if n is not None and local >= schedule.segment_ticks(n, self.depth, self.config.learning):
            return None, "waiting", f"between two segments, after tick {tick - 1}"
        forward = schedule.forward_sample(i, local, n)
        backward = None
        if self.config.learning and i < self.depth - 1:
            backward = schedule.backward_sample(i, local, self.depth, n)
        work = [f"the forward of sample {base + forward}"] if forward is not None else []
        work += [f"the gradient of sample {base + backward}"] if backward is not None else []
        doing = f"in tick {tick}, before finishing " + (" and ".join(work) or "it (a tick with no work)")
        if forward is not None:
            return base + forward, "forward", doing
        if backward is not None:
            return base + backward, "backward", doing
        return None, "waiting", doing


def _death(proc: Any) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"its process (pid {proc.pid}) was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"its process (pid {proc.pid}) ended with exit code {code}"


# -- the worker ---------------------------------------------------------------------------------


def _work(w: _Worker) -> None:
    """The body of a stage's process: run segments until told to stop, then leave at once."""
    # Ctrl-C reaches every process of the terminal's group: the caller handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(w.threads)
    where = Where()
    sent = Sent()

    def check() -> None:
        if w.stop.is_set() or os.getppid() != w.parent:
            raise Aborted
        if w.asks.acquire(False):  # the caller asks for this stage's state: every stage is between two ticks
            phase, where.phase = where.phase, "checkpoint"
            w.answers.send_bytes(to_bytes(stage_answer(stage, sent)))
            where.phase = phase

    code = 0
    try:
        config: StageConfig = cloudpickle.loads(w.config)
        stage = Stage(w.links.index, w.module, config)
        links, tick = w.links, 0
        if w.resume is not None:
            where.phase = "resume"
            links, tick = resume(stage, links, from_bytes(w.resume))
        run_segment(stage, links, check, where, tick=tick, sent=sent)
        while True:
            run_segment(stage, w.links, check, where, sent=sent)
    except Aborted:
        pass
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller as data
        w.errors.put(where.report(w.links.index, exc))
        w.stop.set()
        code = 1
    # Everything this process shares belongs to the caller, and the error (if any) is already in
    # the queue's pipe: skip the interpreter's teardown, which takes about half a second with torch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)



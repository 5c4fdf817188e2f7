"""The process executor: one OS process per stage but the last, which the caller runs.

Stages 0 to D-2 run each in its own process (``spawn``), with its own torch thread count; the
last stage runs in the caller itself (``hosted.py``: on a machine with a core per stage, the
caller is then no process more than there are cores, and results and targets go by reference).
Stages hand activations forward and gradients back through shared-memory ``Channel``s; the
caller feeds samples to stage 0 through a channel of its own::

    caller ──x──► stage 0 ──a──► stage 1 ──a──► … ──a──► stage D-1, in the caller ──result──► caller
                  stage 0 ◄──g── stage 1 ◄──g── … ◄──g── stage D-1 ◄──target── caller

A worker runs ``worker_loop.run_stage`` (the loop every executor with stages of their own shares)
over these channels. A worker starts a tick only when the caller has offered it (a permit semaphore)
and counts its finished ticks on another, which is how ``sync`` knows that every stage is
between the same two ticks. Every worker keeps the memory it frees for its next tick
(``malloc.keep_freed_memory``), and so does the caller while it hosts the last stage.

The stages' parameters live in shared memory, so the caller reads the trained weights in place;
optimizer states stay in the workers. Each worker reports to the caller on a pipe of its own:
that it is ready, a failure, or its part of a checkpoint. The module travels by cloudpickle (so
classes defined in ``__main__`` and layers holding lambdas go too) and is unpickled by the worker
itself, so a model that cannot be rebuilt there is reported with its traceback like any failure.

A worker given what its stage took in when the layout was learnt (``start``'s ``warm``) runs its
stage's forward on it once, on a copy, before it reports ready (``Stage.warm_up``): the first tick
of a fresh process then costs what the others do (a compiled stage compiles there).

``start`` returns once every worker is ready; then the names of every semaphore are unlinked
(``semaphore.SharedSemaphore``), so nothing is left in ``/dev/shm`` whatever happens to the
processes later, even a SIGKILL of the whole process group.

A failure in a worker travels back as data (stage, sample, phase, traceback); the worker then
sets the stop flag, every other worker leaves at its next wait, and the caller raises the error
as a ``StageError``. A worker that ends without a word (killed from outside) is noticed by the
caller at its next wait (within ``waiting.POLL_S``) and raised as a ``WorkerDiedError`` naming
the tick the stage had not finished and that tick's sample: the caller knows every tick it
offered and counts each stage's finished ticks. With a ``timeout``, a caller that waits longer
than that for any stage raises a ``StageTimeoutError`` naming the stage that is behind, and
``close`` kills that stage's process at once (a stopped or stuck process does not leave by
itself). A worker whose caller is gone leaves at its next wait too. ``close`` always stops and
joins every worker.

For a checkpoint the caller asks every worker, between two ticks, for its state (an "ask"
semaphore, read in the worker's abort check while it waits for the next tick); each answers on
its pipe with its ``Stage.state_dict()`` and what it sent during the last tick. Resumed workers
load their state before their first tick.
"""

from __future__ import annotations

import logging
import multiprocessing.process
import os
import signal
import time
import weakref
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import cloudpickle
import torch.multiprocessing as mp

from ...checkpoint.files import from_bytes, to_bytes
from ...core.boundary_values import as_tensors
from ...errors import StageError, WorkerDiedError
from ..base import Layout, with_deadline
from ..caller_ends import Feeder
from ..driver import CAPACITY, JOIN_S, Driver
from ..hosted import Count
from ..in_flight import executor_state, stage_resume
from ..spawning import ByValue, main_not_rerun
from ..waiting import POLL_S
from .semaphore import SharedSemaphore
from .shared_memory import Channel, Flag
from .shm_room import Need, SharedMemoryError, channel_bytes, check_room, sharing, tensors_bytes, weights
from .worker import FAILED, READY, WorkerArgs, work

log = logging.getLogger(__name__)


START_S = 60.0
"""The least time the caller gives the workers to start (a fresh interpreter imports torch and
rebuilds its stage), whatever the pipeline's ``timeout``."""

_SHARED = SimpleNamespace(Semaphore=SharedSemaphore)  # what the channels make their semaphores with


class ProcessExecutor(Driver):
    """Runs each stage in its own process; see the module docstring."""

    cpu_only = True
    on_this_host = True
    child_processes = True

    def start(self, layout: Layout, state: dict[str, Any] | None = None, warm: Sequence[Any] | None = None) -> None:
        ctx = mp.get_context("spawn")
        depth, learning = self.depth, self.config.learning
        self._layout = layout
        self._stop = Flag()
        workers = range(depth - 1)  # the stages with a process of their own: the caller hosts the last
        self._permits = [SharedSemaphore(0) if i in workers else Count() for i in range(depth)]
        self._ticks = [SharedSemaphore(0) if i in workers else Count() for i in range(depth)]
        self._asks = {i: SharedSemaphore(0) for i in workers}
        pipes = {i: ctx.Pipe(duplex=False) for i in workers}
        self._reports = {i: receiver for i, (receiver, _) in pipes.items()}
        self._ready = [i not in workers for i in range(depth)]
        self._states: dict[int, bytes | None] = dict.fromkeys(workers)
        self.begin()
        transit = state["transit"] if state is not None else None
        needs = self._shared_needs(layout)
        self._channels = []
        try:
            check_room(needs)  # before anything is allocated there: a clear error, and nothing left behind
            with sharing(needs):
                acts: list[Any] = [Channel(_SHARED, layout.input.tensors, CAPACITY, name="input")] if workers else []
                acts += [
                    Channel(_SHARED, spec.tensors, CAPACITY, name=f"activation {i}->{i + 1}")
                    for i, spec in enumerate(layout.activations)
                ]
                grads = (
                    [
                        Channel(_SHARED, spec.tensors, CAPACITY, name=f"gradient {i + 1}->{i}")
                        for i, spec in enumerate(layout.activations)
                    ]
                    if learning
                    else []
                )
                self._channels = [*acts, *grads]
                for i in workers:
                    self.stages[i].share_memory()  # the caller reads the trained weights in place
        except SharedMemoryError:
            self._unlink()  # the semaphores made so far: nothing of this start stays in /dev/shm
            raise
        hosted_input, _, _ = self.host(acts, grads, state)  # sets _targets, _results and _hosted
        self._inputs = acts[0] if workers else hosted_input
        self._feeder = Feeder(self._inputs, self._targets, depth)
        config = cloudpickle.dumps(self.config)
        self._procs: dict[int, Any] = {}
        for i in workers:
            module = self.stages[i]
            links = self.stage_links(i, acts, grads)
            resume = None if state is None else to_bytes(stage_resume(state, i))
            warmed = None if warm is None else to_bytes(as_tensors(warm[i], f"stage {i}'s input"))
            worker = WorkerArgs(
                ByValue(module),
                config,
                self.threads or 1,
                links,
                self._stop,
                os.getpid(),
                self._asks[i],
                pipes[i][1],
                resume,
                warmed,
            )
            self._procs[i] = ctx.Process(target=work, args=(worker,), name=f"partime-stage-{i}", daemon=True)
        try:
            with main_not_rerun():
                for proc in self._procs.values():
                    proc.start()
            for _, sender in pipes.values():
                sender.close()  # the workers hold their ends: a dead worker's pipe then reads as ended
            patience = None if self.timeout is None else max(self.timeout, START_S)
            check = with_deadline(
                self._check, patience, lambda: self._timed_out("every stage to start", None, patience)
            )
            while not all(self._ready):
                self._reports[self._ready.index(False)].poll(POLL_S)
                check()
        except BaseException:
            self.close()
            raise
        # Every worker holds every semaphore it needs: their names can go (see the module docstring).
        self._unlink()
        _RUNNING.add(self)
        log.debug("started %d stage processes: %s", len(workers), [p.pid for p in self._procs.values()])
        self._feeder.resume(transit, self._waiting("the last stage to take the targets in transit"))

    def state_dict(self) -> dict[str, Any]:
        self.sync()
        for asks in self._asks.values():
            asks.release()
        check = self._waiting("every stage's part of the checkpoint")
        for i, pipe in self._reports.items():
            while self._states[i] is None:
                pipe.poll(POLL_S)
                check()
        answers = [from_bytes(data) for data in self._states.values() if data is not None]
        if self._hosted is not None:
            answers.append(self._hosted.answer())
        self._states = dict.fromkeys(self._states)
        return executor_state(answers, self._feeder.fed, self._feeder.in_transit())

    def close(self) -> None:
        procs, self._procs = getattr(self, "_procs", {}), {}
        hosted, self._hosted = self._hosted, None
        if hosted is not None:
            hosted.close()
        if not procs:
            return
        self._stop.set()
        deadline = time.monotonic() + JOIN_S
        for i, proc in procs.items():
            if proc.pid is None:
                continue
            if i in self._stuck or not self._ready[i]:  # stopped, stuck, or not started: it would not leave now
                proc.kill()
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("stage process %s did not stop within %.0f s; killing it", proc.name, JOIN_S)
                proc.kill()
                proc.join()
        for pipe in self._reports.values():
            pipe.close()
        for proc in procs.values():
            proc.close()
        # Let go of the channels and semaphores (their names are gone already, unless start failed).
        self._unlink()
        # ... and of the shared memory, which goes with the last process that maps it
        del self._inputs, self._results, self._feeder
        self._channels, self._targets = [], None
        self._permits, self._ticks, self._asks, self._reports = [], [], {}, {}

    def _shared_needs(self, layout: Layout) -> list[Need]:
        """What ``start`` puts in shared memory, and how much of it: each channel's slots and the
        weights of each stage in a worker."""
        needs: list[Need] = [("input", channel_bytes(layout.input.tensors, CAPACITY))] if self.depth > 1 else []
        for i, spec in enumerate(layout.activations):
            needs.append((f"activation {i}->{i + 1}", channel_bytes(spec.tensors, CAPACITY)))
            if self.config.learning:
                needs.append((f"gradient {i + 1}->{i}", channel_bytes(spec.tensors, CAPACITY)))
        needs += [(f"stage {i}'s weights", tensors_bytes(weights(self.stages[i]))) for i in range(self.depth - 1)]
        return needs

    def _unlink(self) -> None:
        """Remove the names of every semaphore (``semaphore.SharedSemaphore``)."""
        for sem in [*self._permits, *self._ticks, *self._asks.values()]:
            getattr(sem, "unlink", lambda: None)()
        for channel in self._channels:
            channel.unlink()

    def _check(self) -> None:
        """Called while the caller waits: raise a worker's failure, if there is one."""
        self._read_reports()
        for i, proc in self._procs.items():
            if proc.exitcode is not None:
                self._read_reports()  # it reported its failure just before it left
                raise self._died(i, proc)

    def _read_reports(self) -> None:
        """Take in what the workers have reported; raise the first failure."""
        for i, pipe in self._reports.items():
            try:
                while pipe.poll():
                    kind, payload = pipe.recv()
                    if kind == FAILED:
                        raise StageError(**payload)
                    if kind == READY:
                        self._ready[i] = True
                    else:
                        self._states[i] = payload
            except (EOFError, OSError):  # the worker is gone: its exit code says how
                pass

    def _describe(self, i: int) -> str:
        if i not in self._procs:
            return f"stage {i} (in the caller, pid {os.getpid()})"
        return f"stage {i} (pid {self._procs[i].pid})"

    def _died(self, i: int, proc: Any) -> WorkerDiedError:
        """The error for stage ``i``, whose process ended without a word: at the tick it had not finished."""
        sample, phase, doing = self.work_at(i, self.finished(i))
        return WorkerDiedError(i, sample, phase, f"{_death(proc)} {doing}", "")


_RUNNING: weakref.WeakSet[ProcessExecutor] = weakref.WeakSet()  # executors with workers, in this process


def _forget_workers() -> None:
    """In a child made by ``os.fork()``: the workers are not its children, so multiprocessing's exit
    handler there must not terminate them (it terminates every daemon child it knows of)."""
    for executor in list(_RUNNING):
        multiprocessing.process._children.difference_update(executor._procs.values())  # type: ignore[attr-defined]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def _death(proc: Any) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"its process (pid {proc.pid}) was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"its process (pid {proc.pid}) ended with exit code {code}"

"""The thread executor: one thread per stage, in the caller's process.

Each stage but the last runs ``worker_loop.run_stage`` (the loop the process executor's workers run) in
a thread of its own, and the caller runs the last one in its own thread (``hosted.py``), over
links that hand values over by reference (``Handoff``): nothing is pickled, and nothing is copied between stages but to make a value contiguous where it is not (so that the next
stage computes the bits the process executor's would). So a model built from classes defined in
``__main__``, a notebook, ``python -c`` or stdin runs as it is, and a script needs no main guard.
The samples and targets the caller feeds are copied (the caller may reuse its buffers); results
are handed out by reference, as the inline executor does. The stages' modules are the
pipeline's own, trained in place: ``pipe.module`` reads them between two ticks.

The caller drives the threads as it drives processes (``driver.Driver``: a permit per tick, a
count of finished ticks), so ``sync``, checkpoints and the naming of a late or failed tick are
the same. A stage that raises stops every other at its next wait; the caller raises a
``StageError`` naming the stage, the sample and the phase, with the original exception as its
``__cause__``. Ctrl-C in the caller stops and joins every thread (each leaves at its next wait,
within ``waiting.POLL_S``, once its current tick's computation returns). A thread cannot be
killed: one that a timeout found stuck is left behind (it is a daemon) with a warning.

torch's threads: each stage thread sets torch's intra-op thread count for itself when it starts
(``threads``, default: the cores divided among the stages). OpenMP keeps that count per calling
thread, so the stages together use every core; the caller has the stages' count while it hosts
the last one, and its own back at ``close``.
Python's part of a tick (the loop, the modules' calls) runs one thread at a time under the GIL;
torch's kernels release it, so stages overlap as much as their kernels dominate.

torch's random stream is one per process: the stage threads that draw (dropout) take turns at it
with the caller, who holds it while it runs the user's code and gives it up only while it waits in
a call of this executor (``random_turns.Turns``), so that what the caller draws (a sample made with
``torch.randn``) and what each stage draws are what the inline executor draws, to the bit.

Every stage runs on the CPU: ``check_devices`` refuses any other device (``cpu_only``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch

from ...core.random_turns import TURNS, Caller
from ...core.stage import Stage
from ...errors import StageError
from ...result import Result
from ..base import Layout, stage_error
from ..caller_ends import Feeder
from ..driver import JOIN_S, Driver
from ..handoff import Handoff, Signal
from ..hosted import Count
from ..in_flight import executor_state, stage_answer
from ..waiting import POLL_S, Aborted
from ..worker_loop import Links, Sent, Where, run_stage

log = logging.getLogger(__name__)

_R = TypeVar("_R")


class ThreadExecutor(Driver):
    """Runs each stage in a thread of the caller's process; see the module docstring."""

    cpu_only = True
    on_this_host = True
    shares_process = True
    _turn = Caller(0, 0)  # until ``start``: no stage thread, no turn to hold

    def start(self, layout: Layout, state: dict[str, Any] | None = None, warm: Sequence[Any] | None = None) -> None:
        depth, learning = self.depth, self.config.learning
        self._layout = layout
        self.begin()
        self._stop = threading.Event()
        self._failures: queue.SimpleQueue[tuple[dict[str, Any], BaseException]] = queue.SimpleQueue()
        workers = range(depth - 1)  # the stages with a thread of their own: the caller hosts the last
        self._permits = [Signal() if i in workers else Count() for i in range(depth)]
        self._ticks = [Signal() if i in workers else Count() for i in range(depth)]
        acts = [Handoff("input", copy=True)] if workers else []
        acts += [Handoff(f"activation {i}->{i + 1}") for i in range(depth - 1)]
        grads = [Handoff(f"gradient {i + 1}->{i}") for i in range(depth - 1)] if learning else []
        hosted_input, _, _ = self.host(acts, grads, state)  # sets _targets, _results and _hosted
        self._feeder = Feeder(acts[0] if workers else hosted_input, self._targets, depth)
        self._stages: list[Stage] = []
        for i in workers:
            try:
                self._stages.append(Stage(i, self.stages[i], self.config))
            except Exception as exc:  # as a worker would report it
                raise stage_error(i, None, "start", exc) from exc
        self._sent = [Sent() for _ in range(depth)]
        self._ready = [True] * depth
        # The caller holds the turn at torch's random stream for its stage threads while it runs the
        # user's code: what it draws there (a sample) is never drawn from a stage's stream
        self._turn = TURNS.call(len(self._stages))
        self._threads: list[threading.Thread] = []
        for i, stage in enumerate(self._stages):
            links = replace(self.stage_links(i, acts, grads), spin_s=0.0)  # a spinning thread holds the GIL
            first, tick = self.resumed(stage, links, state)
            thread = threading.Thread(
                target=self._work, args=(stage, first, links, tick), name=f"partime-stage-{i}", daemon=True
            )
            self._threads.append(thread)
        for thread in self._threads:
            thread.start()
        self._feeder.resume(
            state["transit"] if state is not None else None,
            self._waiting("the last stage to take the targets in transit"),
        )

    def _work(self, stage: Stage, first: Links, links: Links, tick: int) -> None:
        """The body of a stage's thread: run segments until told to stop."""
        where = Where()

        def check() -> None:
            if self._stop.is_set():
                raise Aborted

        try:
            torch.set_num_threads(self.threads or 1)
            with TURNS.serving(self._turn, check):
                run_stage(stage, links, check, where, self._sent[stage.index], first=first, tick=tick)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the caller as data
            self._failures.put((where.report(stage.index, exc), exc))
            self._stop.set()

    def _inside(self, wait: Callable[..., _R], *args: Any) -> _R:
        """``wait(*args)``, one of the caller's waits inside partime: its stage threads may draw
        meanwhile, and after it the caller holds the turn again (``random_turns.Turns.waiting``).
        Once no stage thread draws, it is the plain call."""
        turn = self._turn
        if turn.drawers <= 0 or turn.closed:
            return wait(*args)
        try:
            with TURNS.waiting(turn, self.timeout):
                return wait(*args)
        except TimeoutError as exc:  # a stage's forward drew for longer than the timeout
            raise self._timed_out(f"{exc} (to hand the caller its turn back)", None) from exc

    def feed(self, index: int, x: Any, y: Any, learn: bool = True) -> None:
        self._inside(super().feed, index, x, y, learn)

    def next_result(self) -> Result:
        return self._inside(super().next_result)

    def end(self) -> None:
        self._inside(super().end)

    def sync(self) -> None:
        self._inside(super().sync)

    def state_dict(self) -> dict[str, Any]:
        return self._inside(self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        self.sync()  # every thread waits for its next tick: its stage may be read from here
        answers = [stage_answer(stage, sent) for stage, sent in zip(self._stages, self._sent)]
        if self._hosted is not None:
            answers.append(self._hosted.answer())
        return executor_state(answers, self._feeder.fed, self._feeder.in_transit())

    def close(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()  # first: a stage thread waiting for its turn at the random stream leaves
        TURNS.close(self._turn)  # the caller holds no turn for this pipeline now
        threads, self._threads = getattr(self, "_threads", []), []
        hosted, self._hosted = self._hosted, None
        if hosted is not None:
            hosted.close()
        if not threads:
            return
        self._stop.set()
        for i, thread in enumerate(threads):
            thread.join(POLL_S if i in self._stuck else JOIN_S)
            if thread.is_alive():
                log.warning("stage thread %s is stuck in its tick and cannot be stopped; leaving it", thread.name)
        self._stages = []

    def _check(self) -> None:
        if not self._failures.empty():
            report, exc = self._failures.get()
            raise StageError(**report) from exc

    def _describe(self, i: int) -> str:
        if i >= len(self._threads):
            return f"stage {i} (in the caller's thread)"
        return f"stage {i} (thread {self._threads[i].name})"

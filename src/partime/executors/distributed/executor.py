"""The distributed executor: one stage per torch.distributed rank, started by torchrun.

Every rank runs the same script under ``torchrun``; rank r hosts stage r, on ``cuda:LOCAL_RANK``
where there are GPUs and on the CPU otherwise. Rank 0 reads the stream, so ``stream``, ``step``
and ``flush`` return results there; the last rank sends them back::

    rank 0                      rank 1                       rank D-1
    caller ──x──► stage 0 ──a──► stage 1 ──a──► … ──a──► stage D-1 ──result──► caller (rank 0)
                  stage 0 ◄──g── stage 1 ◄──g── … ◄──g── stage D-1 ◄──target── caller (rank 0)
    caller ──permits (learning), snapshot requests──► every rank ──weights──► caller

Each stage runs ``worker_loop.run_stage``, the loop the process executor's workers run: on rank 0 in a
thread beside the caller (which only feeds samples and takes results), on the other ranks in the
script's own thread, inside ``Pipeline.open`` (``with pipe:``), until rank 0 closes the pipeline.
There ``stream`` then yields nothing, ``step`` returns None and ``flush`` []. When learning, a
stage starts a tick only once rank 0's caller has offered it (a permit travels to every rank per
tick; in inference, where no weight changes, ranks > 0 run as their inputs come), so between two
ticks ``pipe.module`` on rank 0 can fetch every stage's weights: each rank sends its stage's
``state_dict`` when asked (at every ``flush`` and every read of ``pipe.module``); optimizer states
stay on their ranks. At the first sample rank 0 publishes the cut and every boundary's layout in
the process group's store and sends each rank its stage's weights, and the mode (``train()`` or
``eval()``) of each of its modules, so all ranks start alike.

Skipped samples (``nonfinite="skip"``) travel as the SKIP messages of ``run_segment``: rank 0 feeds
a hole, and the links carry SKIPs with no tensors (or a result's output, for a skipped loss).

Checkpoints: between two ticks rank 0 asks every rank for its part (``in_flight.stage_answer``: its
stage's state and what it sent during the last tick), which each puts in the store, and gathers
them in the format every executor shares (``executors/base.py``). A rank that runs ahead in
inference answers with what it sent at that tick (``worker_loop.SentLog``). A resumed pipeline puts
each rank's part in the store with the cut, and every stage starts at the checkpoint's tick.

Communication: one link per direction and purpose (activations i→i+1, gradients i+1→i, results,
targets, control 0→r, reply r→0), each a process group of its own with a thread at each end
(``link.py``, which says how that avoids gloo's traps); failures are published in the store
and seen by every rank within a fraction of a second (``ranks.py``).

A fixed order of blocking operations per tick was the alternative. It was not chosen because
``run_segment`` sends an activation forward before it receives the gradient back, and with
unbuffered sends stage i would wait on stage i+1 to receive while i+1 waits on i to take its
gradient: a deadlock, avoided only by ordering every tick's transfers boundary by boundary, which
serialises the D-1 hops of a tick and makes rank 0's caller take part in every one. With threads,
a hop overlaps the next computation and the stage loop is the one the shared-memory executor runs.
The caller takes each result when due, which bounds what is in flight on every link to about D ticks.
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Callable, Sequence, Sized
from typing import Any, cast

import torch
from torch import nn

from ...checkpoint.files import from_bytes, to_bytes
from ...core.stage import Stage, StageConfig
from ...core.stats_record import StatsRecord
from ...errors import StageTimeoutError
from ..base import READ_AHEAD, Layout, with_deadline
from ..caller_ends import Feeder
from ..driver import Driver
from ..in_flight import executor_state, resume, stage_answer, stage_resume
from ..messages import KIND_CHECKPOINT, KIND_PERMIT, KIND_SNAPSHOT, KIND_STATE
from ..waiting import Aborted, wait
from ..worker_loop import Links, Sent, Where, run_stage
from .link import Permits
from .plan import Plan, config_key, local_channel, modes_of, state_specs, wires
from .ranks import CLOSE_S, FAILED_CLOSE_S, Run, join_group
from .serving import serve as serve_rank

log = logging.getLogger(__name__)

CAPACITY = 2
"""Samples rank 0's caller may queue for stage 0 (and, with one stage, results for itself)."""


# -- the executor, on rank 0 ---------------------------------------------------------------------


class DistributedExecutor(Driver):
    """Rank 0's part: stage 0 in a thread, and the caller's links to every rank (module docstring).

    ``Pipeline`` asks the class which rank it is on (``rank``); on ranks > 0 it calls ``serve``
    in ``open``, and on rank 0 ``cancel`` if it closes before its first sample. Feeding, ending a
    segment and taking results are the driver's (``driver.Driver``); offering ticks, ``sync`` and
    the waits are this executor's own, since only stage 0 runs here.
    """

    rank = staticmethod(join_group)

    @classmethod
    def check_devices(cls, devices: Sequence[str | torch.device] | None, depth: int) -> list[str]:
        """Stage r runs on rank r's device: ``devices`` must be None."""
        names = super().check_devices(devices, depth)
        if devices is not None:
            raise ValueError(
                f"the distributed executor puts stage r on rank r's device (cuda:LOCAL_RANK, or the CPU "
                f"without GPUs); leave devices=None, got {names}"
            )
        return names

    def start(self, layout: Layout, state: dict[str, Any] | None = None, warm: Sequence[Any] | None = None) -> None:
        depth, config = self.depth, self.config
        self._run = run = Run(0, depth)
        self._layout = layout
        self._names = [[k for k, _ in state_specs(s)] for s in self.stages]
        self.begin()
        self._seen_zero = self._synced = 0  # ticks stage 0 has finished, as sync counted them; ticks synced
        plan = Plan(
            tuple(len(cast(Sized, s)) for s in self.stages),  # layers: an nn.Sequential's or a traced run's
            layout,
            config_key(config),
            tuple(state_specs(s) for s in self.stages),
            resumed=state is not None,
            random_state=None if config.random_state is None else config.random_state.numpy().tobytes(),
            modes=tuple(modes_of(s) for s in self.stages),
            first_trained=config.first_trained,
            parameter_names=config.parameter_names,
        )
        if state is not None:
            for r in range(1, depth):
                run.publish(f"resume {r}", to_bytes(stage_resume(state, r)))
        run.publish("plan", pickle.dumps(plan))
        run.wait_store("ready", self._waiting("every rank to take the plan"), least=depth - 1)
        run.connect(wires(plan, depth))
        for r in range(1, depth):  # every rank starts with rank 0's weights
            run.links[f"control 0->{r}"].put(
                KIND_STATE, 0, list(self.stages[r].state_dict().values()), check=run.health.check
            )
        last = depth == 1
        self._inputs = local_channel(layout.input.tensors, CAPACITY, "input")
        self._results = run.link("result") or local_channel(layout.output.tensors, CAPACITY, "result")
        self._targets = None
        if layout.target is not None:
            self._targets = run.link("target") or local_channel(layout.target.tensors, depth + 1 + READ_AHEAD, "target")
        self._feeder = Feeder(self._inputs, self._targets, depth)
        self._permit_zero, self._ticks_zero = Permits(0), threading.Semaphore(0)
        # Statistics: only stage 0's record is here (a GPU's norm comes without a wait); the other
        # stages' would be written in their ranks' processes, which no memory of this one reaches.
        self.records = [StatsRecord(pinned=run.device.type == "cuda") if config.stats else None]
        links = Links(
            index=0,
            layout=layout,
            act_in=self._inputs,
            act_out=run.link("activation 0->1"),
            grad_in=run.link("gradient 1->0"),
            targets=self._targets if last else None,
            results=self._results if last else None,
            permits=self._permit_zero,
            ticks=self._ticks_zero,
            record=self.records[0],
        )
        self._stage, self._sent = Stage(0, self.stages[0], config, run.device), Sent()
        first, tick = links, 0
        if state is not None:
            first, tick = resume(self._stage, links, stage_resume(state, 0))
        self._threads_before = torch.get_num_threads()
        self._thread = threading.Thread(
            target=self._stage_zero, args=(first, tick, links), name="partime stage 0", daemon=True
        )
        self._thread.start()
        if state is not None:
            self._feeder.resume(state["transit"], self._waiting("the last stage to take the targets in transit"))

    def _stage_zero(self, first: Links, tick: int, links: Links) -> None:
        health, where, stage = self._run.health, Where(), self._stage
        try:
            torch.set_num_threads(self.threads or 1)
            run_stage(stage, links, health.stop_check, where, self._sent, first=first, tick=tick)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the caller as data
            health.stage_failed(where, exc)

    def _offer(self, ticks: int) -> None:
        """Let every stage run ``ticks`` more ticks."""
        if ticks <= 0:
            return
        self._permit_zero.release(ticks)
        self._offered += ticks
        for r in range(1, self.depth if self.config.learning else 1):  # see ``serve``
            self._run.links[f"control 0->{r}"].put(KIND_PERMIT, self._offered, check=self._run.health.check)

    def sync(self) -> None:
        """Wait until every stage has run every tick offered, and fetch the weights of ranks > 0."""
        run, check = self._run, self._waiting(f"every stage to finish tick {self._offered - 1}")
        if self._synced == self._offered:
            return
        for r in range(1, self.depth):
            run.links[f"control 0->{r}"].put(KIND_SNAPSHOT, self._offered, check=check)
        while self._seen_zero < self._offered:
            wait(self._ticks_zero, check, spin_s=0)
            self._seen_zero += 1
        for r in range(1, self.depth):
            message = run.links[f"reply {r}->0"].get(check=check)
            assert message.kind == KIND_STATE and message.index == self._offered, (message.kind, message.index)
            self.stages[r].load_state_dict(dict(zip(self._names[r], message.tensors)))
        self._synced = self._offered

    def state_dict(self) -> dict[str, Any]:
        """Every stage's state and the values in transit, gathered on rank 0 between two ticks: each
        rank puts its part (``in_flight.stage_answer``, by ``torch.save``) in the store."""
        self.sync()
        run, check = self._run, self._waiting("every stage's part of the checkpoint")
        for r in range(1, self.depth):
            run.links[f"control 0->{r}"].put(KIND_CHECKPOINT, self._offered, scalar=self._feeder.fed, check=check)
        answers = [stage_answer(self._stage, self._sent)]  # stage 0 waits for the next tick: read it here
        for r in range(1, self.depth):
            message = run.links[f"reply {r}->0"].get(check=check)
            assert message.kind == KIND_CHECKPOINT and message.index == self._offered, (message.kind, message.index)
            answer = run.store.get(run.prefix + f"checkpoint {r}")
            answers.append(from_bytes(answer))
        return executor_state(answers, self._feeder.fed, self._feeder.in_transit())

    def _check(self) -> None:
        self._run.health.check()

    def _describe(self, i: int) -> str:
        return f"stage {i} (rank {i})"

    def _waiting(self, what: str, stage: int | None = None) -> Callable[[], None]:
        """The check for one wait of rank 0's caller: the run's failure, and a ``StageTimeoutError``
        naming ``stage`` (or, without one, the stage furthest behind that rank 0 can tell: stage 0
        if it has not finished the ticks offered, else the last) once it has lasted ``timeout``."""

        def expired() -> StageTimeoutError:
            behind = stage
            if behind is None:
                behind = 0 if self._seen_zero < self._offered else self.depth - 1
            return StageTimeoutError(
                behind,
                None,
                "waiting",
                f"rank 0's caller waited {self.timeout:g} s for {what} (rank {behind}); is that "
                f"rank's process stopped, or does its stage block? Pass a larger timeout= if a "
                f"tick may take that long",
            )

        return with_deadline(self._check, self.timeout, expired)

    def close(self) -> None:
        run: Run | None = getattr(self, "_run", None)  # None before start
        if run is None:
            return
        del self._run  # a second close finds none
        run.health.closing = True  # stage 0 leaves at its next wait
        for r in range(1, self.depth):
            if f"control 0->{r}" in run.links:
                run.links[f"control 0->{r}"].hang_up()  # rank r leaves at its next wait
        thread = getattr(self, "_thread", None)
        if thread is not None:
            run.health.poll()  # after a failure a link may be stuck on a peer that is gone
            thread.join(CLOSE_S if run.health.failure is None else FAILED_CLOSE_S)
            torch.set_num_threads(self._threads_before)
        run.close()

    @staticmethod
    def cancel(failure: str | None) -> None:
        """Rank 0 closes before its first sample: the other ranks stop waiting for it."""
        run = Run(0, 0)
        run.publish("plan", pickle.dumps(failure))

    @staticmethod
    def serve(rank: int, model: nn.Sequential, config: StageConfig, threads: int) -> None:
        """Ranks > 0: run stage ``rank`` of the pipeline rank 0 starts, until rank 0 closes it.

        Returns at once if rank 0 closes the pipeline before its first sample; raises the run's
        failure (a ``StageError``) if any rank fails.
        """
        serve_rank(rank, model, config, threads)

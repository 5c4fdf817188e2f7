"""The caller's side of an executor whose stages run in workers of their own.

The process and thread executors share it: their workers run ``worker_loop.run_segment`` over links,
and the caller drives them tick by tick. A worker starts a tick only once the caller has offered
it (a permit per stage and tick) and counts each finished tick on another semaphore, so ``sync``
knows when every stage is between the same two ticks (to read the weights, or take a
checkpoint), and a failure or a timeout can be placed: the caller knows every tick it offered,
each stage's finished ticks, and the sample of each (``work_at``). What a subclass gives:

- in ``start``: ``_permits`` and ``_ticks`` (one semaphore each per stage), ``_feeder``
  (``caller_ends.Feeder`` over the input and target links), ``_targets`` and ``_results`` (the last
  stage's links), ``_layout``, ``_ready`` (whether each worker has built its stage), and
  ``begin()``; then ``stage_links`` gives each stage its links;
- ``_check()``: raise a worker's failure, if there is one; ``_describe(i)``: stage ``i``'s worker in
  words (its pid, its thread);
- ``start``, ``state_dict`` and ``close``.

The caller runs the last stage itself (``host``): every tick is offered to the workers first, and
then run by the caller once it is fed, so that the workers start it at once, beside the caller.

In inference the caller runs the stage it hosts one tick behind (``decoupled``): ``feed`` offers
tick t and runs the hosted stage's tick t - 1, so that stage 0 may start sample t while the
hosted stage still works on an earlier one, and a slow tick of one stage is absorbed by a slot of
slack instead of stalling the other. The tick left behind is run before anything needs it: a
result not out yet (``next_result``: a ``step`` still returns the result of its own tick), the end
of a segment, a ``sync`` or a checkpoint. The stages run the same ticks on the same values in the
same order (SPEC.md): only when the caller runs its own changes. Learning stays in lockstep: the
hosted stage's gradient is what the stage before it waits for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..core import schedule
from ..core.stage import Stage
from ..core.stats_record import StatsRecord
from ..errors import StageTimeoutError
from ..result import Result
from .base import Executor, Layout, stage_error, with_deadline
from .caller_ends import Feeder, result_of
from .hosted import HostedStage, Local
from .in_flight import resume, stage_resume
from .waiting import wait
from .worker_loop import Link, Links

CAPACITY = 2
"""Messages a link between stages holds: one being read while the next is written."""

JOIN_S = 5.0
"""How long ``close`` waits for the workers to leave (then a process is killed, a thread left)."""


class Driver(Executor):
    """Feeds samples, offers ticks, takes results and waits for workers (see the module docstring)."""

    checkpoints = True
    has_workers = True

    _permits: list[Any]
    _ticks: list[Any]
    _feeder: Feeder
    _targets: Link | None
    _results: Link
    _layout: Layout
    _ready: list[bool]
    _hosted: HostedStage | None = None  # the last stage, if the caller runs it (``host``)
    _behind: int | None = None  # the hosted stage's tick offered and not run yet (inference: ``decoupled``)

    decoupled = True
    """Whether the caller runs the stage it hosts one tick behind in inference (see the module)."""

    def begin(self) -> None:
        """Set up the counts: call once in ``start``, before the first wait."""
        self._seen = [0] * self.depth  # ticks of each worker counted by sync
        self._offered = 0  # ticks offered to the stages, over all segments
        # The current segment: [first tick, first sample index, samples (None until it ends)]. Every
        # stage has finished the ticks of the segments before (flush syncs), so it is the only one.
        self._segment: list[Any] | None = None
        self._fed_at: deque[tuple[int, int]] = deque(maxlen=2 * self.depth + 8)  # (tick, sample) of the newest
        self._stuck: set[int] = set()  # stages found behind by a timeout: ``close`` stops them at once
        # statistics: in shared memory where a stage runs in a child process, else a plain tensor
        stats = self.config.stats
        self.records = [StatsRecord(shared=self.child_processes) if stats else None for _ in range(self.depth)]

    def stage_links(self, i: int, acts: Sequence[Link], grads: Sequence[Link]) -> Links:
        """Stage ``i``'s links: ``acts[i]`` into it (the samples, for stage 0), ``acts[i + 1]`` out of it,
        the gradients ``grads[i]`` in and ``grads[i - 1]`` out (when learning), and at the last stage
        the targets and results; its permits and its count of finished ticks."""
        last, learning = i == self.depth - 1, self.config.learning
        return Links(
            index=i,
            layout=self._layout,
            act_in=acts[i],
            act_out=None if last else acts[i + 1],
            grad_in=grads[i] if learning and not last else None,
            grad_out=grads[i - 1] if learning and i > 0 else None,
            targets=self._targets if last else None,
            results=self._results if last else None,
            permits=self._permits[i],
            ticks=self._ticks[i],
            record=self.records[i],
        )

    def host(
        self, acts: Sequence[Link], grads: Sequence[Link], state: dict[str, Any] | None
    ) -> tuple[Local, Local | None, Local]:
        """Run the last stage in the caller (``hosted.py``): built, and resumed from ``state``, here.

        ``acts[-1]`` is what it takes in (the input, at D = 1: then give None, and use the first
        link returned). Its permits and finished ticks are ``_permits[-1]`` and ``_ticks[-1]``
        (set them to ``hosted.Count()`` first). Returns its ends for the caller: the input (for D =
        1), the targets (if it takes any) and the results.
        """
        i = self.depth - 1
        inputs = Local("input", copy=True)
        targets = Local("target", copy=True) if self._layout.target is not None else None
        results = Local("result")
        self._targets, self._results = targets, results
        links = replace(self.stage_links(i, [*acts[:i], inputs] if i == 0 else acts, grads), permits=None)
        try:
            stage = Stage(i, self.stages[i], self.config)
        except Exception as exc:  # as a worker would report it
            raise stage_error(i, None, "start", exc) from exc
        first, tick = self.resumed(stage, links, state)
        self._hosted = HostedStage(stage, links, first=first, tick=tick, threads=self.threads or 1)
        return inputs, targets, results

    @staticmethod
    def resumed(stage: Stage, links: Links, state: dict[str, Any] | None) -> tuple[Links, int]:
        """The links and the tick ``stage`` starts its first segment on: ``links`` at tick 0, or where
        the checkpoint ``state`` left it (``in_flight.resume``); a failure is the stage's ``StageError``."""
        if state is None:
            return links, 0
        try:
            return resume(stage, links, stage_resume(state, stage.index))
        except Exception as exc:
            raise stage_error(stage.index, None, "resume", exc) from exc

    def feed(self, index: int, x: Any, y: Any, learn: bool = True) -> None:
        """Offer sample ``index``; ``x`` None is a skipped sample: a hole, sent without a target;
        ``learn`` False a sample only predicted."""
        if self._segment is None or self._segment[2] is not None:
            # a new segment begins with this sample (or, resumed from a checkpoint, ``fed`` ticks ago)
            fed = self._feeder.fed
            self._segment = [self._offered - fed, index - fed, None]
        # The workers are offered the tick first: they may start it at once (they have its inputs
        # already), beside the stage the caller hosts, which runs it here once it is fed.
        self._fed_at.append((self._offered, index))
        self._offer(1)
        self._feeder.feed(index, x, y, self._waiting(f"stage 0 to take sample {index}", 0), learn)
        if self._hosted is None:
            return
        if self.decoupled and self.depth > 1 and not self.config.learning:
            self.catch_up()  # the tick before, left behind: this one is left behind in its turn
            self._behind = self._offered - 1
        else:
            self._hosted.run_tick(self._waiting_for_hosted(self._offered - 1))

    def catch_up(self) -> None:
        """Run the hosted stage's tick left behind, if there is one (see the module)."""
        if self._behind is not None and self._hosted is not None:
            tick, self._behind = self._behind, None
            self._hosted.run_tick(self._waiting_for_hosted(tick))

    def end(self) -> None:
        self.catch_up()
        samples = self._feeder.fed
        if self._segment is not None:
            self._segment[2] = samples
        ticks = schedule.segment_ticks(samples, self.depth, self.config.learning) - samples
        self._offer(ticks)
        self._feeder.end(self._waiting("stage 0 to take the end of the segment", 0))
        if self._hosted is not None:
            for tick in range(self._offered - ticks, self._offered):
                self._hosted.run_tick(self._waiting_for_hosted(tick))

    def _offer(self, ticks: int) -> None:
        """Let every stage run ``ticks`` more ticks."""
        for permits in self._permits:
            for _ in range(ticks):
                permits.release()
        self._offered += ticks

    def next_result(self) -> Result:
        results = self._results
        if self._behind is not None and isinstance(results, Local) and results.empty():
            self.catch_up()  # the result comes out of the tick left behind
        waiting = self._waiting("the next result", self.depth - 1)
        result = result_of(self._results.get(check=waiting), self._layout.output, self.config.learning)
        self._feeder.used(result.index)
        return result

    def sync(self) -> None:
        self.catch_up()
        check = self._waiting(f"every stage to finish tick {self._offered - 1}")
        for i, ticks in enumerate(self._ticks):
            while self._seen[i] < self._offered:
                wait(ticks, check)
                self._seen[i] += 1

    def _check(self) -> None:
        """Called while the caller waits: raise a worker's failure, if there is one."""
        raise NotImplementedError

    def _describe(self, i: int) -> str:
        """Stage ``i``'s worker, in words."""
        raise NotImplementedError

    def _waiting_for_hosted(self, tick: int) -> Callable[[], None]:
        """The check while the hosted last stage runs ``tick`` (it waits on the stage before it)."""
        if self.depth == 1:
            return self._waiting(f"stage 0 to run tick {tick}")
        return self._waiting(f"stage {self.depth - 2}'s activation for tick {tick}", self.depth - 2)

    def _waiting(self, what: str, stage: int | None = None) -> Callable[[], None]:
        """The check for one wait of the caller, for ``what``: a worker's failure, and a
        ``StageTimeoutError`` once the wait has lasted ``timeout`` (``stage``: the stage waited on)."""
        return with_deadline(self._check, self.timeout, lambda: self._timed_out(what, stage))

    def _timed_out(self, what: str, stage: int | None, waited: float | None = None) -> StageTimeoutError:
        """The error for a wait that lasted ``timeout``: it names the stage with the fewest finished
        ticks (the one holding the others up), or ``stage`` if every stage has finished its ticks."""
        for i, ticks in enumerate(self._ticks):
            while ticks.acquire(False):
                self._seen[i] += 1
        if not all(self._ready):
            behind = self._ready.index(False)
            sample, phase, doing = None, "start", "not ready: it has not built its stage yet"
        else:
            behind = min(range(self.depth), key=lambda i: self._seen[i])
            if self._seen[behind] >= self._offered and stage is not None:
                behind = stage
            sample, phase, doing = self.work_at(behind, self._seen[behind])
        self._stuck.add(behind)
        return StageTimeoutError(
            behind,
            sample,
            phase,
            f"the caller waited {waited or self.timeout:g} s for {what}; {self._describe(behind)} "
            f"has finished {self._seen[behind]} of the {self._offered} ticks offered, and is "
            f"{doing}: is it stopped, or does its forward block? Pass a larger "
            f"timeout= if a tick may take that long",
            "",
        )

    def finished(self, i: int) -> int:
        """How many ticks stage ``i`` has finished, as far as its semaphore says now."""
        while self._ticks[i].acquire(False):
            self._seen[i] += 1
        return self._seen[i]

    def work_at(self, i: int, tick: int) -> tuple[int | None, str, str]:
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

        def sample(position: int) -> int:  # indices may have gaps: a refused sample uses one up
            return next((index for at, index in self._fed_at if at == start + position), base + position)

        work = [f"the forward of sample {sample(forward)}"] if forward is not None else []
        work += [f"the gradient of sample {sample(backward)}"] if backward is not None else []
        doing = f"in tick {tick}, before finishing " + (" and ".join(work) or "it (a tick with no work)")
        if forward is not None:
            return sample(forward), "forward", doing
        if backward is not None:
            return sample(backward), "backward", doing
        return None, "waiting", doing

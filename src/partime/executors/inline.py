"""The inline executor: SPEC.md written as plain code, in one thread.

Every stage runs in the caller's thread, one after another within a tick, with the messages of
a tick (activations forward, gradients back) delivered at the next tick. While it is open the
caller's torch thread count is the stages' own (``threads``), as in the workers of the other
executors; ``close`` gives the caller its own back. The caller's process keeps the memory it frees
for the next tick (``malloc.keep_freed_memory``), as the processes that run stages do. It is the reference
every other executor is tested against, and a way to simulate the learning of a D-stage
pipeline on one core.

Every sample and target fed is taken as a contiguous tensor of its own (a copy of what the caller
fed, which may reuse its buffers), and every value handed from one stage to another in the strides
of its boundary's layout (``boundary_values.rebuild``), as the executors that send values between
processes take them: so they compute the same to the bit.

What a stage does in a tick is ``tick.forward_half`` and ``tick.backward_half``; this executor
only orders them and carries their messages (a sample skipped under ``nonfinite="skip"``, fed as
``x = None``, goes in as a ``tick.Skip``; one fed with ``learn=False`` as a ``tick.Data`` marked
``predicted``).

With ``config.stats`` each stage's two halves are timed as its tick (``stats_record.TickClock``):
what comes between two of them (the other stages' halves, the caller's own work) is its wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..checkpoint.files import CheckpointError, message
from ..core import schedule
from ..core.boundary_values import ValueSpec, as_tensors, rebuild
from ..core.stage import Stage
from ..core.stats_record import StatsRecord, TickClock
from ..core.tick import Data, Passed, Skip, backward_half, forward_half
from ..result import Result
from .base import Executor, Layout, stage_error
from .malloc import keep_freed_memory


class InlineExecutor(Executor):
    """Runs each tick of the schedule in the calling thread."""

    checkpoints = True
    shares_process = True
    _acts: list[Passed | None]  # into stage i, sent at tick - 1
    _grads: list[Passed | None]  # into stage i, from stage i + 1
    _targets: dict[int, Any]

    def start(self, layout: Layout, state: dict[str, Any] | None = None, warm: Sequence[Any] | None = None) -> None:
        # the stages compute at their own thread count, as they would in workers: to the bit alike
        self._threads_before = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        keep_freed_memory()  # as in every process that runs stages: no page faults for each tick's activations
        self._layout = layout
        self._stages = []
        for i, (module, device) in enumerate(zip(self.stages, self.devices)):
            try:
                self._stages.append(Stage(i, module, self.config, device))
            except Exception as exc:  # as a worker reports it
                raise stage_error(i, None, "start", exc) from exc
        self._results: deque[Result] = deque()
        self._begin_segment()
        if state is not None:
            self._resume(layout, state)
        if self.config.stats:
            pinned = [torch.device(d).type == "cuda" for d in self.devices]  # a GPU's norm comes without a wait
            records = [StatsRecord(pinned=p) for p in pinned]
            for stage, record in zip(self._stages, records):
                record.begin(stage)
            self.records = records

    def state_dict(self) -> dict[str, Any]:
        transit = None
        if self._fed:

            def sent(value: Passed | None) -> dict[str, Any] | None:
                if value is None:
                    return None
                if isinstance(value, Skip):
                    return message(value.sample, None)
                return message(value.sample, as_tensors(value.value, "value in transit"), value.predicted)

            transit = {
                "tick": self._tick,
                "acts": [sent(a) for a in self._acts],
                "grads": [sent(g) for g in self._grads],
                "targets": [sent(Data(s, y)) for s, y in self._targets.items() if y is not None],
            }
        return {"stages": [stage.state_dict() for stage in self._stages], "transit": transit}

    def _resume(self, layout: Layout, state: dict[str, Any]) -> None:
        for stage, stage_state in zip(self._stages, state["stages"], strict=True):
            stage.load_state_dict(stage_state)
        transit = state["transit"]
        if transit is None:
            return

        def value(sent: dict[str, Any] | None, spec: Any) -> Passed | None:
            if sent is None:
                return None
            if sent["tensors"] is None:
                return Skip(sent["sample"])
            return Data(sent["sample"], rebuild(spec, tuple(sent["tensors"])), sent.get("predicted", False))

        self._tick = self._fed = transit["tick"]
        self._acts = [value(a, layout.into(i)) for i, a in enumerate(transit["acts"])]
        self._grads = [value(g, layout.activations[i] if g else None) for i, g in enumerate(transit["grads"])]
        self._targets = {}
        if transit["targets"]:
            if layout.target is None:
                raise CheckpointError(
                    f"damaged checkpoint: it has {len(transit['targets'])} targets in transit but no layout.target"
                )
            self._targets = {t["sample"]: rebuild(layout.target, tuple(t["tensors"])) for t in transit["targets"]}

    def _begin_segment(self) -> None:
        self._tick = 0
        self._fed = 0
        self._acts = [None] * self.depth
        self._grads = [None] * self.depth
        self._targets = {}
        self._clocks = [TickClock() for _ in range(self.depth)]  # the stages' ticks, timed for their statistics

    def feed(self, index: int, x: Any, y: Any, learn: bool = True) -> None:
        """Offer sample ``index`` (``x`` None: a skipped sample, a hole; ``learn`` False: only
        predicted) and run one tick."""
        self._acts[0] = Skip(index) if x is None else Data(index, _own(x), not learn)
        if learn:
            self._targets[index] = _own(y)
        self._fed += 1
        self._run_tick(None)

    def end(self) -> None:
        n = self._fed
        total = schedule.segment_ticks(n, self.depth, self.config.learning)
        while self._tick < total:
            self._run_tick(n)
        self._begin_segment()

    def next_result(self) -> Result:
        return self._results.popleft()

    def sync(self) -> None:
        pass

    def close(self) -> None:
        self._stages = []
        torch.set_num_threads(self._threads_before)

    def _run_tick(self, num_samples: int | None) -> None:
        """One tick: every stage's two halves (``tick``), in order; what they send lands next tick."""
        depth, tick, learning = self.depth, self._tick, self.config.learning
        acts: list[Passed | None] = [None] * depth
        grads: list[Passed | None] = [None] * depth
        for i, stage in enumerate(self._stages):
            self._clocks[i].start()
            last = i == depth - 1
            message = self._acts[i]
            if schedule.forward_sample(i, tick, num_samples) is not None and message is not None:
                target = self._targets.pop(message.sample, None) if last else None
                try:
                    sent = forward_half(stage, message, last, _returning(target))
                except Exception as exc:
                    raise stage_error(i, message.sample, stage.phase, exc) from exc
                if sent.activation is not None:
                    acts[i + 1] = _laid_out(sent.activation, self._layout.activations[i])
                if sent.gradient is not None:
                    grads[i - 1] = _laid_out(sent.gradient, self._layout.activations[i - 1])
                if sent.result is not None:
                    self._results.append(sent.result)
            message = self._grads[i]
            if (
                learning
                and not last
                and message is not None
                and schedule.backward_sample(i, tick, depth, num_samples) is not None
            ):
                try:
                    back = backward_half(stage, message)
                except Exception as exc:
                    raise stage_error(i, message.sample, stage.phase, exc) from exc
                if back is not None:
                    grads[i - 1] = _laid_out(back, self._layout.activations[i - 1])
            record = self.records[i] if self.records else None
            if record is not None:
                record.tick(stage, *self._clocks[i].end())
        self._acts, self._grads = acts, grads
        self._tick += 1


def _own(value: Any) -> Any:
    """A contiguous copy of a value fed by the caller (None stays None)."""
    if value is None:
        return None
    copies = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in as_tensors(value, "value"))
    return copies[0] if isinstance(value, Tensor) else copies


def _laid_out(message: Passed, spec: ValueSpec) -> Passed:
    """``message`` with its value in the strides of its boundary's layout ``spec`` (copied only where
    it has others), as a link between processes hands it on."""
    if isinstance(message, Skip):
        return message
    return Data(message.sample, rebuild(spec, as_tensors(message.value, "value")), message.predicted)


def _returning(value: Any) -> Callable[[], Any]:
    """A function that returns ``value``: bound now, not to a loop variable that moves on."""
    return lambda: value

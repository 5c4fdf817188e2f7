"""The inline executor: SPEC.md written as plain code, in one thread (internal module).

Every stage runs in the caller's thread, one after another within a tick, with the messages of
a tick (activations forward, gradients back) delivered at the next tick. It is the reference
every other executor is tested against, and a way to simulate the learning of a D-stage
pipeline on one core.

Every value handed from one stage to another, and every sample and target fed, is taken as a
contiguous tensor of its own (a copy of what the caller fed, which may reuse its buffers), as the
executors that send values between processes take it: so they compute the same to the bit.

A sample skipped under ``nonfinite="skip"`` is fed as ``x = None``: a hole that moves through the
stages like a warm-up tick (nothing is computed on it) and comes out as a result with no output.
A skipped sample (a hole, or a non-finite loss) sends back the gradient ``None``: each stage that
would have applied its gradient does not step, and passes the ``None`` on.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch
from torch import Tensor

from .. import schedule
from ..checkpoint import message
from ..stage import Stage
from ..values import as_tensors, rebuild
from .base import Executor, Layout, Result, stage_error


class InlineExecutor(Executor):
    """Runs each tick of the schedule in the calling thread."""

    checkpoints = True

    def start(self, layout: Layout, state: dict[str, Any] | None = None) -> None:
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

    def state_dict(self) -> dict[str, Any]:
        transit = None
        if self._fed:
            def sent(value: tuple[int, Any] | None) -> dict[str, Any] | None:
                if value is None:
                    return None
                return message(value[0], None if value[1] is None else as_tensors(value[1], "value in transit"))

            transit = {"tick": self._tick, "acts": [sent(a) for a in self._acts], "grads": [sent(g) for g in self._grads],
                       "targets": [sent(t) for t in self._targets.items() if t[1] is not None]}
        return {"stages": [stage.state_dict() for stage in self._stages], "transit": transit}

    def _resume(self, layout: Layout, state: dict[str, Any]) -> None:
        for stage, stage_state in zip(self._stages, state["stages"], strict=True):
            stage.load_state_dict(stage_state)
        transit = state["transit"]
        if transit is None:
            return

        def value(sent: dict[str, Any] | None, spec: Any) -> tuple[int, Any] | None:
            if sent is None:
                return None
            return sent["sample"], None if sent["tensors"] is None else rebuild(spec, tuple(sent["tensors"]))

        self._tick = self._fed = transit["tick"]
        self._acts = [value(a, layout.into(i)) for i, a in enumerate(transit["acts"])]
        self._grads = [value(g, layout.activations[i] if g else None) for i, g in enumerate(transit["grads"])]
        self._targets = dict(value(t, layout.target) for t in transit["targets"])

    def _begin_segment(self) -> None:
        self._tick = 0
        self._fed = 0
        self._acts: list[tuple[int, Any] | None] = [None] * self.depth  # into stage i, sent at tick - 1
        self._grads: list[tuple[int, Any] | None] = [None] * self.depth  # into stage i, from stage i + 1
        self._targets: dict[int, Any] = {}

    def feed(self, index: int, x: Any, y: Any) -> None:
        """Offer sample ``index`` (``x`` None: a skipped sample, a hole) and run one tick."""
        self._acts[0] = (index, _own(x))
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

    def _run_tick(self, num_samples: int | None) -> None:
        """One tick: every stage does its forward, then its backward; messages land next tick."""
        depth, tick = self.depth, self._tick
        acts: list[tuple[int, Any] | None] = [None] * depth
        grads: list[tuple[int, Any] | None] = [None] * depth
        for i, stage in enumerate(self._stages):
            if schedule.forward_sample(i, tick, num_samples) is not None:
                index, value = self._acts[i]
                target = self._targets.pop(index, None) if i == depth - 1 else None
                if value is None:  # a hole: nothing to compute, no gradient will come
                    if i < depth - 1:
                        acts[i + 1] = (index, None)
                    else:
                        self._results.append(Result(index, None, None, skipped=True))
                        if self.config.learning and i > 0:
                            grads[i - 1] = (index, None)
                else:
                    try:
                        out = stage.forward(index, value)
                        if i < depth - 1:
                            acts[i + 1] = (index, _contiguous(out))
                        elif not self.config.learning:
                            self._results.append(Result(index, out))
                        else:
                            loss, grad = stage.learn(index, target)
                            skipped = not math.isfinite(loss)  # a non-finite loss was skipped
                            self._results.append(Result(index, out, loss, skipped=skipped))
                            if i > 0:
                                grads[i - 1] = (index, None if skipped else _contiguous(grad))
                    except Exception as exc:
                        raise stage_error(i, index, stage.phase, exc) from exc
            if self.config.learning and i < depth - 1:
                if schedule.backward_sample(i, tick, depth, num_samples) is not None:
                    index, grad = self._grads[i]
                    if grad is None:  # the sample was skipped: no step
                        stage.drop(index)
                    else:
                        try:
                            grad = stage.backward(index, grad)
                        except Exception as exc:
                            raise stage_error(i, index, stage.phase, exc) from exc
                    if i > 0:
                        grads[i - 1] = (index, _contiguous(grad))
        self._acts, self._grads = acts, grads
        self._tick += 1


def _own(value: Any) -> Any:
    """A contiguous copy of a value fed by the caller (None stays None)."""
    if value is None:
        return None
    copies = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in as_tensors(value, "value"))
    return _rebuild_like(value, copies)


def _contiguous(value: Any) -> Any:
    """``value`` with every tensor contiguous (copied only where it is not)."""
    if value is None:
        return None
    return _rebuild_like(value, tuple(t.contiguous() for t in as_tensors(value, "value")))


def _rebuild_like(value: Any, tensors: tuple[Tensor, ...]) -> Any:
    """``tensors`` in the form of ``value``: a bare tensor, or a tuple."""
    return tensors[0] if isinstance(value, Tensor) else tensors

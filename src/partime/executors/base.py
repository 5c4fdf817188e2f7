"""What an executor is: the interface every way of running the stages implements (internal).

An executor runs the stages of one pipeline tick by tick, exactly as SPEC.md says, and hands
back one ``Result`` per sample in sample order. The ``Pipeline`` validates what the user gives,
counts ticks and samples, and talks to its executor only through this interface, so that a new
executor (CUDA streams, torch.distributed ranks) is one new module beside the others.

The life of an executor::

    ex = SomeExecutor(stages, devices, config, threads, timeout)
    ex.start(layout)          # once, when the first sample has fixed every boundary's layout
    ex.feed(index, x, y)      # offer one sample: the next tick of the current segment
    ex.next_result()          # the next result in sample order (blocks until it is out)
    ex.end()                  # no more samples in this segment: run the ticks that remain
    ex.sync()                 # every stage has finished every tick offered so far
    ex.close()                # stop, join, free; always safe to call, also after a failure

An executor that can take checkpoints (``checkpoints = True``) also has ``state_dict()``,
asked between two ticks once every stage has finished them (after ``sync``), and takes that
state back as ``start(layout, state)``. The state is the same for every executor, so that a
checkpoint moves between them::

    {"stages": [Stage.state_dict() of each stage],
     "transit": None after a flush, else {"tick": ticks run in this segment,
                "acts": [None or message into stage i], "grads": [None or message into stage i],
                "targets": [messages: the targets fed that the last stage has not used yet]}}

where a message is ``checkpoint.message(sample, tensors)``: what a stage sent during the last tick
and its neighbour takes at the next.
"""

from __future__ import annotations

import time
import traceback as tb
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ..errors import StageError
from ..stage import StageConfig
from ..values import ValueSpec

LOOKAHEAD = 1
"""How many ticks ``Pipeline.stream`` offers beyond the result it hands out next: the stages then
never wait for the caller between two ticks. Executors size their caller-side buffers for it."""


@dataclass
class Result:
    """What one sample yields: its index, the pipeline's output and, when learning, its loss.

    ``skipped`` under ``nonfinite="skip"``: the sample did not take part in learning. Its input
    was not finite (then ``output`` and ``loss`` are None: it never went forward), or its loss
    was not finite (then both are there, and no gradient was applied for it). ``target`` is the
    sample's target (a copy) when one was given, so that a result can be scored on its own.
    """

    index: int
    output: Tensor | tuple[Tensor, ...] | None
    loss: float | None = None
    skipped: bool = False
    target: Tensor | tuple[Tensor, ...] | None = None


@dataclass(frozen=True)
class Layout:
    """The layout of every boundary, learnt from the first sample (and its target)."""

    input: ValueSpec
    activations: tuple[ValueSpec, ...]  # the output of stage i, for i < D - 1
    output: ValueSpec
    target: ValueSpec | None

    def into(self, stage: int) -> ValueSpec:
        """The layout of what stage ``stage`` takes in: the sample, or the previous stage's output."""
        return self.input if stage == 0 else self.activations[stage - 1]


class Executor(ABC):
    """Runs ``stages`` (one module each, on ``devices``) as one pipeline configured by ``config``."""

    checkpoints: bool = False
    """Whether this executor has ``state_dict`` and takes a state in ``start``."""

    has_workers: bool = False
    """Whether it runs the stages in workers of its own (processes, threads), which ``close`` stops."""

    def __init__(self, stages: list[nn.Module], devices: list[str], config: StageConfig, threads: int | None,
                 timeout: float | None = None):
        self.stages = stages
        self.devices = devices
        self.config = config
        self.threads = threads
        self.timeout = timeout  # the longest the caller waits for a stage, in seconds (None: no limit)
        self.depth = len(stages)

    @abstractmethod
    def start(self, layout: Layout) -> None:
        """Get ready to run; called once, before the first ``feed``.

        An executor with ``checkpoints`` takes ``start(layout, state)``: then it resumes from
        ``state`` (see the module docstring).
        """

    def state_dict(self) -> dict[str, Any]:
        """Every stage's state and the values in transit, between two ticks (see the module docstring)."""
        raise NotImplementedError(f"the {type(self).__name__} cannot take checkpoints")

    @abstractmethod
    def feed(self, index: int, x: Any, y: Any) -> None:
        """Offer sample ``index`` (and its target, or None): run the next tick of the segment."""

    @abstractmethod
    def next_result(self) -> Result:
        """The next result in sample order; only called when one is due."""

    @abstractmethod
    def end(self) -> None:
        """End the segment: run the ticks that remain until every sample is done."""

    @abstractmethod
    def sync(self) -> None:
        """Return once every stage has finished every tick offered so far."""

    @abstractmethod
    def close(self) -> None:
        """Stop and release everything; idempotent, and safe after a failure."""


def with_deadline(check: Callable[[], None], timeout: float | None,
                  expired: Callable[[], BaseException]) -> Callable[[], None]:
    """``check`` for one wait of the caller that raises ``expired()`` once the wait has lasted
    ``timeout`` seconds (``check`` itself when there is no timeout)."""
    if timeout is None:
        return check
    deadline = time.monotonic() + timeout

    def checked() -> None:
        check()
        if time.monotonic() > deadline:
            raise expired()

    return checked


def stage_error(stage: int, sample: int | None, phase: str, exc: BaseException) -> StageError:
    """The error a failure of ``stage`` in ``phase`` of ``sample`` surfaces as."""
    text = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
    return StageError(stage, sample, phase, f"{type(exc).__name__}: {exc}", text)

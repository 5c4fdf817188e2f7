"""What an executor is: the interface every way of running the stages implements.

An executor runs the stages of one pipeline tick by tick, exactly as SPEC.md says, and hands
back one ``Result`` per sample in sample order. The ``Pipeline`` validates what the user gives,
counts ticks and samples, and talks to its executor only through this interface, so that a new
executor (CUDA streams, torch.distributed ranks) is one new module beside the others.

The life of an executor::

    ex = SomeExecutor(stages, devices, config, threads, timeout)
    ex.start(layout, warm=inputs)  # once, when a sample has fixed every boundary's layout
    ex.feed(index, x, y)      # offer one sample: the next tick of the current segment
                              # (learn=False: a sample only predicted, not learnt from)
    ex.next_result()          # the next result in sample order (blocks until it is out)
    ex.end()                  # no more samples in this segment: run the ticks that remain
    ex.sync()                 # every stage has finished every tick offered so far
    ex.close()                # stop, join, free; always safe to call, also after a failure

Before an executor is made, its class answers for it: ``check_devices`` (which devices it takes),
``rank`` (which rank this process is) and, for ranks other than the caller's, ``serve`` and
``cancel``; the defaults are those of an executor that runs every stage from the caller's process.

With ``config.stats`` an executor keeps a ``StatsRecord`` for each stage whose runner writes one
(``records``, made in ``start``; None for a stage it cannot read cheaply), and ``stats()`` reads them.

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
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..core.boundary_layout import Layout
from ..core.stage import StageConfig
from ..core.stats_record import StatsRecord
from ..errors import StageError
from ..result import Result
from ..stats import StageStats

READ_AHEAD = 1
"""How many ticks ``Pipeline.stream`` offers beyond the result it hands out next: the stages then
never wait for the caller between two ticks. Executors size their caller-side buffers for it."""


class Executor(ABC):
    """Runs ``stages`` (one module each, on ``devices``) as one pipeline configured by ``config``."""

    checkpoints: ClassVar[bool] = False
    """Whether this executor has ``state_dict`` and takes a state in ``start``."""

    has_workers: ClassVar[bool] = False
    """Whether it runs the stages in workers of its own (processes, threads), which ``close`` stops."""

    cpu_only: ClassVar[bool] = False
    """Whether it runs every stage on the CPU (``check_devices`` refuses any other device)."""

    on_this_host: ClassVar[bool] = False
    """Whether its workers share this machine's cores (more stages than cores is then worth a warning)."""

    shares_process: ClassVar[bool] = False
    """Whether it runs every stage in the caller's process (they then share torch's caches: dynamo's
    compiled forwards among them)."""

    child_processes: ClassVar[bool] = False
    """Whether its workers are child processes of the caller (SIGTERM then closes the pipeline:
    ``partime.pipeline.sigterm``)."""

    records: Sequence[StatsRecord | None] = ()
    """Each stage's statistics record, with ``config.stats`` (see the module docstring)."""

    # -- what the class says before any pipeline runs on it --------------------------------------

    @classmethod
    def check_devices(cls, devices: Sequence[str | torch.device] | None, depth: int) -> list[str]:
        """The device of each of ``depth`` stages (the CPU for every stage when ``devices`` is None),
        or a ValueError that says what this executor accepts."""
        if devices is None:
            return ["cpu"] * depth
        names = [str(torch.device(d)) for d in devices]
        if len(names) != depth:
            raise ValueError(f"devices and stages differ in number (stages: {depth}, devices: {len(names)})")
        if cls.cpu_only and any(d != "cpu" for d in names):
            raise ValueError(f"the {cls.kind()} executor runs stages on the CPU only, got devices {names}")
        return names

    @classmethod
    def kind(cls) -> str:
        """The name a pipeline is given to choose this executor (``executor="process"``)."""
        return cls.__name__.removesuffix("Executor").lower()

    @staticmethod
    def rank(depth: int) -> int:
        """Which rank of the pipeline this process is: 0, the one that feeds the samples and takes
        the results, for an executor that runs every stage from the caller's process.

        The distributed executor runs one stage per rank and answers this process's rank; on a
        rank > 0 the pipeline reads no stream and ``serve`` runs that rank's stage instead."""
        return 0

    @staticmethod
    def serve(rank: int, model: nn.Sequential, config: StageConfig, threads: int) -> None:
        """Run stage ``rank`` (> 0) of the pipeline that rank 0 runs, until rank 0 closes it."""
        raise NotImplementedError("this executor runs every stage from rank 0; no other rank serves one")

    @staticmethod
    def cancel(failure: str | None) -> None:
        """Rank 0 closes (after ``failure``, if any) before its first sample: nothing to tell other ranks."""

    # -- the life of one executor -----------------------------------------------------------------

    def __init__(
        self,
        stages: list[nn.Module],
        devices: list[str],
        config: StageConfig,
        threads: int | None,
        timeout: float | None = None,
    ):
        self.stages = stages
        self.devices = devices
        self.config = config
        self.threads = threads
        self.timeout = timeout  # the longest the caller waits for a stage, in seconds (None: no limit)
        self.depth = len(stages)

    @abstractmethod
    def start(self, layout: Layout, state: dict[str, Any] | None = None, warm: Sequence[Any] | None = None) -> None:
        """Get ready to run; called once, before the first ``feed``.

        An executor with ``checkpoints`` may be given a ``state``: then it resumes from it (see the
        module docstring). Others are never given one.

        ``warm`` is what each stage took in when the layout was learnt (the first stage the sample,
        each other the output of the one before): a stage in a process of its own runs its
        forward on it, on a copy and without gradients, before it reports ready, so that its first
        tick takes no longer than the others (its kernels chosen, its memory mapped). Stages in
        the caller's process need none: the layout's forward ran there. None when the layout came
        from a checkpoint.
        """

    def stats(self) -> list[StageStats]:
        """The statistics of each stage with a record, as its runner last wrote them: read at once,
        whatever the stages are doing (``stats_record``)."""
        return [record.read(i) for i, record in enumerate(self.records) if record is not None]

    def state_dict(self) -> dict[str, Any]:
        """Every stage's state and the values in transit, between two ticks (see the module docstring)."""
        raise NotImplementedError(f"the {type(self).__name__} cannot take checkpoints")

    @abstractmethod
    def feed(self, index: int, x: Any, y: Any, learn: bool = True) -> None:
        """Offer sample ``index`` (and its target, or None): run the next tick of the segment.

        ``learn`` False (only in a pipeline that learns): the sample goes forward as a predicted one
        (``tick.Data.predicted``) and is not learnt from; ``y`` is then None (no stage needs it).

        ``y`` is the pipeline's own copy of the target, which becomes the result's: an executor may
        hold it as it is (a checkpoint's targets in transit), and hands a stage a copy of its own."""

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


def with_deadline(
    check: Callable[[], None], timeout: float | None, expired: Callable[[], BaseException]
) -> Callable[[], None]:
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


__all__ = ["READ_AHEAD", "Executor", "Layout", "stage_error", "with_deadline"]

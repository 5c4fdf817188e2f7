"""A pipeline's life and the running of its executor (internal module, below ``pipeline``).

``Running`` holds what ``Pipeline`` keeps and does what every one of its verbs rests on: open and
close, start the executor at the first sample (or a loaded checkpoint), feed one sample per tick,
take results in order, and close everything on a stage's failure (``_guard``), after which the
pipeline refuses more samples with a ``PipelineClosedError`` that names the failure.

A pipeline has one caller at a time: ``step``, ``flush`` and a ``stream`` from its first item to
its end (or until it is closed or let go) each hold it (``_claim``), and any of them called
meanwhile, from any thread, raises a RuntimeError before it feeds anything. A learning pipeline
also refuses to be fed under ``torch.no_grad()`` or ``torch.inference_mode()``
(``_check_grad_mode``), which would leave its stages no autograd to learn with.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch
from torch import nn

from ..checkpoint.files import layout_from_plain
from ..core.boundary_layout import Result
from ..core.boundary_values import nonfinite
from ..core.stage import StageConfig
from ..errors import PipelineClosedError, StageError
from ..executors import Executor
from ..planning.partition import Partition, plan, split
from ..sources import Clock
from .sample_reading import layout_of
from .sigterm import SigtermGuard
from .skip_warning import SkipWatch
from .state import PipelineState

if TYPE_CHECKING:
    from typing_extensions import Self

# the pipeline's logger: these messages read as the pipeline's, for those who configure that one
log = logging.getLogger("partime.pipeline.pipeline")

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Running:
    """The state of a pipeline (set by ``Pipeline.__init__``), its lifecycle and its executor."""

    depth: int
    _pid: int
    _status: str  # new -> open -> closed
    _executor: Executor | None
    _executor_class: type[Executor]
    _devices: list[str]
    _threads: int
    _timeout: float | None
    _model: nn.Sequential
    _balance: int | Sequence[int]
    _config: StageConfig
    _sigterm: SigtermGuard | None
    _state: PipelineState
    _partition: Partition | None
    _failure: str | None
    _skips: SkipWatch
    _rank: int  # the distributed executor runs one stage per rank; on ranks > 0 the pipeline serves its stage
    _clock: Clock  # what results are timed on: the clock of the source streamed last (partime.sources)
    _caller: threading.Lock  # held by the one caller using the pipeline now (step, flush, a stream)
    _user: str | None  # what holds it, for the message another caller gets

    def open(self) -> Self:
        """Make the pipeline ready for samples (its workers start at the first one)."""
        if self._status != "new":
            done = "opened" if self._status == "open" else "closed"
            raise PipelineClosedError(f"this pipeline was already {done}; make a new one")
        self._status = "open"
        if self._sigterm is not None:
            self._sigterm.install()
        if self._rank > 0:  # serve this rank's stage until rank 0 closes the pipeline
            self._guard(self._executor_class.serve, self._rank, self._model, self._config, self._threads)
        return self

    def close(self) -> None:
        """Stop and join every worker; the results still inside the pipeline are dropped.

        In a process made by ``os.fork()`` from the one that opened the pipeline, it only marks this
        copy closed: the workers belong to that process.
        """
        was_open, self._status = self._status == "open", "closed"
        if os.getpid() != self._pid:
            return
        if self._sigterm is not None:
            self._sigterm.restore()  # first: a SIGTERM while the workers are joined ends the program
        if self._executor is not None:
            self._executor.close()
        elif was_open and self._rank == 0:
            self._executor_class.cancel(self._failure)  # ranks > 0 wait for the first sample

    def __del__(self) -> None:
        executor = getattr(self, "_executor", None)
        if self._status == "open" and executor is not None and executor.has_workers and os.getpid() == self._pid:
            warnings.warn(
                f"an open partime Pipeline ({self._executor_class.__name__}) was garbage-collected; its "
                "workers are stopped now. Close it: `with pipe:`, or pipe.close()",
                ResourceWarning,
                source=self,
                stacklevel=2,
            )
            self.close()

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _plan(self, sample: Any) -> Partition:
        """The partition, timing layers (if it must) with the thread count each stage will have."""
        before = torch.get_num_threads()
        torch.set_num_threads(self._threads)
        try:
            return plan(self._model, self._balance, sample, learning=self._config.learning)
        finally:
            torch.set_num_threads(before)

    def _check_open(self) -> None:
        if os.getpid() != self._pid:
            raise PipelineClosedError(
                f"this pipeline was opened by process {self._pid}; this process ({os.getpid()}), made from it by "
                "os.fork(), cannot use it (its workers belong to that process): make a new Pipeline here"
            )
        if self._status == "new":
            raise PipelineClosedError("the pipeline is not open: use `with pipe:` (or pipe.open())")
        if self._failure is not None:
            raise PipelineClosedError(f"the pipeline stopped after an error: {self._failure}")
        if self._status == "closed":
            raise PipelineClosedError("the pipeline is closed; make a new one")

    def _claim(self, verb: str) -> None:
        """Hold the pipeline for ``verb`` (``"step()"``, ``"flush()"``, ``"stream()"``) until
        ``_release``; a RuntimeError, before anything is fed, if another caller holds it."""
        if not self._caller.acquire(blocking=False):
            raise RuntimeError(self._busy(verb))
        self._user = verb

    def _release(self) -> None:
        """Let the next caller in."""
        self._user = None
        self._caller.release()

    def _check_free(self, verb: str) -> None:
        """A RuntimeError if another caller holds the pipeline now (see ``_claim``)."""
        if self._caller.locked():
            raise RuntimeError(self._busy(verb))

    def _busy(self, verb: str) -> str:
        """Why ``verb`` cannot run now, and what to do."""
        if self._user == "stream()":
            return (
                f"{verb} was called while a stream() of this pipeline has not finished: a pipeline is used "
                "by one caller at a time. Finish that stream first, or close it (.close() on the generator "
                "stream() returned, or let go of it: a `break` out of `for r in pipe.stream(...)` does); "
                "the samples it left in flight come out first from the next call. For two streams at "
                "once, make two pipelines"
            )
        return (
            f"{verb} was called while a {self._user or 'call'} of this pipeline is running in another "
            "thread: a pipeline is used by one caller at a time. Call it from one thread at a time (one "
            "thread that feeds the pipeline, or a lock of yours around its calls); for two streams at "
            "once, make two pipelines"
        )

    def _check_grad_mode(self, verb: str) -> None:
        """A RuntimeError if the pipeline learns and ``verb`` was called where autograd is off."""
        if not self._config.learning:
            return
        if torch.is_inference_mode_enabled():
            where = "torch.inference_mode() (torch.is_inference_mode_enabled() is True)"
        elif not torch.is_grad_enabled():
            where = "torch.no_grad() (torch.is_grad_enabled() is False)"
        else:
            return
        raise RuntimeError(
            f"this pipeline learns, but {verb} was called under {where}, where its stages could build no "
            "graph for the loss's gradient; nothing was fed. Call step(), stream() and flush() with "
            "gradients on, and put torch.no_grad() around your metric code only: the pipeline's outputs "
            "are detached already, so scoring them builds no graph"
        )

    def _running(self, x: Any, y: Any) -> Executor:
        """The executor; started first, from sample ``x`` (and target ``y``) or the loaded
        checkpoint, if it is not running yet."""
        if self._executor is not None:
            return self._executor
        with torch.random.fork_rng(devices=[]):  # planning and starting draw nothing from the caller's stream
            return self._guard(self._start, x, y)

    def _start(self, x: Any, y: Any) -> Executor:
        """Fix the partition and every boundary's layout from the first sample (or the loaded
        checkpoint); start the executor."""
        state = self._state
        self._config.supervised = bool(state.supervised)
        if self._partition is None:
            self._partition = self._plan(x)
            log.info("balanced: %s", self._partition)
        stages = split(self._model, self._partition.balance)
        resume, state.resume = state.resume, None
        layout = layout_of(stages, x, state.y_spec) if resume is None else layout_from_plain(resume["layout"])
        state.layout = layout
        self._executor = executor = self._executor_class(
            stages, self._devices, self._config, self._threads, self._timeout
        )
        if resume is None:
            self._guard(executor.start, layout)
        else:
            self._guard(executor.start, layout, resume)
        return executor

    def _feed(self, x: Any, y: Any, at: float | None = None) -> None:
        """Offer one sample, which arrived at ``at`` (now, if None): run one tick, without taking its result."""
        if at is None:
            at = self._clock.now()
        self._check_open()
        index = self._state.next_index
        try:
            self._state.check_sample(index, x, y, self._config.learning)
            bad = nonfinite(x)
            if bad is not None and self._config.nonfinite == "raise":
                raise ValueError(f"sample {index} is not finite: {bad}; pass nonfinite='skip' to drop such samples")
        except (TypeError, ValueError):
            self._state.next_index += 1  # a refused sample uses up its index (see the class docstring)
            raise
        executor = self._running(x, y)
        # a skipped sample goes in as a hole (None): the stages compute nothing on it
        self._guard(executor.feed, index, None if bad is not None else x, y)
        self._state.fed(index, y, at)

    def _due(self) -> int:
        """How many results have left the pipeline and not been handed out."""
        return self._state.due(self.depth)

    def _take(self) -> Result:
        """The next result in sample order: a dropped sample's, or the next to leave the pipeline."""
        state = self._state
        if state.next_is_dropped():
            return state.handed_out(state.dropped.popleft(), self._clock.now())
        if state.held:
            result = state.held.popleft()
        else:
            assert self._executor is not None, "no result is held, so the executor has started"
            result = self._guard(self._executor.next_result)
        state.handed_out(result, self._clock.now())
        if self._config.nonfinite == "skip":
            self._skips.note(result)
        return result

    def _guard(self, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """Call into the executor; on a stage's failure close everything, then re-raise."""
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, StageError):
                self._failure = str(exc).splitlines()[0]
            else:
                self._failure = f"{type(exc).__name__}: {exc}"
            self.close()
            raise

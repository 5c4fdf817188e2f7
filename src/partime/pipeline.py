"""``Pipeline``: an ``nn.Sequential`` cut into stages that work at once on a stream.

The pipeline checks what it is given, learns the layout of every boundary from the first sample,
counts ticks and samples, and leaves the running of the stages to its executor.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import nn

from . import checkpoint
from .checkpoint import CheckpointError, layout_from_plain
from .compensation import check_compensation
from .errors import PipelineClosedError, StageError
from .executors import EXECUTORS, Executor, executor_class
from .executors.base import LOOKAHEAD, stage_error
from .layout import Layout, Result
from .lookahead import check_optimizer_factory
from .partition import Partition, check_balance, plan, split
from .signals import SigtermGuard
from .stage import (
    GRAD_MODES,
    NONFINITE,
    LossFn,
    OptimizerFactory,
    StageConfig,
    check_loss_fn,
    takes_target,
)
from .state import PipelineState
from .values import ValueSpec, copy_tensors, nonfinite, spec_of

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

_MISSING = object()
_P = ParamSpec("_P")
_R = TypeVar("_R")

TIMEOUT_S = 300.0
"""The default ``timeout``: five minutes, far longer than one tick of any model that keeps up with a
stream (and than a worker's start), short enough that an unattended run does not hang for good."""

SKIP_WINDOW = 100
"""Under ``nonfinite="skip"``, a warning is logged once more than ``SKIP_SHARE`` of the last
``SKIP_WINDOW`` results were skipped: the run has most likely diverged."""
SKIP_SHARE = 0.5


def _on_rank_0(
    otherwise: Callable[[], Any] = lambda: None,
) -> Callable[[Callable[Concatenate[Pipeline, _P], _R]], Callable[Concatenate[Pipeline, _P], _R]]:
    """A method of ``Pipeline`` that does nothing, and returns ``otherwise()``, on the ranks > 0 of
    the distributed executor: they serve their stage in ``open``; rank 0 reads the stream and
    holds the checkpoints."""

    def on_rank_0(method: Callable[Concatenate[Pipeline, _P], _R]) -> Callable[Concatenate[Pipeline, _P], _R]:
        @functools.wraps(method)
        def call(self: Pipeline, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            return otherwise() if self._rank > 0 else method(self, *args, **kwargs)

        return call

    return on_rank_0


class Pipeline:
    """``model`` cut into ``balance`` stages that run at once, each on its own sample.

    ``balance`` is a list of layers per stage, or a number of stages D: then each layer is timed on
    ``sample`` (or the first streamed sample) and the model is cut where the slowest stage is
    fastest. With ``loss_fn`` and ``optimizer`` (a factory ``params -> Optimizer``, called once per
    stage) the pipeline learns online as SPEC.md says, under ``grad_mode`` (``"stash"``, the
    default; ``"weight-stash"``; or ``"partime"``, the published method, which learns only from
    smooth streams) and with staleness ``compensation``: ``"auto"`` (the default) chooses, for
    each stage's optimizer, what measured best with it (``partime.compensation.AUTOMATIC``); or
    any of ``"step-scale"``, ``"delay-correction"``, ``"optimizer-prediction"``,
    ``"long-momentum"``, ``"spike"``, ``"lr-scale"``, ``"weight-prediction"`` (see
    ``partime.compensation`` and ``partime.lookahead``), or ``()`` for none. Every choice is
    plain online learning at D = 1. Without ``loss_fn`` and ``optimizer`` it infers under
    ``torch.no_grad()``. ``threads`` is each stage's torch thread count (default: the cores
    divided among the stages).

    ``nonfinite`` says what becomes of a sample whose input or loss holds NaN or an infinity:
    ``"raise"`` (the default) refuses a non-finite input with a ValueError before it is fed (the
    pipeline stays usable) and fails on a non-finite loss with a ``StageError``; ``"skip"`` drops
    the sample from learning and reports it in its result (``Result.skipped``). A skipped input
    never goes forward: it moves through the stages as a hole, on which nothing is computed, and
    its result has no output and no loss. A skipped loss keeps its result's output and loss, but
    no gradient is applied for it. In both cases no stage steps for that sample (SPEC: "a stage
    that received no gradient in a tick does not step"); every other sample is unaffected.

    The pipeline works on its own copy of ``model``: the model given is never changed, and a
    second pipeline made from it starts from the same weights. ``module`` gives the trained
    weights back (``model.load_state_dict(pipe.module.state_dict())`` to train it in place).

    ``timeout`` is the longest, in seconds, that the caller waits for any stage (a result, room
    for a sample, a checkpoint, the workers' start) before a ``StageTimeoutError`` names the stage
    that is behind and the pipeline closes; None waits for ever. The inline executor, which runs
    the stages in the caller's thread, has nothing to wait for.

    A pipeline belongs to the process that made it: used in a process made by ``os.fork()``, it
    raises (and that process's exit leaves the pipeline's workers alone).

    While a ``process`` pipeline is open in the main thread, SIGTERM closes it (see
    ``partime.signals``).

    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> with Pipeline(model, [2, 1], executor="inline") as pipe:
    ...     results = list(pipe.stream(torch.randn(4) for _ in range(5)))
    >>> [r.index for r in results]
    [0, 1, 2, 3, 4]

    Results come out in sample order; ``step`` returns the one that left the pipeline at that
    tick (None for the first D - 1 ticks) and ``flush`` those still inside. Every sample offered
    gets the next index, also one that is refused (a ``ValueError`` for a non-finite input under
    ``"raise"``, or a shape that does not fit): its index is used up and no result has it, so
    ``Result.index`` is always the sample's position in what the caller offered.
    """

    def __init__(
        self,
        model: nn.Sequential,
        balance: int | Sequence[int],
        *,
        devices: Sequence[str | torch.device] | None = None,
        executor: str = "process",
        loss_fn: LossFn | None = None,
        optimizer: OptimizerFactory | None = None,
        grad_mode: str = "stash",
        sample: Any = None,
        threads: int | None = None,
        compensation: str | Sequence[str] = "auto",
        nonfinite: str = "raise",
        timeout: float | None = TIMEOUT_S,
    ):
        self._pid = os.getpid()
        self._status = "new"  # new -> open -> closed
        self._executor: Executor | None = None
        check_balance(model, balance)
        if grad_mode not in GRAD_MODES:
            raise ValueError(f"unknown grad_mode {grad_mode!r}; choose one of {', '.join(GRAD_MODES)}")
        self._executor_class = executor_class(executor)
        if nonfinite not in NONFINITE:
            raise ValueError(f"unknown nonfinite policy {nonfinite!r}; choose one of {', '.join(NONFINITE)}")
        if (loss_fn is None) != (optimizer is None):
            given, missing = ("loss_fn", "optimizer") if optimizer is None else ("optimizer", "loss_fn")
            raise ValueError(
                f"{given} was given without {missing}: learning needs both "
                "(e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.01)), inference neither"
            )
        check_loss_fn(loss_fn)
        depth = balance if isinstance(balance, int) else len(balance)
        self.depth = depth
        self._devices = self._executor_class.check_devices(devices, depth)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a whole number of at least 1, got {threads!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise ValueError(f"timeout must be a number of seconds above 0, or None to wait for ever; got {timeout!r}")
        self._timeout = None if timeout is None else float(timeout)
        self._threads = threads if threads is not None else max(1, (os.cpu_count() or 1) // depth)
        if self._executor_class.on_this_host and depth > (os.cpu_count() or 1):
            log.warning(
                "%d stages on %d cores: stages will share cores, and the pipeline will not run %d times faster",
                depth,
                os.cpu_count(),
                depth,
            )
        self._model = copy.deepcopy(model)  # the pipeline's own: the caller's model is never changed
        self._balance = balance
        self._config = StageConfig(
            depth, loss_fn, optimizer, grad_mode, False, check_compensation(compensation), nonfinite=nonfinite
        )
        check_optimizer_factory(optimizer, self._config.compensation)
        self._sigterm = SigtermGuard() if self._executor_class.child_processes else None
        self._state = PipelineState(supervised=takes_target(loss_fn) if loss_fn is not None else False)
        self._partition: Partition | None = None
        if not isinstance(balance, int) or sample is not None:
            self._partition = self._plan(sample)
        self._failure: str | None = None
        self._skips: deque[bool] = deque(maxlen=SKIP_WINDOW)  # whether each recent result was skipped
        self._warned_skips = False
        # The distributed executor runs one stage per rank; on ranks > 0 the pipeline serves its stage.
        self._rank = self._executor_class.rank(depth)

    # -- public ---------------------------------------------------------------------------------

    @property
    def learning(self) -> bool:
        """Whether the pipeline learns (it was given a loss and an optimizer)."""
        return self._config.learning

    @property
    def partition(self) -> Partition | None:
        """Layers per stage and, when balanced by timing, each stage's predicted time.

        None while ``balance`` is a number of stages and no sample has been seen.
        """
        return self._partition

    @property
    def module(self) -> nn.Sequential:
        """A copy of the model with every stage's weights as they are now, between ticks.

        The pipeline trains a copy of the model it was given (which stays as it was): to train
        that one, ``model.load_state_dict(pipe.module.state_dict())``.
        """
        if self._executor is not None and self._status == "open":
            self._guard(self._executor.sync)
        return copy.deepcopy(self._model)

    @property
    def fed(self) -> int:
        """How many samples have been offered so far: the index the next one gets.

        A stream resumed from a checkpoint goes on from this sample.
        """
        return self._state.next_index

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

    @_on_rank_0()
    def step(self, x: Any, y: Any = None) -> Result | None:
        """Offer sample ``x`` (with target ``y`` for a supervised loss) and run one tick.

        Returns the result that left the pipeline during this tick, or None while it fills up.
        """
        self._feed(x, y)
        return self._take() if self._due() else None

    @_on_rank_0(list)
    def flush(self) -> list[Result]:
        """Run the remaining ticks without input; the results still inside, in order.

        When learning, every fed sample's gradient has been applied at every stage on return.
        """
        self._check_open()
        state = self._state
        if state.in_segment == 0:
            return []
        executor = self._running(None, None)  # not started yet if resumed with samples in flight
        self._guard(executor.end)
        rest = [self._take() for _ in range(state.in_segment - state.taken)]
        self._guard(executor.sync)
        state.flushed()
        return rest

    @_on_rank_0(lambda: iter(()))
    def stream(self, xs: Iterable[Any], ys: Iterable[Any] | None = None) -> Iterator[Result]:
        """Every sample of ``xs`` (with the targets ``ys``) through the pipeline, then a flush.

        When the loss takes a target and ``ys`` is not given, each item of ``xs`` is a pair
        ``(x, y)`` (as ``partime.streams.moving_digits`` yields). The same results as ``step`` on
        each sample and a ``flush``; while a result is handed out, the pipeline may have run one
        tick further (so that no stage waits for the caller). A ``break`` out of the loop leaves
        the samples in flight inside the pipeline: their results come out of the next ``step``,
        ``flush`` or ``stream``, first.
        """
        targets = iter(ys) if ys is not None else None
        pairs = ys is None and self._state.supervised is True
        for item in xs:
            if pairs:
                x, y = _pair(item, self._state.next_index)
            else:
                x = item
                y = None if targets is None else next(targets, _MISSING)
            if y is _MISSING:
                raise ValueError(f"ys ended before xs: there is no target for sample {self._state.next_index}")
            self._feed(x, y)
            while self._due() > LOOKAHEAD:
                yield self._take()
        if targets is not None and next(targets, _MISSING) is not _MISSING:
            raise ValueError(f"ys is longer than xs: xs ended after {self._state.next_index} samples")
        yield from self.flush()

    # -- checkpoints (see partime.checkpoint) -----------------------------------------------------

    @_on_rank_0()
    def state_dict(self) -> dict[str, Any] | None:
        """The whole state of the pipeline between two ticks, as tensors and plain values.

        It holds the weights, the optimizer states, the counters and everything in flight: the
        forwards the stages keep for a late gradient, the activations and gradients on their way
        to the next tick, the targets not used yet and the results that left the pipeline but were
        not handed out. Loaded (``load_state_dict``) into a pipeline made with the same settings,
        also in another process or with another executor, it goes on exactly as this one would.

        Take it after ``step()`` or ``flush()``, or inside a ``stream()`` loop: there the pipeline
        has fed one sample more than ``step()`` would have, and the result it has not handed out yet
        is in the checkpoint and comes out first after loading; resume that stream from sample
        ``fed``. Random layers (dropout) draw from their process's generator, which is not in it.
        """
        return self._checkpoint()

    @_on_rank_0()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (made by ``state_dict``) exactly as the pipeline it came from would.

        This pipeline must have the same depth, cut, grad mode, compensation, loss kind and sample
        layout (a ``CheckpointError`` names what differs, with both values) and a model of the same
        architecture, whose weights are replaced. It may be new or open; if its stages are running
        they stop, and stages start from ``state`` at the next sample or ``flush()``. A ``state``
        whose parts contradict each other (``check_contents``), or whose identity or cut does not
        fit this pipeline, raises a ``CheckpointError`` before anything of this pipeline changes.
        """
        self._check_checkpoints()
        expected = self._identity()
        if isinstance(self._balance, int):
            expected["balance"] = None  # cut where the checkpoint was cut
        checkpoint.check_state(state, expected)
        balance = state["identity"]["balance"]
        try:  # the model's own children, cut where the checkpoint was cut
            modules = split(self._model, balance)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint's cut does not fit this model: {exc}") from exc
        state = copy_tensors(dict(state))
        if self._executor is not None:
            self._executor.close()
            self._executor = None
            self._state.layout = None
        if self._partition is None or list(self._partition.balance) != balance:
            self._partition = Partition(tuple(balance))
        checkpoint.load_weights(modules, state)
        self._state = checkpoint.from_checkpoint(state)

    @_on_rank_0()
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``state_dict()`` to ``path``, atomically: a crash leaves the previous file whole."""
        checkpoint.save(self._checkpoint(), path)

    @_on_rank_0()
    def load(self, path: str | os.PathLike[str]) -> None:
        """``load_state_dict`` of the checkpoint in ``path``, read by ``checkpoint.load``: a
        ``CheckpointError`` names the file (a missing one raises ``FileNotFoundError``)."""
        state = checkpoint.load(path)
        try:
            self.load_state_dict(state)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc.__cause__

    # -- internals ------------------------------------------------------------------------------

    def _check_checkpoints(self) -> None:
        if not self._executor_class.checkpoints:
            raise NotImplementedError(
                f"the {self._executor_class.__name__} cannot take or load checkpoints; "
                "the inline, process and distributed executors can"
            )
        if self._failure is not None or self._status == "closed":
            self._check_open()

    def _identity(self) -> dict[str, Any]:
        return checkpoint.identity_of(
            self._state, self._config, None if self._partition is None else self._partition.balance
        )

    def _checkpoint(self) -> dict[str, Any]:
        """``state_dict()`` on rank 0."""
        self._check_checkpoints()
        if self._state.resume is not None:  # loaded and not started yet: that is the state
            resume: dict[str, Any] = copy_tensors(self._state.resume)
            return resume
        if self._executor is None:
            if self._partition is None:
                raise CheckpointError(
                    "no checkpoint before the cut is known: with balance=D the layers are timed on the "
                    "first sample; pass balance=[...] or sample=, or take it after the first step"
                )
            executor_state = checkpoint.unstarted(
                split(copy.deepcopy(self._model), self._partition.balance), self._config
            )
        else:
            self._guard(self._executor.sync)
            while len(self._state.held) < self._due():  # out of the pipeline, not handed out yet
                self._state.held.append(self._guard(self._executor.next_result))
            executor_state = self._guard(self._executor.state_dict)
        return checkpoint.to_checkpoint(self._state, self._identity(), executor_state)

    def _plan(self, sample: Any) -> Partition:
        """The partition, timing layers (if it must) with the thread count each stage will have."""
        before = torch.get_num_threads()
        torch.set_num_threads(self._threads)
        try:
            return plan(self._model, self._balance, sample, learning=self.learning)
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

    def _running(self, x: Any, y: Any) -> Executor:
        """The executor; started first, from sample ``x`` (and target ``y``) or the loaded
        checkpoint, if it is not running yet."""
        return self._guard(self._start, x, y) if self._executor is None else self._executor

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
        layout = _layout(stages, x, state.y_spec) if resume is None else layout_from_plain(resume["layout"])
        state.layout = layout
        self._executor = executor = self._executor_class(
            stages, self._devices, self._config, self._threads, self._timeout
        )
        if resume is None:
            self._guard(executor.start, layout)
        else:
            self._guard(executor.start, layout, resume)
        return executor

    def _feed(self, x: Any, y: Any) -> None:
        """Offer one sample: run one tick, without taking its result."""
        self._check_open()
        index = self._state.next_index
        try:
            self._state.check_sample(index, x, y, self.learning)
            bad = nonfinite(x)
            if bad is not None and self._config.nonfinite == "raise":
                raise ValueError(f"sample {index} is not finite: {bad}; pass nonfinite='skip' to drop such samples")
        except (TypeError, ValueError):
            self._state.next_index += 1  # a refused sample uses up its index (see the class docstring)
            raise
        executor = self._running(x, y)
        # a skipped sample goes in as a hole (None): the stages compute nothing on it
        self._guard(executor.feed, index, None if bad is not None else x, y)
        self._state.fed(index, y)

    def _due(self) -> int:
        """How many results have left the pipeline and not been handed out."""
        return self._state.due(self.depth)

    def _take(self) -> Result:
        state = self._state
        if state.held:
            result = state.held.popleft()
        else:
            assert self._executor is not None, "no result is held, so the executor has started"
            result = self._guard(self._executor.next_result)
        state.handed_out(result)
        if self._config.nonfinite == "skip":
            self._note_skip(result)
        return result

    def _note_skip(self, result: Result) -> None:
        """Warn once more than ``SKIP_SHARE`` of the last ``SKIP_WINDOW`` results were skipped."""
        self._skips.append(result.skipped)
        skipped = sum(self._skips)
        if len(self._skips) == SKIP_WINDOW and skipped > SKIP_SHARE * SKIP_WINDOW:
            if not self._warned_skips:
                log.warning(
                    "nonfinite='skip': %d of the last %d samples (up to sample %d) were skipped, so the "
                    "pipeline learns from few of them; the run has most likely diverged: lower the "
                    "learning rate, or look at the samples",
                    skipped,
                    SKIP_WINDOW,
                    result.index,
                )
                self._warned_skips = True
        elif skipped <= SKIP_SHARE * SKIP_WINDOW / 2:
            self._warned_skips = False  # recovered: warn again if it happens again

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


def _pair(item: Any, index: int) -> tuple[Any, Any]:
    """``item`` of a stream of ``(x, y)`` pairs, split; a ValueError naming the sample if it is no pair."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    kind = f"a {type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
    raise ValueError(
        f"loss_fn takes a target and ys was not given, so every item of xs must be a pair (x, y); "
        f"sample {index} is {kind}: pass ys=, or pairs"
    )


def _layout(stages: list[nn.Sequential], x: Any, target: ValueSpec | None) -> Layout:
    """Every boundary's layout, from one forward of a copy of the stages on the first sample."""
    specs = []
    value = x
    with torch.no_grad():
        for i, stage in enumerate(copy.deepcopy(stages)):
            try:
                value = stage(value)
            except Exception as exc:
                raise stage_error(i, 0, "forward", exc) from exc
            specs.append(spec_of(value, f"output of stage {i}"))
    return Layout(spec_of(x, "sample 0"), tuple(specs[:-1]), specs[-1], target)


__all__ = ["EXECUTORS", "Pipeline", "Result"]

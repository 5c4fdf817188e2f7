"""``Pipeline``: an ``nn.Sequential`` cut into stages that work at once on a stream.

The pipeline checks what it is given, learns the layout of every boundary from the first sample,
counts ticks and samples, and leaves the running of the stages to its executor.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .checkpoint import Checkpoints, layout_from_plain
from .compensation import check_compensation
from .errors import PipelineClosedError, StageError
from .executors import EXECUTORS, Executor, Layout, Result, executor_class
from .executors.base import LOOKAHEAD, stage_error
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
from .values import ValueSpec, check_like, copy_tensors, nonfinite, spec_of

log = logging.getLogger(__name__)

_MISSING = object()

TIMEOUT_S = 300.0
"""The default ``timeout``: five minutes, far longer than one tick of any model that keeps up with a
stream (and than a worker's start), short enough that an unattended run does not hang for good."""

SKIP_WINDOW = 100
"""Under ``nonfinite="skip"``, a warning is logged once more than ``SKIP_SHARE`` of the last
``SKIP_WINDOW`` results were skipped: the run has most likely diverged."""
SKIP_SHARE = 0.5


class Pipeline(Checkpoints):
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
        self._state = "new"  # new -> open -> closed
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
        self._devices = self._check_devices(devices, depth, executor)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a whole number of at least 1, got {threads!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"timeout must be a number of seconds above 0, or None to wait for ever; got {timeout!r}")
        self._timeout = None if timeout is None else float(timeout)
        self._threads = threads if threads is not None else max(1, (os.cpu_count() or 1) // depth)
        if executor == "process" and depth > (os.cpu_count() or 1):
            log.warning("%d stages on %d cores: stages will share cores, and the pipeline will not run "
                        "%d times faster", depth, os.cpu_count(), depth)
        self._model = copy.deepcopy(model)  # the pipeline's own: the caller's model is never changed
        self._balance = balance
        self._config = StageConfig(depth, loss_fn, optimizer, grad_mode, False, check_compensation(compensation),
                                   nonfinite=nonfinite)
        check_optimizer_factory(optimizer, self._config.compensation)
        self._sigterm = SigtermGuard() if executor == "process" else None
        self._supervised = takes_target(loss_fn) if loss_fn is not None else False
        self._partition: Partition | None = None
        if not isinstance(balance, int) or sample is not None:
            self._partition = self._plan(sample)
        self._failure: str | None = None
        self._x_spec: ValueSpec | None = None
        self._y_spec: ValueSpec | None = None
        self._next_index = 0
        self._in_segment = 0  # samples fed since the segment began
        self._taken = 0  # results handed out since the segment began
        self._held: deque[Result] = deque()  # results taken from the executor for a checkpoint, not handed out
        self._given: deque[tuple[int, Any]] = deque()  # (index, target) of samples fed and not handed out
        self._skips: deque[bool] = deque(maxlen=SKIP_WINDOW)  # whether each recent result was skipped
        self._warned_skips = False
        self._resume: dict[str, Any] | None = None  # a loaded checkpoint the executor starts from
        self._executor_layout: Layout | None = None
        # The distributed executor runs one stage per rank; on ranks > 0 the pipeline serves its stage.
        self._rank = getattr(self._executor_class, "rank", lambda depth: 0)(depth)

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
        if self._executor is not None and self._state == "open":
            self._guard(self._executor.sync)
        return copy.deepcopy(self._model)

    @property
    def fed(self) -> int:
        """How many samples have been offered so far: the index the next one gets.

        A stream resumed from a checkpoint goes on from this sample.
        """
        return self._next_index

    def open(self) -> Pipeline:
        """Make the pipeline ready for samples (its workers start at the first one)."""
        if self._state != "new":
            raise PipelineClosedError(f"this pipeline was already {self._state}ed; make a new one")
        self._state = "open"
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
        was_open, self._state = self._state == "open", "closed"
        if os.getpid() != self._pid:
            return
        if self._sigterm is not None:
            self._sigterm.restore()  # first: a SIGTERM while the workers are joined ends the program
        if self._executor is not None:
            self._executor.close()
        elif was_open and self._rank == 0 and hasattr(self._executor_class, "cancel"):
            self._executor_class.cancel(self._failure)  # ranks > 0 wait for the first sample

    def __del__(self) -> None:
        executor = getattr(self, "_executor", None)
        if self._state == "open" and executor is not None and executor.has_workers and os.getpid() == self._pid:
            warnings.warn(f"an open partime Pipeline ({self._executor_class.__name__}) was garbage-collected; its "
                          "workers are stopped now. Close it: `with pipe:`, or pipe.close()",
                          ResourceWarning, source=self, stacklevel=2)
            self.close()

    def __enter__(self) -> Pipeline:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def step(self, x: Any, y: Any = None) -> Result | None:
        """Offer sample ``x`` (with target ``y`` for a supervised loss) and run one tick.

        Returns the result that left the pipeline during this tick, or None while it fills up.
        """
        if self._rank > 0:  # rank 0 reads the stream; this rank served its stage in open()
            return None
        self._feed(x, y)
        return self._take() if self._due() else None

    def flush(self) -> list[Result]:
        """Run the remaining ticks without input; the results still inside, in order.

        When learning, every fed sample's gradient has been applied at every stage on return.
        """
        if self._rank > 0:
            return []
        self._check_open()
        if self._in_segment == 0:
            return []
        if self._executor is None:  # resumed from a checkpoint with samples in flight
            self._guard(self._start, None, None)
        self._guard(self._executor.end)
        rest = [self._take() for _ in range(self._in_segment - self._taken)]
        self._guard(self._executor.sync)
        self._in_segment = self._taken = 0
        return rest

    def stream(self, xs: Iterable[Any], ys: Iterable[Any] | None = None) -> Iterator[Result]:
        """Every sample of ``xs`` (with the targets ``ys``) through the pipeline, then a flush.

        When the loss takes a target and ``ys`` is not given, each item of ``xs`` is a pair
        ``(x, y)`` (as ``partime.streams.moving_digits`` yields). The same results as ``step`` on
        each sample and a ``flush``; while a result is handed out, the pipeline may have run one
        tick further (so that no stage waits for the caller). A ``break`` out of the loop leaves
        the samples in flight inside the pipeline: their results come out of the next ``step``,
        ``flush`` or ``stream``, first.
        """
        if self._rank > 0:
            return
        targets = iter(ys) if ys is not None else None
        pairs = ys is None and self._supervised is True
        for item in xs:
            if pairs:
                x, y = _pair(item, self._next_index)
            else:
                x = item
                y = None if targets is None else next(targets, _MISSING)
            if y is _MISSING:
                raise ValueError(f"ys ended before xs: there is no target for sample {self._next_index}")
            self._feed(x, y)
            while self._due() > LOOKAHEAD:
                yield self._take()
        if targets is not None and next(targets, _MISSING) is not _MISSING:
            raise ValueError(f"ys is longer than xs: xs ended after {self._next_index} samples")
        yield from self.flush()

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _check_devices(devices: Sequence[Any] | None, depth: int, executor: str) -> list[str]:
        if devices is None:
            return ["cpu"] * depth
        devices = [str(torch.device(d)) for d in devices]
        if len(devices) != depth:
            raise ValueError(f"devices and stages differ in number (stages: {depth}, devices: {len(devices)})")
        if executor == "distributed":
            raise ValueError(f"the distributed executor puts stage r on rank r's device (cuda:LOCAL_RANK, or the CPU "
                             f"without GPUs); leave devices=None, got {devices}")
        if executor == "process" and any(d != "cpu" for d in devices):
            raise ValueError(f"the process executor runs stages on the CPU only, got devices {devices}")
        return devices

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
        if self._state == "new":
            raise PipelineClosedError("the pipeline is not open: use `with pipe:` (or pipe.open())")
        if self._failure is not None:
            raise PipelineClosedError(f"the pipeline stopped after an error: {self._failure}")
        if self._state == "closed":
            raise PipelineClosedError("the pipeline is closed; make a new one")

    def _check_sample(self, index: int, x: Any, y: Any) -> None:
        spec = spec_of(x, f"sample {index}")
        if self._x_spec is None:
            self._x_spec = spec
        else:
            check_like(x, self._x_spec, f"sample {index}")
        supervised = self._supervised
        if supervised is None:  # the loss's signature does not say: the first target decides
            supervised = self._supervised = y is not None
            self._config.supervised = supervised
        if supervised and y is None:
            raise ValueError(f"loss_fn takes a target, but sample {index} came without one (pass y= or ys=)")
        if not supervised and y is not None:
            what = "this pipeline has no loss" if not self.learning else "loss_fn takes no target"
            raise ValueError(f"sample {index} came with a target, but {what}")
        if y is not None:
            if self._y_spec is None:
                self._y_spec = spec_of(y, f"target of sample {index}")
            else:
                check_like(y, self._y_spec, f"target of sample {index}")

    def _start(self, x: Any, y: Any) -> None:
        """Fix the partition and every boundary's layout from the first sample (or the loaded
        checkpoint); start the executor."""
        self._config.supervised = bool(self._supervised)
        if self._partition is None:
            self._partition = self._plan(x)
            log.info("balanced: %s", self._partition)
        stages = split(self._model, self._partition.balance)
        resume, self._resume = self._resume, None
        layout = _layout(stages, x, self._y_spec) if resume is None else layout_from_plain(resume["layout"])
        self._executor_layout = layout
        self._executor = self._executor_class(stages, self._devices, self._config, self._threads, self._timeout)
        self._guard(self._executor.start, layout, *([] if resume is None else [resume]))

    def _feed(self, x: Any, y: Any) -> None:
        """Offer one sample: run one tick, without taking its result."""
        self._check_open()
        index = self._next_index
        try:
            self._check_sample(index, x, y)
            bad = nonfinite(x)
            if bad is not None and self._config.nonfinite == "raise":
                raise ValueError(f"sample {index} is not finite: {bad}; pass nonfinite='skip' to drop such samples")
        except (TypeError, ValueError):
            self._next_index += 1  # a refused sample uses up its index (see the class docstring)
            raise
        if self._executor is None:
            self._guard(self._start, x, y)
        # a skipped sample goes in as a hole (None): the stages compute nothing on it
        self._guard(self._executor.feed, index, None if bad is not None else x, y)
        if y is not None:
            self._given.append((index, copy_tensors(y)))
        self._next_index += 1
        self._in_segment += 1

    def _due(self) -> int:
        """How many results have left the pipeline and not been handed out."""
        return max(0, self._in_segment - (self.depth - 1)) - self._taken

    def _take(self) -> Result:
        result = self._held.popleft() if self._held else self._guard(self._executor.next_result)
        self._taken += 1
        while self._given and self._given[0][0] < result.index:  # not in flight any more (a checkpoint dropped it)
            self._given.popleft()
        if self._given and self._given[0][0] == result.index:
            result.target = self._given.popleft()[1]
        if self._config.nonfinite == "skip":
            self._note_skip(result)
        return result

    def _note_skip(self, result: Result) -> None:
        """Warn once more than ``SKIP_SHARE`` of the last ``SKIP_WINDOW`` results were skipped."""
        self._skips.append(result.skipped)
        skipped = sum(self._skips)
        if len(self._skips) == SKIP_WINDOW and skipped > SKIP_SHARE * SKIP_WINDOW:
            if not self._warned_skips:
                log.warning("nonfinite='skip': %d of the last %d samples (up to sample %d) were skipped, so the "
                            "pipeline learns from few of them; the run has most likely diverged: lower the "
                            "learning rate, or look at the samples", skipped, SKIP_WINDOW, result.index)
                self._warned_skips = True
        elif skipped <= SKIP_SHARE * SKIP_WINDOW / 2:
            self._warned_skips = False  # recovered: warn again if it happens again

    def _guard(self, fn, *args):
        """Call into the executor; on a stage's failure close everything, then re-raise."""
        try:
            return fn(*args)
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
    raise ValueError(f"loss_fn takes a target and ys was not given, so every item of xs must be a pair (x, y); "
                     f"sample {index} is {kind}: pass ys=, or pairs")


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

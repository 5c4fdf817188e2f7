"""``Pipeline``: a model cut into stages that work at once on a stream.

The model is an ``nn.Sequential``, cut between its children, or any module whose forward torch.fx
can trace, cut between the nodes of its graph (``partime.traced.tracing``). The pipeline checks what it is
given, learns the layout of every boundary from the first sample, counts ticks and samples, and
leaves the running of the stages to its executor.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..checkpoint import files as checkpoint
from ..checkpoint.files import CheckpointError, layout_from_plain
from ..core.boundary_layout import Layout
from ..core.boundary_values import ValueSpec, copy_tensors, nonfinite, spec_of
from ..core.random_turns import TURNS
from ..core.stage import DEFAULT_GRAD_MODE, LossFn, OptimizerFactory, StageConfig, takes_target
from ..core.stage.config import GradMode, NonfinitePolicy, SchedulerFactory, first_trained, model_names
from ..core.stage.learning import check_scheduler_factory
from ..errors import PipelineClosedError, StageError
from ..executors import EXECUTORS, Executor, ExecutorName
from ..executors.base import READ_AHEAD
from ..executors.distributed.on_rank_0 import on_rank_0
from ..learning.compensation import Compensations, check_compensation
from ..learning.optimizer_state import LOSS_PREFIX, check_optimizer_factory, trainable
from ..planning.balance import Balance
from ..planning.partition import Partition, split
from ..planning.planner import plan
from ..result import Result
from ..sources import MONOTONIC, Clock
from ..stats import StageStats
from ..traced.partition import describe
from ..traced.structured_loss import ModelCall, StructuredLoss
from ..traced.tracing import boundary_specs, check_copied_hooks, layers_of, traced_forward
from . import arrivals
from .argument_checks import Devices, check_arguments, check_plain_model
from .caller_autocast import check_caller_autocast
from .one_caller import OneCaller
from .sample_reading import layout_of, pair
from .sigterm import SigtermGuard

# public here: partime.pipeline.SKIP_WINDOW and SKIP_SHARE (the skip-share warning: skip_warning)
from .skip_warning import SKIP_SHARE as SKIP_SHARE  # noqa: PLC0414
from .skip_warning import SKIP_WINDOW as SKIP_WINDOW  # noqa: PLC0414
from .skip_warning import SkipWatch
from .state import PipelineState

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

_MISSING = object()
_P = ParamSpec("_P")
_R = TypeVar("_R")

TIMEOUT_S = 300.0
"""The default ``timeout``: five minutes, far longer than one tick of any model that keeps up with a
stream (and than a worker's start), short enough that an unattended run does not hang for good."""


class Pipeline:
    """``model`` cut into ``balance`` stages that run at once, each on its own sample.

    Open it with ``with``; then ``step(x)`` offers one sample and returns the result that left the
    pipeline at that tick, ``stream(xs)`` yields every sample's result in order, and ``flush()``
    returns those still inside. With ``loss_fn`` and ``optimizer`` it learns online (``predict(x)``
    offers a sample that is only predicted, not learnt from); without them it infers under
    ``torch.no_grad()``. Each argument is told in full below the list.

    :param model: the network: an ``nn.Sequential``, cut between its children, or any module whose
        forward torch.fx (or torch.export, on ``sample``) can trace. The pipeline works on a copy.
        See docs/guides/traced-models.md.
    :param balance: where to cut: a list of layers per stage, a number of stages D (the layers are
        timed, then cut evenly in time), or ``"auto"`` (the depth too; needs ``sample``). See
        docs/guides/tick.md.
    :param devices: None (the default: every stage on the CPU), one device for every stage, or a
        list of one per stage. See docs/guides/tick.md.
    :param executor: how the stages run: ``"process"`` (the default: a process each),
        ``"thread"``, ``"inline"`` (in the caller's thread, the SPEC as plain code) or
        ``"distributed"`` (one rank each); any of ``EXECUTORS``. See docs/guides/executors.md.
    :param loss_fn: the loss, ``(output, target) -> scalar tensor`` or ``(output) -> scalar
        tensor``, such as ``nn.MSELoss()``; None (the default) for inference. See
        docs/guides/learning.md.
    :param optimizer: a factory ``params -> torch.optim.Optimizer``, called once per stage with
        the stage's trainable parameters as ``(name, parameter)`` pairs under the model's own
        names (frozen ones left out); None (the default) for inference. See docs/guides/learning.md.
    :param lr_scheduler: a factory ``optimizer -> LRScheduler``, stepped after each step of each
        stage's optimizer; None (the default) for none. See docs/guides/learning.md.
    :param max_grad_norm: the norm each stage clips its gradient to before it steps, a finite
        number above 0; None (the default) clips nothing. See docs/guides/learning.md.
    :param grad_mode: how late gradients are computed: ``"graph-stash"`` (the default),
        ``"stash"``, ``"weight-stash"`` or ``"partime"``; any of ``GRAD_MODES``. See
        docs/guides/learning.md.
    :param sample: a sample like the stream's, optional: it lets ``balance`` be timed when the
        pipeline is made, a traced model be checked, and ``with`` start the stages before the first
        sample. See docs/guides/tick.md.
    :param threads: each stage's torch thread count; None (the default) divides the cores among
        the stages. See docs/guides/tick.md.
    :param compensation: what each stage does about learning from late gradients: ``"auto"`` (the
        default: chosen by the kind of optimizer), one option, a sequence of options, or ``()`` for
        none. See docs/guides/compensation.md.
    :param nonfinite: what becomes of a sample whose input or loss holds NaN or an infinity:
        ``"raise"`` (the default) or ``"skip"``. See docs/guides/learning.md.
    :param timeout: the longest, in seconds, the caller waits for any stage; None waits for ever.
        The default is ``TIMEOUT_S``, five minutes. See docs/guides/troubleshooting.md.
    :param autocast: None (the default: full precision) or a floating dtype, ``torch.bfloat16`` or
        ``torch.float16``, that every stage's forward and the loss run under ``torch.autocast``
        of, on every executor. See docs/guides/mixed-precision.md.
    :param compile: False (the default), True, or a dict of ``torch.compile``'s keyword arguments
        (``mode``, ``backend``, ``dynamic``, ``fullgraph``, ``options``): each stage's forward runs
        through ``torch.compile`` of its module, compiled in its worker. See docs/guides/compile.md.
    :param stats: whether each stage keeps statistics for ``stats()`` (its lrs, gradient norm, tick
        and wait times); False (the default) keeps none. See docs/guides/monitoring.md.
    :raises ValueError: an argument out of its range or set (naming the value and the choices), a
        device this machine does not have, or ``lr_scheduler``/``max_grad_norm`` without
        ``optimizer``.
    :raises TypeError: a model that cannot be cut or traced, a loss class where an instance is
        meant, or a factory that is not callable.

    ``model`` is an ``nn.Sequential``, whose layers are its children, or any other module whose
    forward torch.fx can trace, whose layers are the computing nodes of its graph, in order (see
    ``partime.traced.tracing``: what crosses a cut is every value computed before it and used after it;
    what cannot be traced is refused with a TypeError naming the node or line, and the fix). A
    forward fx cannot trace alone (Python on shapes or dtypes, ``**kwargs``: transformers models)
    is traced by torch.export on ``sample`` (``partime.traced.exporting``): every sample then has
    its shapes, may be a dict of named inputs (``input_ids``, ``attention_mask``), and each result's
    output, and what ``loss_fn`` is given, is what the forward returns (a ``ModelOutput``).

    ``balance`` is a list of layers per stage, taken as given; a number of stages D, cut where the
    layers' timings on ``sample`` (or the first sample) and the cost of each boundary say, by rules
    that timing noise does not change (``partime.planning.steady_cut``), with the fewest weights
    delayed when learning; or ``"auto"``, which chooses D too when the pipeline is made (it needs
    ``sample``) and keeps one stage unless a pipeline is predicted, then measured, 10% faster
    (``partime.planning.auto_check``). ``partition`` says what it chose and predicts. The rules in
    full: docs/guides/tick.md, "Where the model is cut".

    With ``loss_fn`` and ``optimizer`` (a factory ``params -> Optimizer``, called once per
    stage) the pipeline learns online as SPEC.md says, under ``grad_mode`` (``"graph-stash"``,
    the default, which runs each sample forward once; ``"stash"``, which runs a late gradient's
    sample forward again with the weights now; ``"weight-stash"``; or ``"partime"``, the published
    method, which learns only from smooth streams) and with staleness ``compensation``: ``"auto"`` (the default) chooses, for
    each stage's optimizer, what measured best with it (``partime.learning.compensation.AUTOMATIC``); or
    any of ``"step-scale"``, ``"delay-correction"``, ``"optimizer-prediction"``,
    ``"long-momentum"``, ``"spike"``, ``"lr-scale"``, ``"weight-prediction"`` (see
    ``partime.learning.compensation`` and ``partime.learning.optimizer_state``), or ``()`` for none. Every choice is
    plain online learning at D = 1. Without ``loss_fn`` and ``optimizer`` it infers under
    ``torch.no_grad()``.

    ``lr_scheduler`` (learning only) is a factory ``optimizer -> torch.optim.lr_scheduler.LRScheduler``,
    called once per stage right after its optimizer is made; each stage steps its scheduler right
    after each step of its optimizer, as a plain loop calls ``scheduler.step()`` after each
    ``optimizer.step()`` (at D = 1 the pipeline is that loop). Its state is in every checkpoint.
    ``ReduceLROnPlateau`` is refused with a ValueError when the pipeline is made: its step needs the
    loss, which only the last stage sees (stage i steps for a sample 2(D − 1 − i) ticks after its
    loss is known); schedule on the step count instead. ``max_grad_norm`` (learning only, a finite
    number above 0) clips the gradient each stage steps with to that norm, with
    ``torch.nn.utils.clip_grad_norm_`` over the stage's own parameters (the loss's too, at the last
    stage), after delay correction and before any step scale: at D = 1 that is
    ``clip_grad_norm_(model.parameters(), max_grad_norm)`` in a plain loop. A norm over every stage
    together is not available: the gradients of one sample reach the stages at different ticks
    (stage i 2(D − 1 − i) ticks after the last), so no moment holds them all, and waiting for
    them would stall the pipeline. ``threads`` is each stage's torch thread count (default: the cores
    divided among the stages).

    ``autocast`` (None, the default: full precision; or a floating dtype such as ``torch.bfloat16``
    or ``torch.float16``) runs every stage's forward, and the loss at the last stage, under
    ``torch.autocast(device_type=<the stage's device type>, dtype=autocast)``, on every executor;
    the backward and the step run outside it, as in a plain loop with ``with torch.autocast(...):
    loss = loss_fn(model(x), y)``, which the pipeline equals at D = 1. What crosses a boundary then
    has the dtype the stage emits (bf16 out of a Linear under bf16). A dtype torch cannot autocast to
    on a stage's device raises a ValueError. Do not open an autocast around ``step`` or ``stream``
    yourself: it would reach some stages and not others, so it raises a RuntimeError, before
    anything is fed.

    ``compile`` (False, the default; True; or a dict of ``torch.compile``'s keyword arguments, such
    as ``{"mode": "max-autotune"}`` or ``{"backend": "aot_eager"}``) runs each stage's forward
    through ``torch.compile(stage_module, **compile)``, made in the stage's worker and compiled there,
    at the stage's thread count, on its first call: in a stage process's warm-up, before the first
    tick, elsewhere at the first tick. Every sample has the first one's shapes, so ``dynamic=False``
    unless the dict says otherwise: each stage compiles once, and no tick compiles again. The loss,
    the backward and the step are the same code as without it; every grad mode, compensation,
    ``autocast`` and inference work compiled, and compute what the uncompiled pipeline computes
    within float rounding. A mode that replays CUDA graphs on a CUDA stage (``"reduce-overhead"``)
    raises a ValueError. The layers are timed for ``balance`` uncompiled. A model compiled
    already (``torch.compile(model)``, ``model.compile()``) raises a TypeError that names
    ``compile=``: the pipeline runs the stages' forwards, never the model's.

    ``nonfinite`` says what becomes of a sample whose input or loss holds NaN or an infinity:
    ``"raise"`` (the default) refuses a non-finite input with a ValueError before it is fed (the
    pipeline stays usable) and fails on a non-finite loss with a ``StageError``; ``"skip"`` drops
    the sample from learning and reports it in its result (``Result.skipped``). A skipped input
    never goes forward: it moves through the stages as a hole, on which nothing is computed, and
    its result has no output and no loss. A skipped loss keeps its result's output and loss, but
    no gradient is applied for it. In both cases no stage steps for that sample (SPEC: "a stage
    that received no gradient in a tick does not step"); every other sample is unaffected.

    Every module of ``model`` runs in the mode it is in when the pipeline is made (``train()`` or
    ``eval()``, module by module), in every stage, under every executor and after a checkpoint is
    loaded; a traced graph keeps what the forward chose on ``self.training`` as it was traced. To
    switch, make a new pipeline from ``pipe.module`` after ``.eval()`` or ``.train()``.

    The pipeline works on its own copy of ``model``: the model given is never changed, and a
    second pipeline made from it starts from the same weights. ``module`` gives the trained
    weights back (``model.load_state_dict(pipe.module.state_dict())`` to train it in place).

    Besides one forward of each sample, partime runs the model for itself, on copies and from a
    copy of the random state (to learn what crosses each boundary, warm the stages, time the
    layers): none of it draws from the caller's random stream or changes the pipeline's weights,
    but a forward with a side effect outside the model (a counter, a print) sees those calls (and
    a traced model runs its graph per sample, not its forward); docs/guides/tick.md, "What partime
    runs for itself", lists them.

    With ``sample=`` (and a loss that takes no target), ``with`` starts the stages, warm, before the
    first sample (``start``): a live source loses nothing to the pipeline's start, and what is
    computed is what a pipeline started at its first sample computes, to the bit.

    ``timeout`` is the longest, in seconds, that the caller waits for any stage (a result, room
    for a sample, a checkpoint, the workers' start) before a ``StageTimeoutError`` names the stage
    that is behind and the pipeline closes; None waits for ever. The inline executor, which runs
    the stages in the caller's thread, has nothing to wait for.

    A pipeline belongs to the process that made it: used in a process made by ``os.fork()``, it
    raises (and that process's exit leaves the pipeline's workers alone).

    While a ``process`` pipeline is open in the main thread, SIGTERM closes it (see
    ``partime.pipeline.sigterm``).

    >>> import torch
    >>> from torch import nn
    >>> from partime import Pipeline
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> samples = [torch.randn(4) for _ in range(5)]
    >>> with Pipeline(model, [2, 1], executor="inline") as pipe:
    ...     results = list(pipe.stream(samples))
    >>> [r.index for r in results]
    [0, 1, 2, 3, 4]
    >>> torch.allclose(results[4].output, model(samples[4]))
    True

    Results come out in sample order; ``step`` returns the one that left the pipeline at that
    tick (None for the first D - 1 ticks) and ``flush`` those still inside. Every sample offered
    gets the next index, also one that is refused (a ``ValueError`` for a non-finite input under
    ``"raise"``, or a shape that does not fit): its index is used up and no result has it, so
    ``Result.index`` is always the sample's position in what the caller offered.

    A pipeline has one caller at a time. A ``stream`` holds it from its first item until it ends,
    is closed, or is let go (a ``break`` out of ``for r in pipe.stream(...)`` lets it go); a
    ``step`` or ``flush`` while it does, a second ``stream``, or a call from another thread while
    one runs raises a RuntimeError and feeds nothing. A learning pipeline fed under
    ``torch.no_grad()`` or ``torch.inference_mode()`` raises a RuntimeError that says so, before
    anything is fed: its outputs are detached already, so only the code that scores them needs it.
    """

    def __init__(
        self,
        model: nn.Module,
        balance: Balance,
        *,
        devices: Devices = None,
        executor: ExecutorName = "process",
        loss_fn: LossFn | None = None,
        optimizer: OptimizerFactory | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        max_grad_norm: float | None = None,
        grad_mode: GradMode = DEFAULT_GRAD_MODE,
        sample: Any = None,
        threads: int | None = None,
        compensation: Compensations = "auto",
        nonfinite: NonfinitePolicy = "raise",
        timeout: float | None = TIMEOUT_S,
        autocast: torch.dtype | None = None,
        compile: bool | Mapping[str, Any] = False,  # torch.compile's name, as users know it
        stats: bool = False,
    ):
        # What partime runs for itself here (traces, probes, timing) draws nothing from the caller's
        # random stream; the stages start from it (SPEC.md, "Random and stateful layers").
        random_state = torch.get_rng_state()
        with torch.random.fork_rng(devices=[]):
            self._pid = os.getpid()
            self._status: str = "new"  # new -> open -> closed
            self._executor: Executor | None = None
            check_plain_model(model)  # a compiled module's forward would never run: compile= compiles each stage's
            # the pipeline's own copy: the caller's model is never changed
            self._root = copy.deepcopy(model) if isinstance(model, nn.Module) else model
            if isinstance(model, nn.Module):
                check_copied_hooks(model, self._root)  # hooks a copy drops would never run
            # the copy itself, or its traced graph's segments (traced on the sample where fx cannot trace it alone)
            layers = layers_of(self._root, sample)
            self._traced_forward = traced_forward(layers)
            sample = self._traced_forward.flat_sample(sample)  # a dict of named inputs as the graph's tuple
            # the loss is given what the model returns (a ModelOutput), made of the graph's tensors
            stage_loss = loss_fn
            if loss_fn is not None and self._traced_forward.out_tree is not None:
                stage_loss = StructuredLoss(loss_fn, self._traced_forward)
            # a traced model's boundaries, shown by the sample: a value that cannot cross a cut fails here
            self._specs: tuple[ValueSpec, ...] | None = None
            if layers is not self._root and sample is not None:
                self._specs = boundary_specs(layers, sample, self._root)
            args = check_arguments(
                layers,
                balance,
                devices=devices,
                executor=executor,
                loss_fn=loss_fn,
                optimizer=optimizer,
                grad_mode=grad_mode,
                lr_scheduler=lr_scheduler,
                max_grad_norm=max_grad_norm,
                threads=threads,
                nonfinite=nonfinite,
                timeout=timeout,
                sample=sample,
                compensation=compensation,
                autocast=autocast,
                compile=compile,
                # "auto" weighs a pipeline against the model as its user runs it: the module itself
                plain=self._root if layers is self._root else ModelCall(self._root, self._traced_forward),
                running=functools.partial(
                    _running,
                    layers,
                    sample,
                    dict(
                        executor=executor,
                        devices=devices,
                        optimizer=optimizer,
                        grad_mode=grad_mode,
                        threads=threads,
                        timeout=timeout,
                        compensation=compensation,
                    ),
                ),
            )
            self._executor_class = args.executor_class
            depth = self.depth = args.depth
            self._devices = args.devices
            self._timeout = args.timeout
            self._threads = args.threads
            self._model = layers
            # "auto" chose its depth: from here on as balance=D (a checkpoint may have another cut of D)
            self._balance: int | Sequence[int] = args.depth if isinstance(balance, str) else balance
            self._config = StageConfig(
                depth,
                stage_loss,
                optimizer,
                grad_mode,
                False,
                check_compensation(compensation),
                nonfinite=nonfinite,
                random_state=random_state,
                lr_scheduler=lr_scheduler,
                max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
                autocast=autocast,
                compile=args.compile,
                stats=_flag("stats", stats),
            )
            learnt = trainable(self._root) + trainable(loss_fn, LOSS_PREFIX)  # by the model's own names
            check_optimizer_factory(optimizer, self._config.compensation, learnt)
            check_scheduler_factory(lr_scheduler, optimizer, learnt)
            self._sigterm: SigtermGuard | None = SigtermGuard() if self._executor_class.child_processes else None
            self._state = PipelineState(supervised=takes_target(loss_fn) if loss_fn is not None else False)
            self._partition: Partition | None = args.partition
            if self._partition is None and (not isinstance(balance, int) or sample is not None):
                self._partition = self._plan(sample)
            # what ``start`` (and ``with``) starts the stages from: the pipeline's own copy of sample= and its target
            self._first: tuple[Any, Any] | None = None if sample is None else (copy_tensors(sample), None)
            self._failure: str | None = None
            self._skips = SkipWatch()
            self._clock: Clock = MONOTONIC  # what results are timed on: the clock of the source streamed last
            self._caller = OneCaller()
            # The distributed executor runs one stage per rank; on ranks > 0 the pipeline serves its stage.
            self._rank = self._executor_class.rank(depth)

    # -- public ---------------------------------------------------------------------------------

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

    @on_rank_0()
    def start(self, sample: Any = None, y: Any = None) -> None:
        """Start the stages now, warm, so that the first sample finds them ready: a live source then
        loses nothing to the pipeline's start.

        What the first sample would start is done here: the workers are spawned and their stages
        built, the links between them made, and every boundary's layout learnt from ``sample``
        (default: the constructor's ``sample=``; for a loss that takes a target, with a target
        ``y`` like the samples'). The layout is learnt as at the first sample (one forward of a
        copy of every stage on it, without gradients, from a copy of the random state), and each
        stage in a process of its own (the process executor's) runs its forward once on a copy, on
        what it took in there, before it reports ready, so that its first tick is no slower than
        the others. None of it changes the weights, buffers or random streams of the stages, nor
        the caller's random state: every result, loss and weight is, to the bit, what the pipeline
        started at its first sample gives, and the first sample runs no layout forward of its own.
        A pipeline loaded from a checkpoint taken after its first sample starts from it (its
        layout), without a sample and without those forwards.

        ``with`` starts a pipeline made with ``sample=`` (unless its loss takes a target) or loaded
        from a checkpoint taken after its first sample; one opened otherwise (``open()``) starts
        here or at its first sample. A first sample of another layout than the one the stages
        started from is taken as it would have been: the stages start again from it. A ``load``
        into a started pipeline starts it again at once, from the checkpoint. A checkpoint of a
        pipeline started but fed nothing is that of one not started.

        Calling it again does nothing; on a pipeline not open, closed or stopped by an error it
        raises a ``PipelineClosedError``; without a sample to start from, a ValueError.
        """
        self._caller.claim("start()")
        try:
            self._check_open()
            if self._executor is not None:
                return
            first = self._first
            if sample is not None:
                x = self._traced_forward.flat_sample(sample)
                self._traced_forward.check_traced_on(x)
                first = (copy_tensors(x), copy_tensors(y))
            if self._state.resume is None:
                why = self._not_startable(first)
                if why is not None:
                    raise ValueError(f"start() {why}")
            self._first = first
            self._start_ahead()
        finally:
            self._caller.release()

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
        """``open()``, then ``start()`` if the pipeline knows what to start from without a sample
        of the stream: ``sample=`` (unless its loss takes a target), or a loaded checkpoint."""
        self.open()
        if self._rank == 0 and self._startable():
            self._start_ahead()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def learning(self) -> bool:
        """Whether the pipeline learns (it was given a loss and an optimizer)."""
        return self._config.learning

    @property
    def partition(self) -> Partition | None:
        """Layers per stage and, when balanced by timing, the predictions: each stage's time per
        sample (``predicted_times``: compute plus hop), the pipeline's (``predicted_time``, its
        slowest stage), the ``bound`` (the slowest compute, hops free) and the ``sequential_time``;
        ``print(pipe.partition.summary())`` shows them. For a traced model it is a
        ``partime.traced.partition.TracedPartition``: also the nodes of each stage
        (``stage_nodes``) and what crosses each boundary (``boundaries``: the values' names and,
        once ``sample=`` or the first sample has shown them, their shapes and bytes).

        None while ``balance`` is a number of stages and no sample has been seen.
        """
        if self._partition is None:
            return None
        specs: Sequence[ValueSpec | None] | None = self._specs
        layout = self._state.layout
        if specs is None and layout is not None:  # what the first sample showed at each boundary
            found = dict(zip((stop for _, stop in self._partition.bounds[:-1]), layout.activations))
            specs = [found.get(k) for k in range(1, len(self._model))]
        return describe(self._partition, self._model, specs)

    @property
    def module(self) -> nn.Module:
        """A copy of the model, of the type given, with every stage's weights as they are now,
        between ticks (for a traced model, a copy of the pipeline's own copy of the module given,
        whose submodules the stages train).

        The pipeline trains a copy of the model it was given (which stays as it was): to train
        that one, ``model.load_state_dict(pipe.module.state_dict())``.
        """
        if self._executor is not None and self._status == "open":
            self._guard(self._executor.sync)
        return copy.deepcopy(self._root)

    def stats(self) -> list[StageStats]:
        """Each stage's statistics now (``StageStats``): its lrs, its last step's gradient norm, how long
        its last tick took and how long it waited for its inputs, and counts and totals; for a pipeline
        made with ``stats=True`` (else a RuntimeError that says so).

        Each stage's runner (worker process, thread, or the caller for the stages it runs) writes them
        into a small record after every tick, which this reads where it lies (in shared memory for the
        process executor): no message, no lock, no wait for any stage, so it costs microseconds
        whatever the stages are doing, and changes nothing they compute. The values are those of
        each stage's last finished tick: the stages may be at different ticks (up to the few a
        stream runs ahead), and a stage's own fields are of one tick (``partime.core.stats_record``).

        What it costs the stages: two clock reads per tick and a few numbers written; and, for a
        learning pipeline that does not clip (``max_grad_norm``), the gradient's norm at every step
        (one pass over the gradients, as ``clip_grad_norm_`` makes it).

        The list has one entry per stage, in order, once the stages have started (empty before the
        first sample, or ``start``, and after a checkpoint is loaded, until they start again); after
        ``close`` it keeps the last values. With the ``distributed`` executor it holds stage 0 only:
        every other stage runs in another rank's process, which no memory of rank 0's reaches (its
        weights and checkpoints travel on request, through ``module`` and ``state_dict``); on ranks
        other than 0 it is empty.
        """
        if not self._config.stats:
            raise RuntimeError("this pipeline keeps no statistics: make it with Pipeline(..., stats=True)")
        if self._rank > 0 or self._executor is None:
            return []
        return self._executor.stats()

    @property
    def fed(self) -> int:
        """How many samples have been offered so far: the index the next one gets.

        A stream resumed from a checkpoint goes on from this sample.
        """
        return self._state.next_index

    @on_rank_0()
    def step(self, x: Any, y: Any = None, *, learn: bool = True) -> Result | None:
        """Offer sample ``x`` (with target ``y`` for a supervised loss) and run one tick.

        Returns the result that left the pipeline during this tick, or None while it fills up.
        ``learn=False`` offers ``x`` to be predicted, not learnt from: see ``predict``.
        """
        return self._step("step()", x, y, learn)

    @on_rank_0()
    def predict(self, x: Any, y: Any = None) -> Result | None:
        """Offer sample ``x`` to be predicted and not learnt from (``step(x, y, learn=False)``), and
        run one tick: river's ``predict_one`` inside a stream that learns.

        As ``step``, it returns the result that left the pipeline during this tick (an earlier
        sample's, or None while the pipeline fills up); ``x``'s own comes out D - 1 ticks later, in
        sample order, with ``predicted=True``, its output and no loss. ``x`` takes its tick like any
        sample: each stage runs it forward under ``torch.no_grad()`` with its weights as they are at
        that tick (those the learnt samples beside it see; under weight prediction, the weights
        themselves), in its modules' modes (dropout draws from the stage's stream, BatchNorm in
        training mode updates its running statistics, as ``with torch.no_grad(): model(x)`` does),
        and keeps nothing for a gradient; no stage steps for it. At D = 1 that is a plain loop's
        ``with torch.no_grad(): out = model(x)`` between two learning steps.

        ``y`` may be left out even when the loss takes a target; given, it is not learnt from and
        no loss is computed: it is the result's ``target``, to score the prediction by (test-then-
        train on held-out samples: ``partime.metrics.OnlineMetrics``). The very first sample of a
        pipeline whose loss takes a target, before its stages have started (``start``), needs its
        target anyway (a ValueError says so): the stages learn the target's layout from it.

        The ticks it runs still carry the gradients of the learnt samples in flight: call it with
        gradients on, as ``step``. In a pipeline that does not learn, it is ``step(x, y)``.
        """
        return self._step("predict()", x, y, False)

    def _step(self, verb: str, x: Any, y: Any, learn: bool) -> Result | None:
        self._caller.claim(verb)
        try:
            self._check_open()
            self._check_grad_mode(verb)
            self._feed(x, y, learn=_flag("learn", learn))
            return self._take() if self._due() else None
        finally:
            self._caller.release()

    @on_rank_0(list)
    def flush(self) -> list[Result]:
        """Run the remaining ticks without input; the results still inside, in order.

        When learning, every fed sample's gradient has been applied at every stage on return.
        """
        self._caller.claim("flush()")
        try:
            return self._flush("flush()")
        finally:
            self._caller.release()

    def _flush(self, verb: str) -> list[Result]:
        self._check_open()
        state = self._state
        rest = []
        if state.in_segment:
            self._check_grad_mode(verb)  # the ticks left run the backward of the samples in flight
            executor = self._running(None, None)  # not started yet if resumed with samples in flight
            self._guard(executor.end)
            while state.taken < state.in_segment:
                rest.append(self._take())
            self._guard(executor.sync)
            state.flushed()
        while state.dropped:  # after the last sample that went in (it was refused)
            rest.append(self._take())
        return rest

    @on_rank_0(lambda: iter(()))
    def stream(
        self,
        xs: Iterable[Any],
        ys: Iterable[Any] | None = None,
        *,
        when_behind: arrivals.WhenBehind = "wait",
        learn: Iterable[bool] | None = None,
    ) -> Iterator[Result]:
        """Every sample of ``xs`` (with the targets ``ys``) through the pipeline, then a flush.

        When the loss takes a target and ``ys`` is not given, each item of ``xs`` is a pair
        ``(x, y)`` (as ``partime.streams.moving_digits`` yields). The same results as ``step`` on
        each sample and a ``flush``; while a result is handed out, the pipeline may have run one
        tick further (so that no stage waits for the caller). A ``break`` out of the loop leaves
        the samples in flight inside the pipeline: their results come out of the next ``step``,
        ``flush`` or ``stream``, first.

        ``xs`` may be a live source, which yields at its own pace (``partime.sources``:
        ``at_rate``, a camera's ``video_frames``). ``when_behind`` says what happens when a sample
        arrives before the pipeline can take it (SPEC.md, "Live sources"):

        - ``"wait"`` (the default, for recorded data): the source waits. A recorded stream is read
          one sample per tick; a ``Paced`` source's samples are all taken, late if the pipeline is
          behind, and their latency says how late.
        - ``"drop"`` (for a live source): the newest arrival replaces the one still waiting, so
          the source is never held back and the pipeline holds one waiting sample at most. The
          replaced sample's result comes in sample order, with ``dropped=True`` and no output (nor
          target): no stage computes or steps for it, and learning learns from the samples that
          went in, in the ticks they made. A source that is no ``Paced`` one is read by a thread
          of its own, which times each sample as it comes.

        A live source's results are handed out as soon as they leave the pipeline, so that their
        latency is the pipeline's own: D - 1 arrivals (the ticks that carry a sample through)
        plus the last stage's tick. Each ``Result`` says when its sample arrived and was handed
        out, on the source's clock. A ``Paced`` source begins once the pipeline has taken its first
        sample (and started: its workers, the timing of its layers); a real one does not wait.

        A source that raises ends the stream: every sample it gave before has its result first (the
        pipeline is flushed), in order, and then its error is raised.

        ``learn`` (None: every sample is learnt from) gives one bool per item of ``xs``, as ``ys``
        gives one target: False offers that sample to be predicted, not learnt from (``predict``);
        its target (in ``ys``, or its pair) may then be None. It may be longer than ``xs`` (an
        endless pattern, such as ``itertools.cycle([True] * 9 + [False])``).
        """
        self._caller.check_free("stream()")
        reader = arrivals.inbox(xs, when_behind)  # refuses a policy it does not know, at once
        return self._stream(reader, ys, learn)

    def _stream(
        self, reader: arrivals.Inbox, ys: Iterable[Any] | None, learn: Iterable[bool] | None = None
    ) -> Iterator[Result]:
        try:
            self._check_open()
            self._caller.claim("stream()")
        except BaseException:
            reader.close()
            raise
        try:
            yield from self._streamed(reader, ys, learn)
        finally:
            self._caller.release()

    def _streamed(
        self, reader: arrivals.Inbox, ys: Iterable[Any] | None, learn: Iterable[bool] | None
    ) -> Iterator[Result]:
        self._clock = reader.clock
        read_ahead = 0 if reader.live else READ_AHEAD
        targets = iter(ys) if ys is not None else None
        learns = iter(learn) if learn is not None else None
        pairs = ys is None and self._state.supervised is True
        state = self._state
        begun = False
        failed: Exception | None = None  # what the source raised: after the results of what it gave
        try:
            while True:
                self._check_grad_mode("stream()")  # before an item is taken: a refusal uses up none
                try:
                    found = reader.take()
                except Exception as exc:  # noqa: BLE001 - the source's own (a take runs no stage): raised after the flush
                    failed = exc
                    break
                if not found:
                    break
                for at in found.dropped:
                    if targets is not None and next(targets, _MISSING) is _MISSING:
                        raise ValueError(f"ys ended before xs: there is no target for sample {state.next_index}")
                    _next_flag(learns, state.next_index)
                    state.drop(at)
                for item, at in found.kept:
                    learnt = _next_flag(learns, state.next_index)
                    if pairs:
                        x, y = pair(item, state.next_index)
                    else:
                        x = item
                        y = None if targets is None else next(targets, _MISSING)
                    if y is _MISSING:
                        raise ValueError(f"ys ended before xs: there is no target for sample {state.next_index}")
                    self._feed(x, y, at, learnt)
                    if not begun:  # the pipeline has started from the first sample: the rest may come
                        reader.begin()
                        begun = True
                    while self._due() > read_ahead or state.next_is_dropped():
                        yield self._take()
        finally:
            reader.close()
        if failed is not None:  # every sample the source gave has its result, then its error
            yield from self._flush("stream()")
            raise failed
        if targets is not None and next(targets, _MISSING) is not _MISSING:
            raise ValueError(f"ys is longer than xs: xs ended after {state.next_index} samples")
        yield from self._flush("stream()")

    @on_rank_0()
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

    @on_rank_0()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (made by ``state_dict``) exactly as the pipeline it came from would.

        This pipeline must have the same depth, cut, grad mode, compensation, loss kind and sample
        layout (a ``CheckpointError`` names what differs, with both values) and a model of the same
        architecture, whose weights are replaced. It may be new or open; if its stages are running
        they stop, and stages start from ``state`` at the next sample or ``flush()``. A ``state``
        whose parts contradict each other (``check_contents``), whose identity or cut does not fit
        this pipeline, or whose stages do not load into this pipeline's (``check_fits``: weights,
        optimizer kind and state, a loss's parameters), raises a ``CheckpointError`` before anything
        of this pipeline changes: its weights, counters and running stages are as they were.
        """
        self._check_checkpoints()
        expected = self._identity()
        if isinstance(self._balance, int):
            expected["balance"] = None  # cut where the checkpoint was cut
        checkpoint.check_state(state, expected)
        balance = state["identity"]["balance"]
        try:  # the model's own children, cut where the checkpoint was cut
            modules = self._cut(balance)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint's cut does not fit this model: {exc}") from exc
        state = copy_tensors(dict(state))
        # every check before the first change: each stage tried on copies, the counters read
        checkpoint.check_fits(modules, state, self._config)
        loaded = checkpoint.from_checkpoint(state)
        started = self._executor is not None
        self._stop_executor()
        if self._partition is None or list(self._partition.balance) != balance:
            self._partition = Partition(tuple(balance))
        checkpoint.load_weights(modules, state)
        self._state = loaded
        if started and self._startable():  # started stages stay started: anew, from the checkpoint
            self._start_ahead()

    @on_rank_0()
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``state_dict()`` to ``path``, atomically: a crash leaves the previous file whole."""
        checkpoint.save(self._checkpoint(), path)

    @on_rank_0()
    def load(self, path: str | os.PathLike[str]) -> None:
        """``load_state_dict`` of the checkpoint in ``path``, read by ``checkpoint.load``: a
        ``CheckpointError`` names the file (a missing one raises ``FileNotFoundError``)."""
        state = checkpoint.load(path)
        try:
            self.load_state_dict(state)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc.__cause__

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

    def _check_grad_mode(self, verb: str) -> None:
        """A RuntimeError if ``verb`` was called under the caller's own autocast, or the pipeline
        learns and it was called where autograd is off."""
        check_caller_autocast(verb)
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

    def _not_startable(self, first: tuple[Any, Any] | None) -> str | None:
        """Why the stages cannot start from ``first`` (a sample and its target, or None) before the
        first sample of the stream; None if they can."""
        if first is None:
            return (
                "needs a sample to learn what crosses each boundary: pass start(sample) (with y= for a loss "
                "that takes a target), or sample= to the Pipeline"
            )
        supervised, has_target = self._state.supervised, first[1] is not None
        if supervised is True and not has_target:
            return (
                "needs a target: this pipeline's loss takes one, and its layout is part of the pipeline's; "
                "pass start(sample, y) with a target like the samples'"
            )
        if supervised is False and has_target:
            return "was given a target, but this pipeline takes none: pass start(sample) alone"
        return None

    def _startable(self) -> bool:
        """Whether the stages can start before the first sample: from a loaded checkpoint, or from
        ``sample=`` (or ``start()``'s sample)."""
        return self._state.resume is not None or self._not_startable(self._first) is None

    def _start_ahead(self) -> None:
        """Start the executor before the first sample (``start``): from the loaded checkpoint, or
        from ``_first``; it has run no tick until the first sample goes in (``PipelineState.ahead``)."""
        state = self._state
        if state.resume is not None:
            self._running(None, None)
            return
        assert self._first is not None, "_startable() said so"
        x, y = self._first
        self._running(x, None if y is None else spec_of(y, "the target given to start()"))
        state.ahead = True

    def _stop_executor(self) -> None:
        """Stop and forget the executor: the next start begins anew (``load_state_dict``, a first
        sample that does not fit the stages started ahead of it)."""
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        self._state.layout = None
        self._state.ahead = False

    def _running(self, x: Any, target: ValueSpec | None) -> Executor:
        """The executor; started first, from sample ``x`` (and the layout of its ``target``) or the
        loaded checkpoint, if it is not running yet."""
        if self._executor is not None:
            return self._executor
        # Planning and starting draw nothing from the caller's stream; and no other thread (a live
        # source's reader) draws while they run, or its draws would be rolled back with theirs.
        with TURNS.swapping(), torch.random.fork_rng(devices=[]):
            return self._guard(self._start, x, target)

    def _cut(self, balance: Sequence[int]) -> list[nn.Module]:
        """The model's own stages, cut by ``balance``; the stages' config learns from them which
        stages take gradients (``first_trained``) and the model's names of their parameters."""
        stages = split(self._model, balance)
        self._config.first_trained = first_trained(stages, self._config.loss_fn)
        self._config.parameter_names = model_names(stages, self._root)
        return stages

    def _start(self, x: Any, target: ValueSpec | None) -> Executor:
        """Fix the partition and every boundary's layout from sample ``x`` (the first, or
        ``start()``'s) or the loaded checkpoint; start the executor."""
        state = self._state
        # a loss whose signature does not say: the first sample decides, or start()'s (a sample that
        # decides otherwise starts the stages again: _feed)
        self._config.supervised = bool(state.supervised) if state.supervised is not None else target is not None
        if self._partition is None:
            self._partition = self._plan(x)
            log.info("balanced: %s", self._partition)
        stages = self._cut(self._partition.balance)
        # a loaded checkpoint stays the pipeline's until a tick has run from it (``PipelineState.ran``)
        resume = state.resume
        inputs: list[Any] | None = None  # what each stage took in: the stage processes warm up on it
        if resume is None:
            layout, inputs = layout_of(stages, x, target, self._config.autocast)
        else:
            layout = layout_from_plain(resume["layout"])
        state.layout = layout
        self._executor = executor = self._executor_class(
            stages, self._devices, self._config, self._threads, self._timeout
        )
        if resume is None:
            self._guard(executor.start, layout, warm=inputs)
        else:
            self._guard(executor.start, layout, resume)
        return executor

    def _feed(self, x: Any, y: Any, at: float | None = None, learn: bool = True) -> None:
        """Offer one sample, which arrived at ``at`` (now, if None): run one tick, without taking
        its result; ``learn`` False: to be predicted, not learnt from (in a pipeline that learns)."""
        if at is None:
            at = self._clock.now()
        self._check_open()
        index = self._state.next_index
        predicted = not learn and self._config.learning  # in a pipeline that does not learn, a step
        try:
            x = self._traced_forward.flat_sample(x)
            self._traced_forward.check_traced_on(x)
            self._state.check_sample(index, x, y, self._config.learning, predicted)
            bad = nonfinite(x)
            if bad is not None and self._config.nonfinite == "raise":
                raise ValueError(f"sample {index} is not finite: {bad}; pass nonfinite='skip' to drop such samples")
            restart = self._state.ahead and not _started_for(self._state.layout, x, y, predicted)
            if predicted and y is None and (self._executor is None or restart) and self._state.resume is None:
                self._check_first_prediction(index)
        except (TypeError, ValueError):
            self._state.next_index += 1  # a refused sample uses up its index (see the class docstring)
            raise
        state = self._state
        if restart:
            log.info("sample %d does not fit the layout the stages started from: they start again from it", index)
            self._stop_executor()
        executor = self._running(x, state.y_spec)
        y = copy_tensors(y)  # the pipeline's own copy: the result's target, held by executors in transit
        # a skipped sample goes in as a hole (None): the stages compute nothing on it
        # a predicted sample's target stays here, for its result: no stage takes it
        self._guard(executor.feed, index, None if bad is not None else x, None if predicted else y, not predicted)
        self._state.fed(index, y, at)

    def _check_first_prediction(self, index: int) -> None:
        """A ValueError if sample ``index``, to be predicted without a target, would start stages
        that learn with a target: they learn the target's layout from the sample they start from."""
        if self._state.supervised is False:
            return
        raise ValueError(
            f"sample {index} is to be predicted without a target, but it would start the stages, which learn "
            "every boundary's layout, the target's too, from the first sample: give it its target "
            "(predict(x, y): it is not learnt from, only kept for the result), start the pipeline first "
            "with start(sample, y), or feed a learnt sample first"
        )

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
        result.output = self._traced_forward.structured(result.output)  # what the model returns: a ModelOutput
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
        if self._executor is None or self._state.ahead:  # stages started ahead have run nothing yet
            if self._partition is None:
                raise CheckpointError(
                    "no checkpoint before the cut is known: with balance=D the layers are timed on the "
                    "first sample; pass balance=[...] or sample=, or take it after the first step"
                )
            executor_state = checkpoint.unstarted(copy.deepcopy(self._cut(self._partition.balance)), self._config)
            unstarted = dataclasses.replace(self._state, layout=None)  # as if they had not started
            return checkpoint.to_checkpoint(unstarted, self._identity(), executor_state)
        self._guard(self._executor.sync)
        while len(self._state.held) < self._due():  # out of the pipeline, not handed out yet
            self._state.held.append(self._guard(self._executor.next_result))
        executor_state = self._guard(self._executor.state_dict)
        return checkpoint.to_checkpoint(self._state, self._identity(), executor_state)


@contextmanager
def _running(
    layers: nn.Sequential, sample: Any, options: dict[str, Any], partition: Partition
) -> Iterator[Iterator[Result]]:
    """A pipeline of ``partition`` over a copy of ``layers``, made with ``options``, and its
    results of ``sample`` streamed again and again, for as long as they are taken; the pipeline is
    closed after. When it learns, its loss is zero times the sum of the last stage's output: every
    stage runs its forward, backward and step as it would, and no weight moves by a gradient."""
    loss_fn = None if options["optimizer"] is None else _zero_loss
    with Pipeline(copy.deepcopy(layers), list(partition.balance), loss_fn=loss_fn, **options) as trial:
        yield trial.stream(itertools.repeat(sample))


def _flag(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else a TypeError naming the argument ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def _started_for(layout: Layout | None, x: Any, y: Any, predicted: bool = False) -> bool:
    """Whether stages started with ``layout`` take sample ``x`` with target ``y`` (None: none; a
    ``predicted`` sample's target, which no stage takes, is not asked about)."""
    assert layout is not None, "started stages have a layout"
    if predicted:
        return layout.input == spec_of(x, "sample")
    return layout.input == spec_of(x, "sample") and layout.target == (None if y is None else spec_of(y, "target"))


def _next_flag(flags: Iterator[Any] | None, index: int) -> bool:
    """Whether sample ``index`` of a stream is learnt from: the next of ``flags`` (None: every one)."""
    if flags is None:
        return True
    flag = next(flags, _MISSING)
    if flag is _MISSING:
        raise ValueError(f"learn ended before xs: there is no flag for sample {index}")
    return _flag(f"learn's flag for sample {index}", flag)


def _zero_loss(output: Any) -> torch.Tensor:
    """Zero times the sum of ``output``'s floating-point tensors: a loss whose gradient is zero.

    ``output`` is what the trial's loss is given: the last stage's tensors, or, for a model traced
    on a sample, the model's own output made of them (a ``ModelOutput``, a dict: ``StructuredLoss``)."""
    floats = [t.sum() for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.stack(floats).sum() * 0.0


__all__ = ["EXECUTORS", "Pipeline", "Result"]

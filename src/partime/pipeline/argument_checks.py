"""The checking of ``Pipeline``'s arguments, at construction.

``check_arguments`` raises the error a ``Pipeline`` made with bad arguments raises, naming the
value and, where there is one, the fix, before anything is built; it returns what the pipeline
keeps of them: the executor class, the depth, the devices (one device, or one per stage, each
one this machine has), each stage's thread count and the timeout. With ``balance="auto"`` the depth is what the planner chooses on the sample, so there,
once every other argument has passed, it plans the partition (``planner.plan``) and returns it.
"""

from __future__ import annotations

import inspect
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.stage import GRAD_MODES, NONFINITE, LossFn, OptimizerFactory, StageConfig, check_loss_fn
from ..core.stage.config import SchedulerFactory, check_schedule_and_clipping
from ..executors import Executor, executor_class
from ..learning.compensation import check_compensation
from ..planning.auto_check import confirmed
from ..planning.balance import AUTO, Balance
from ..planning.partition import Partition, check_balance
from ..planning.planner import plan

# the pipeline's logger: its warnings read as the pipeline's, for those who configure that one
log = logging.getLogger("partime.pipeline.pipeline")

Devices = str | torch.device | Sequence[str | torch.device] | None
"""``Pipeline(devices=...)``: None (every stage on the CPU), one device for every stage, or one per stage."""


@dataclass(frozen=True)
class Arguments:
    """What ``Pipeline`` keeps of its checked arguments."""

    executor_class: type[Executor]
    depth: int
    devices: list[str]
    threads: int
    timeout: float | None
    partition: Partition | None = None
    """The partition that ``balance="auto"`` chose; None for any other balance."""
    compile: dict[str, Any] | None = None
    """The keyword arguments of ``torch.compile`` each stage compiles its forward with; None: none."""


def stage_threads(depth: int, threads: int | None) -> int:
    """The torch thread count of each of ``depth`` stages: ``threads`` if given, else the cores
    divided among the stages (at least one)."""
    return threads if threads is not None else max(1, (os.cpu_count() or 1) // depth)


def check_arguments(
    model: nn.Sequential,
    balance: Balance,
    *,
    devices: Devices,
    executor: str,
    loss_fn: LossFn | None,
    optimizer: OptimizerFactory | None,
    grad_mode: str,
    lr_scheduler: SchedulerFactory | None = None,
    max_grad_norm: float | None = None,
    threads: int | None,
    nonfinite: str,
    timeout: float | None,
    sample: Any = None,
    compensation: str | Sequence[str] = "auto",
    running: Callable[[Partition], AbstractContextManager[Iterator[Any]]] | None = None,
    plain: nn.Module | None = None,
    autocast: torch.dtype | None = None,
    compile: Any = False,  # Pipeline's argument, torch.compile's name
) -> Arguments:
    """``Pipeline``'s arguments, checked in the order they are documented: a ValueError (or the
    error of ``check_balance``, ``executor_class``, ``check_loss_fn``,
    ``check_schedule_and_clipping``, ``check_devices``, ``compile_options``, ``check_no_cuda_graphs``)
    for the first that does not fit. Logs a warning when the stages will share this host's cores, or, compiled, dynamo's
    cache (``warn_compile_room``).

    ``devices`` is one device (a string or a ``torch.device``) for every stage, or one per stage;
    each must be a device torch knows (a ValueError naming it otherwise) and one this machine has
    (``check_available``).

    ``balance="auto"`` needs ``sample`` (the depth fixes the devices, each stage's thread count and
    what a checkpoint must match, before the first sample), ``devices`` None or the CPU, and an executor that
    runs every stage from this process; then the layers are timed on ``sample`` with the thread
    count each depth would give its stages, the cut chosen is measured against the plain model
    (``auto_check.confirmed``; ``running(partition)``, where given, opens a pipeline of that cut
    with these arguments and gives its endless results, which an executor with workers is
    measured by; ``plain``, where given, is the model as its user runs it, on ``sample``, which the
    pipeline is measured against: a traced model's own module, where ``model`` is its graph's
    layers), and the partition kept is returned."""
    check_balance(model, balance)
    if grad_mode not in GRAD_MODES:
        raise ValueError(f"unknown grad_mode {grad_mode!r}; choose one of {', '.join(GRAD_MODES)}")
    cls = executor_class(executor)
    if nonfinite not in NONFINITE:
        raise ValueError(f"unknown nonfinite policy {nonfinite!r}; choose one of {', '.join(NONFINITE)}")
    if (loss_fn is None) != (optimizer is None):
        given, missing = ("loss_fn", "optimizer") if optimizer is None else ("optimizer", "loss_fn")
        raise ValueError(
            f"{given} was given without {missing}: learning needs both "
            "(e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.01)), inference neither"
        )
    check_loss_fn(loss_fn)
    check_schedule_and_clipping(optimizer, lr_scheduler, max_grad_norm)
    check_autocast_dtype(autocast)
    compiled = compile_options(compile)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a whole number of at least 1, got {threads!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout must be a number of seconds above 0, or None to wait for ever; got {timeout!r}")
    partition = None
    if balance == AUTO:
        _check_auto(cls, devices, sample)
        count: Callable[[int], int] = lambda d: stage_threads(d, threads)
        partition = plan(model, AUTO, sample, learning=optimizer is not None, threads=count)
        if partition.depth > 1:  # the planner predicts; the stages' own ticks decide
            config = StageConfig(
                partition.depth,
                loss_fn,
                optimizer,
                grad_mode,
                False,
                check_compensation(compensation),
                max_grad_norm=max_grad_norm,  # a clipped step costs its norm; a schedule costs nothing
                autocast=autocast,
            )
            trial = running if cls.has_workers else None
            partition = confirmed(model, partition, sample, config, count, trial, plain=plain)
        depth = partition.depth
    else:
        depth = balance if isinstance(balance, int) else len(balance)
    per_stage: list[torch.device] | None = None
    if isinstance(devices, (str, torch.device)):  # one device for every stage
        per_stage = [_parsed(devices, "devices")] * depth
    elif devices is not None:
        per_stage = [_parsed(d, f"devices[{k}]") for k, d in enumerate(devices)]
    checked_devices = cls.check_devices(per_stage, depth)
    check_available(checked_devices)
    check_autocast_supported(autocast, checked_devices)
    if compiled is not None:
        check_no_cuda_graphs(compiled, checked_devices)
        warn_compile_room(cls, depth)
    if cls.on_this_host and depth > (os.cpu_count() or 1):
        log.warning(
            "%d stages on %d cores: stages will share cores, and the pipeline will not run %d times faster",
            depth,
            os.cpu_count(),
            depth,
        )
    return Arguments(
        executor_class=cls,
        depth=depth,
        devices=checked_devices,
        threads=stage_threads(depth, threads),
        timeout=None if timeout is None else float(timeout),
        partition=partition,
        compile=compiled,
    )


def check_plain_model(model: Any) -> None:
    """A TypeError if ``model`` was compiled: made by ``torch.compile`` (it holds the module it
    compiled as ``_orig_mod``), or compiled in place by ``model.compile()``. A pipeline splits the
    plain module into stages and runs their forwards itself, so it would never run the compiled
    forward: the message names ``Pipeline(compile=...)``, which compiles each stage's."""
    if not isinstance(model, nn.Module):
        return
    if hasattr(model, "_orig_mod"):
        raise TypeError(
            f"model is a torch.compile'd module ({type(model).__name__}), whose compiled forward a pipeline "
            "would never run: it splits the plain module into stages and runs their forwards itself. Pass "
            "the plain model (model._orig_mod) and compile=True, which compiles each stage's forward in its "
            "worker (or compile={'mode': ..., 'backend': ...}: torch.compile's keyword arguments)"
        )
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise TypeError(
            f"model.compile() was called on the model ({type(model).__name__}), whose compiled forward a "
            "pipeline would never run: it splits the module into stages and runs their forwards itself. "
            "Pass a model that was not compiled and compile=True, which compiles each stage's forward in "
            "its worker (or compile={'mode': ..., 'backend': ...}: torch.compile's keyword arguments)"
        )


COMPILE_DEFAULTS: dict[str, Any] = {"dynamic": False}
"""What a stage compiles with unless ``compile=`` says otherwise: every sample has the shapes of the
first (a stage's input has its boundary's layout), so each stage compiles once, for those shapes,
and a stage's shapes never make dynamo compile another's forward with dynamic shapes."""


def compile_options(compile: Any) -> dict[str, Any] | None:
    """The keyword arguments of ``torch.compile`` that each stage compiles its forward with, from
    ``Pipeline(compile=...)``: None for False (nothing compiled); ``COMPILE_DEFAULTS`` for True;
    for a mapping of ``torch.compile``'s keyword arguments (``mode``, ``backend``, ``dynamic``,
    ``fullgraph``, ``options``), those over ``COMPILE_DEFAULTS``. A TypeError for anything else, a
    ValueError for a name ``torch.compile`` does not take or values it refuses (tried here, on a
    module of no layers: torch.compile compiles nothing until it is called)."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return dict(COMPILE_DEFAULTS)
    if not isinstance(compile, Mapping):
        raise TypeError(
            f"compile must be True, False or a dict of torch.compile's keyword arguments (e.g. "
            f"compile={{'mode': 'max-autotune'}}); got {type(compile).__name__} {compile!r}"
        )
    known = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = [name for name in compile if name not in known]
    if unknown:
        raise ValueError(
            f"compile= takes torch.compile's keyword arguments ({', '.join(known)}); {unknown[0]!r} is "
            f"none of them (the model is the pipeline's: each stage compiles its own forward)"
        )
    options = {**COMPILE_DEFAULTS, **compile}
    try:
        torch.compile(nn.Identity(), **options)
    except Exception as exc:  # whatever torch.compile refuses, said with the arguments
        raise ValueError(f"torch.compile refuses compile={dict(compile)!r}: {type(exc).__name__}: {exc}") from exc
    return options


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The modes of ``torch.compile`` that replay CUDA graphs on a CUDA device."""


def check_no_cuda_graphs(options: dict[str, Any], devices: Sequence[str]) -> None:
    """A ValueError if ``options`` would have a stage on a CUDA device replay CUDA graphs (a mode of
    ``CUDA_GRAPH_MODES``, or ``options={"triton.cudagraphs": True}``): a replay writes its outputs
    into the buffers of the one before, while a pipeline holds a stage's outputs until the next
    stage takes them, and, learning, its graphs for late gradients, across ticks. On the CPU
    inductor replays none, and these modes are taken."""
    graphs = options.get("mode") in CUDA_GRAPH_MODES or bool((options.get("options") or {}).get("triton.cudagraphs"))
    if graphs and any(torch.device(d).type == "cuda" for d in devices):
        raise ValueError(
            f"compile={options!r} replays CUDA graphs on the stages' CUDA devices, and each replay writes its "
            "outputs over the last one's, which the pipeline still holds (for the next stage, and for a late "
            "gradient); choose a mode without them: compile={'mode': 'max-autotune-no-cudagraphs'} or True"
        )


def warn_compile_room(cls: type[Executor], depth: int) -> None:
    """A warning if the ``depth`` compiled stages of an executor that runs them all in one process
    (``Executor.shares_process``) may pass dynamo's ``recompile_limit``: dynamo keeps the compiled
    forwards of one function together (every ``nn.Sequential``'s), and a stage past the limit runs
    uncompiled."""
    limit = torch._dynamo.config.recompile_limit
    if cls.shares_process and depth > limit:
        log.warning(
            "compile= with %d stages in one process (%s executor): dynamo keeps at most "
            "torch._dynamo.config.recompile_limit = %d compiled forwards of one function, so stages past it may "
            "run uncompiled; raise it (torch._dynamo.config.recompile_limit = %d) before the first sample, or "
            "use executor='process', where each stage compiles in a process of its own",
            depth,
            cls.kind(),
            limit,
            depth,
        )


def check_autocast_dtype(autocast: Any) -> None:
    """A ValueError unless ``autocast`` is None or a floating ``torch.dtype``."""
    if autocast is None or (isinstance(autocast, torch.dtype) and autocast.is_floating_point):
        return
    raise ValueError(
        f"autocast must be None (full precision) or a floating torch.dtype, e.g. autocast=torch.bfloat16 "
        f"or autocast=torch.float16; got {autocast!r}"
    )


def check_autocast_supported(autocast: torch.dtype | None, devices: Sequence[str]) -> None:
    """A ValueError if torch cannot autocast to ``autocast`` on the type of one of ``devices``
    (torch would warn and compute in full precision there)."""
    if autocast is None:
        return
    for kind in dict.fromkeys(torch.device(d).type for d in devices):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns where it disables autocast: the error below says it
            try:
                with torch.autocast(device_type=kind, dtype=autocast):
                    enabled = torch.is_autocast_enabled(kind)
            except RuntimeError:
                enabled = False
        if not enabled:
            raise ValueError(
                f"torch {torch.__version__} cannot autocast to {autocast} on {kind}: choose another dtype "
                "(torch.bfloat16 is supported on the CPU and on recent GPUs), or autocast=None"
            )


def _parsed(device: str | torch.device, name: str) -> torch.device:
    """``device`` as a ``torch.device``; a ValueError naming it (as ``name``) if torch knows no such device."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"{name} is {device!r}, which is no device torch knows ({exc}); give a device such as "
            "'cpu' or 'cuda:0', or a list of one per stage"
        ) from exc


def check_available(devices: Sequence[str]) -> None:
    """A ValueError naming the first stage whose device this machine does not have: CUDA when
    ``torch.cuda.is_available()`` is False, a CUDA index from ``torch.cuda.device_count()`` on,
    MPS when ``torch.backends.mps.is_available()`` is False; the message lists the devices it has."""
    for stage, name in enumerate(devices):
        device = torch.device(name)
        missing = _missing(device)
        if missing is not None:
            raise ValueError(
                f"stage {stage} is on device {name!r}, which this machine does not have: {missing}; devices "
                f"this machine has: {', '.join(available_devices())}. Give devices= of those (one device "
                "for every stage, e.g. devices='cpu', or one per stage)"
            )


def _missing(device: torch.device) -> str | None:
    """Why this machine has no ``device``; None if it has it."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False (no CUDA device, or a torch built without CUDA)"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"torch.cuda.device_count() is {count}, so its CUDA devices are cuda:0 to cuda:{count - 1}"
    elif device.type == "mps" and not torch.backends.mps.is_available():
        return "torch.backends.mps.is_available() is False"
    return None


def available_devices() -> list[str]:
    """The devices this machine has that a stage can run on: the CPU, each CUDA device, MPS."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{k}" for k in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


def _check_auto(cls: type[Executor], devices: Devices, sample: object) -> None:
    """A ValueError unless ``balance="auto"`` can choose the depth with these arguments."""
    if sample is None:
        raise ValueError(
            f"balance={AUTO!r} needs sample= (a sample like those of the stream): the number of stages "
            "fixes the devices, each stage's thread count and what a checkpoint must match before the "
            "first sample, so the layers are timed when the pipeline is made; or give a number of stages "
            "(e.g. balance=2), which can wait for the first sample"
        )
    if isinstance(devices, (str, torch.device)) and _parsed(devices, "devices").type != "cpu":
        raise ValueError(
            f"balance={AUTO!r} chooses the number of stages by timing them here and puts every stage on "
            f"the CPU, so it takes no other device (got {str(devices)!r}); leave devices=None, or give "
            "a balance"
        )
    if devices is not None and not isinstance(devices, (str, torch.device)):
        raise ValueError(
            f"balance={AUTO!r} chooses the number of stages, so devices cannot be given one per stage "
            f"(got {list(devices)}); leave devices=None, or give a balance"
        )
    if cls.rank is not Executor.rank:
        raise ValueError(
            f"balance={AUTO!r} chooses the number of stages, but the {cls.kind()} executor runs one stage "
            "per rank: give balance=WORLD_SIZE, or the layers of each stage"
        )

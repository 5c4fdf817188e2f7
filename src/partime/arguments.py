"""The checking of ``Pipeline``'s arguments, at construction (internal module).

``check_arguments`` raises the error a ``Pipeline`` made with bad arguments raises, naming the
value and, where there is one, the fix, before anything is built; it returns what the pipeline
keeps of them: the executor class, the depth, the devices, each stage's thread count and the
timeout.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .executors import Executor, executor_class
from .partition import check_balance
from .stage import GRAD_MODES, NONFINITE, LossFn, OptimizerFactory, check_loss_fn

# the pipeline's logger: its warnings read as the pipeline's, for those who configure that one
log = logging.getLogger("partime.pipeline")


@dataclass(frozen=True)
class Arguments:
    """What ``Pipeline`` keeps of its checked arguments."""

    executor_class: type[Executor]
    depth: int
    devices: list[str]
    threads: int
    timeout: float | None


def check_arguments(
    model: nn.Sequential,
    balance: int | Sequence[int],
    *,
    devices: Sequence[str | torch.device] | None,
    executor: str,
    loss_fn: LossFn | None,
    optimizer: OptimizerFactory | None,
    grad_mode: str,
    threads: int | None,
    nonfinite: str,
    timeout: float | None,
) -> Arguments:
    """``Pipeline``'s arguments, checked in the order they are documented: a ValueError (or the
    error of ``check_balance``, ``executor_class``, ``check_loss_fn``, ``check_devices``) for the
    first that does not fit. Logs a warning when the stages will share this host's cores."""
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
    depth = balance if isinstance(balance, int) else len(balance)
    checked_devices = cls.check_devices(devices, depth)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a whole number of at least 1, got {threads!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout must be a number of seconds above 0, or None to wait for ever; got {timeout!r}")
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
        threads=threads if threads is not None else max(1, (os.cpu_count() or 1) // depth),
        timeout=None if timeout is None else float(timeout),
    )

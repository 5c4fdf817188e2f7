"""Executors: the ways a pipeline's stages can be run, and what they share.

``base.py`` is the interface every executor implements, ``inline.py`` the SPEC as plain code, and
``process/``, ``thread/`` and ``distributed/`` the executors whose stages run in workers of their
own; beside them, what those share: the loop of a stage in its worker, the messages every link
carries, the caller's ends of the links, the caller's side of the workers, the last stage the
caller hosts, and what a stage sent, for checkpoints. ``REGISTRY`` names them; a module is
imported only when a pipeline chooses its executor. Everything here is internal to partime.
"""

from __future__ import annotations

from importlib import import_module
from typing import Literal

from .base import Executor, Layout

ExecutorName = Literal["inline", "process", "thread", "distributed"]
"""The name of an executor, for a type checker: what ``Pipeline(executor=...)`` takes, the values
of ``EXECUTORS``."""

REGISTRY: dict[ExecutorName, str] = {
    "inline": "inline:InlineExecutor",
    "process": "process.executor:ProcessExecutor",
    "thread": "thread.executor:ThreadExecutor",
    "distributed": "distributed.executor:DistributedExecutor",
}
"""Each executor's name and where its class is (``module:Class`` in this package); a module is
imported only when a pipeline chooses its executor."""

EXECUTORS: tuple[ExecutorName, ...] = tuple(REGISTRY)
"""The executors' names, in the order ``REGISTRY`` lists them."""


def executor_class(name: str) -> type[Executor]:
    """The executor called ``name``; a ValueError listing the choices for any other name."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}")
    module, cls = REGISTRY[name].split(":")
    found: type[Executor] = getattr(import_module(f".{module}", __name__), cls)
    return found


__all__ = ["EXECUTORS", "Executor", "ExecutorName", "Layout", "executor_class"]

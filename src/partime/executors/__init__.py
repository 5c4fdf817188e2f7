"""Executors: the ways a pipeline's stages can be run (internal package)."""

from __future__ import annotations

from .base import Executor, Layout, Result

EXECUTORS = ("inline", "process", "thread", "distributed")


def executor_class(name: str) -> type[Executor]:
    """The executor called ``name``; a ValueError listing the choices for any other name."""
    if name == "inline":
        from .inline import InlineExecutor

        return InlineExecutor
    if name == "process":
        from .process import ProcessExecutor

        return ProcessExecutor
    if name == "thread":
        from .thread import ThreadExecutor

        return ThreadExecutor
    if name == "distributed":
        from .distributed import DistributedExecutor

        return DistributedExecutor
    raise ValueError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}")


__all__ = ["EXECUTORS", "Executor", "Layout", "Result", "executor_class"]

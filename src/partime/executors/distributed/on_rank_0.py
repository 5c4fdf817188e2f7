"""``on_rank_0``: a method that runs only on rank 0 of the distributed executor.

Every other executor has one rank, 0, so there the method always runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Ranked(Protocol):
    """An object that knows its rank: ``_rank`` (0 outside the distributed executor)."""

    _rank: int


_S = TypeVar("_S", bound=Ranked)


def on_rank_0(
    otherwise: Callable[[], Any] = lambda: None,
) -> Callable[[Callable[Concatenate[_S, _P], _R]], Callable[Concatenate[_S, _P], _R]]:
    """A method of ``Pipeline`` that does nothing, and returns ``otherwise()``, on the ranks > 0 of
    the distributed executor: they serve their stage in ``open``; rank 0 reads the stream and
    holds the checkpoints."""

    def decorate(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
        @functools.wraps(method)
        def call(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            return otherwise() if self._rank > 0 else method(self, *args, **kwargs)

        return call

    return decorate

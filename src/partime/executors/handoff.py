"""Links and gates between threads of one process, by reference.

``Handoff`` has ``shared_memory.Channel``'s ``put`` and ``get`` and ``Signal`` a semaphore's
``acquire`` and ``release``, for stages that run in threads of the caller's process (the thread
executor) or in the caller itself (``hosted.py``).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..core.boundary_values import dense
from .messages import Message
from .waiting import POLL_S


class Signal:
    """A counting semaphore between threads, on ``queue.SimpleQueue`` (C code, and about twice as
    fast to hand over as ``threading.Semaphore``, which is written in Python)."""

    def __init__(self) -> None:
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()

    def release(self) -> None:
        self._tokens.put(None)

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        try:
            self._tokens.get(blocking, timeout)
        except queue.Empty:
            return False
        return True


class Handoff:
    """A FIFO between two threads with ``shared_memory.Channel``'s ``put`` and ``get``: the tensors go by
    reference, with their strides (a view with gaps as a dense copy: ``boundary_values.dense``), or,
    with ``copy`` (what the caller feeds), as contiguous copies of their own; the receiver lays them
    out as its boundary's layout says (``boundary_values.rebuild``). It holds as many messages as
    are put: a stage sends at most one per tick offered, and the caller offers a tick only with a
    sample and takes each result when due, so no more than D + 2 are ever in it."""

    def __init__(self, name: str, *, copy: bool = False):
        self.name, self._copy = name, copy
        self._items: queue.SimpleQueue[Message] = queue.SimpleQueue()

    def put(
        self,
        kind: int,
        index: int,
        tensors: Sequence[Tensor] = (),
        scalar: float = 0.0,
        *,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Hand one message over; it never waits."""
        if self._copy:
            values = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in tensors)
        else:
            values = tuple(dense(t.detach()) for t in tensors)
        self._items.put(Message(kind, index, scalar, values))

    def empty(self) -> bool:
        """Whether no message is waiting to be taken."""
        return self._items.empty()

    def get(self, *, check: Callable[[], None] | None = None) -> Message:
        """The oldest message, waiting for one, ``POLL_S`` at a time; whatever ``check`` raises while
        waiting propagates."""
        while True:
            try:
                return self._items.get(True, POLL_S)
            except queue.Empty:
                if check is not None:
                    check()

"""Hand tensors from one process to another through shared memory.

A ``Channel`` is a bounded ring of ``capacity`` slots, preallocated in shared memory, between
exactly one producer process and one consumer process::

    producer (put)                                    consumer (get)
      wait "free"                                       wait "filled"
      copy the tensors into slot p   ── slot p ──►      clone the tensors of slot g
      post "filled"; p = p + 1 mod capacity             post "free"; g = g + 1 mod capacity

Each side keeps its own slot counter; the two POSIX semaphores ("free" starts at ``capacity``,
"filled" at 0) order the slots and give the memory barriers, so a slot is never read while it is
written. Nothing is pickled per message: a message is a small header (kind, index, ``ntensors``)
in a shared int64 tensor, a float64 scalar, and the tensors copied into preallocated slot tensors.

The shared tensors come from ``Tensor.share_memory_()``; handed to a process started by the
``spawn`` context of ``torch.multiprocessing`` (as a ``Process`` argument) they travel as file
descriptors of already unlinked memory, so nothing is left in ``/dev/shm`` once both sides exit.
The two semaphores come from ``ctx.Semaphore``: the process executor gives it
``semaphore.SharedSemaphore``, whose names it unlinks (``unlink``) as soon as both sides hold the
channel, so that nothing of a channel stays in ``/dev/shm`` whatever happens to the processes.

A wait (``waiting.wait``) spins briefly and then blocks in bounded steps, asking an abort check
after each one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ...core.boundary_values import TensorSpec
from ..messages import KIND_DATA, Message
from ..waiting import SPIN_S, wait

log = logging.getLogger(__name__)


class Flag:
    """A flag in shared memory, for processes started by ``spawn``: one sets it, the others read it
    (as "stop" is read in an abort check). It holds no semaphore and leaves nothing in ``/dev/shm``."""

    def __init__(self) -> None:
        self._cell = torch.zeros(1, dtype=torch.uint8).share_memory_()
        self._bind()

    def _bind(self) -> None:
        self._view = memoryview(self._cell.numpy())

    def set(self) -> None:
        self._view[0] = 1

    def is_set(self) -> bool:
        return self._view[0] == 1

    def __getstate__(self) -> dict[str, Any]:
        return {"_cell": self._cell}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._cell = state["_cell"]
        self._bind()


class Channel:
    """Single-producer single-consumer bounded ring of ``capacity`` preallocated shared-memory
    slots, each holding tensors of fixed ``specs`` plus a small header (kind, index, scalar).

    ``put`` blocks while all slots are full; ``get`` blocks while all are empty; both wait as
    ``wait`` does, spinning ``spin_s`` first. One process puts and one process gets (which may be
    the same one); each side counts its own slots. A channel crosses into another process only as
    an argument of a process being started by the ``spawn`` context, not through a queue.
    """

    def __init__(
        self,
        ctx: Any,
        specs: Sequence[TensorSpec],
        capacity: int = 2,
        *,
        name: str = "",
        spin_s: float = SPIN_S,
    ):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"channel {name!r}: capacity must be an int >= 1, got {capacity!r}")
        specs = tuple(specs)
        for i, spec in enumerate(specs):
            if not isinstance(spec, TensorSpec):
                raise TypeError(f"channel {name!r}: spec {i} must be a TensorSpec, got {type(spec).__name__}")
        self.name = name
        self.specs = specs
        self.capacity = capacity
        self.spin_s = spin_s
        # Header per slot: kind, index, number of tensors sent (0 or len(specs)).
        self._header = torch.zeros(capacity * 3, dtype=torch.int64).share_memory_()
        self._scalar = torch.zeros(capacity, dtype=torch.float64).share_memory_()
        # each slot in its spec's strides: a channels_last activation crosses without a copy into another layout
        self._buffers = tuple(spec.zeros(capacity).share_memory_() for spec in specs)
        self._free = ctx.Semaphore(capacity)
        self._filled = ctx.Semaphore(0)
        self._put_at = 0
        self._get_at = 0
        self._bind()
        log.debug("channel %r: %d slots of %s", name, capacity, self._layout())

    def _bind(self) -> None:
        """Make the per-process views: slot tensors and memoryviews of the header (cheap to index)."""
        self._slots = tuple(tuple(buf[s] for buf in self._buffers) for s in range(self.capacity))
        self._header_mv = memoryview(self._header.numpy()).cast("B").cast("q")
        self._scalar_mv = memoryview(self._scalar.numpy()).cast("B").cast("d")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_slots", "_header_mv", "_scalar_mv"):
            del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    def unlink(self) -> None:
        """Remove the names of the channel's semaphores, where they have one to remove
        (``semaphore.SharedSemaphore``): once both processes hold the channel."""
        for sem in (self._free, self._filled):
            getattr(sem, "unlink", lambda: None)()

    def _layout(self) -> str:
        return "(" + ", ".join(str(s) for s in self.specs) + ")"

    def __repr__(self) -> str:
        return f"Channel({self.name!r}, {self._layout()}, capacity={self.capacity})"

    def _validate(self, kind: int, tensors: Sequence[Tensor]) -> None:
        if len(tensors) == 1 == len(self.specs):  # the common case, checked first at little cost
            (t,), (spec,) = tensors, self.specs
            if isinstance(t, Tensor) and t.shape == spec.shape and t.dtype == spec.dtype:
                return
        if len(tensors) != len(self.specs) and (tensors or kind == KIND_DATA):
            raise ValueError(
                f"channel {self.name!r}: got {len(tensors)} tensors for a message of kind {kind}, "
                f"expected {len(self.specs)} {self._layout()}"
            )
        for i, (t, spec) in enumerate(zip(tensors, self.specs)):
            if not isinstance(t, Tensor):
                raise TypeError(f"channel {self.name!r}: tensor {i} is a {type(t).__name__}, expected {spec}")
            if t.shape != spec.shape or t.dtype != spec.dtype:
                got = TensorSpec(tuple(t.shape), t.dtype)
                raise ValueError(
                    f"channel {self.name!r}: tensor {i} is {got}, but the channel carries {spec} "
                    f"at that position (all: {self._layout()})"
                )

    def put(
        self,
        kind: int,
        index: int,
        tensors: Sequence[Tensor] = (),
        scalar: float = 0.0,
        *,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Send one message, waiting for a free slot; the tensors are copied, so the caller keeps them.

        ``tensors`` must match the channel's specs in number, shape and dtype (a ValueError naming
        the channel, the position and both specs otherwise), or be empty for a kind other than
        ``KIND_DATA``. They may live on any device and may require grad (their data is copied).
        Whatever ``check`` raises while waiting propagates, and then nothing was sent.
        """
        self._validate(kind, tensors)
        wait(self._free, check, self.spin_s)
        slot = self._put_at
        try:
            for dst, src in zip(self._slots[slot], tensors):
                dst.copy_(src.detach() if src.requires_grad else src)
        except BaseException:
            self._free.release()  # nothing was sent: give the slot back
            raise
        self._put_at = (slot + 1) % self.capacity
        h = self._header_mv
        h[3 * slot] = kind
        h[3 * slot + 1] = index
        h[3 * slot + 2] = len(tensors)
        self._scalar_mv[slot] = scalar
        self._filled.release()

    def get(self, *, check: Callable[[], None] | None = None) -> Message:
        """Receive the oldest message, waiting for one; its tensors are fresh copies.

        Whatever ``check`` raises while waiting propagates, and then nothing was received.
        """
        wait(self._filled, check, self.spin_s)
        slot = self._get_at
        self._get_at = (slot + 1) % self.capacity
        h = self._header_mv
        kind, index, count = h[3 * slot], h[3 * slot + 1], h[3 * slot + 2]
        scalar = self._scalar_mv[slot]
        tensors = tuple(t.clone() for t in self._slots[slot]) if count else ()
        self._free.release()
        return Message(kind, index, scalar, tensors)

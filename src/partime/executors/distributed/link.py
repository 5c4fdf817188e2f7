"""A one-way link between two torch.distributed ranks: ``put`` on one, ``get`` on the other.

A ``RankLink`` has ``shared_memory.Channel``'s ``put``/``get``, so the shared stage loop
(``worker_loop.run_segment``) runs on it unchanged. Behind them, a process group of its own; ``put``
sends at once, with a blocking ``send``, and at the other end a thread does nothing but blocking
``recv``s, one message after the other, into a mailbox that ``get`` reads.

Why so: gloo's known traps are that ``isend``/``irecv`` progress only inside ``wait()``, that
several outstanding operations can hang, and that ``batch_isend_irecv`` has hung. Here every
operation is a blocking ``send`` or ``recv`` (post and wait at once), so no operation is ever
outstanding without someone waiting on it; every link has a process group of its own, used on
each side by one thread at a time (a lock on the sending side), so no group ever has two
operations in flight on one side, both sides see its messages in one order, and nothing is
batched. (NCCL needs the same: one thread at a time per communicator.) Since the receiving
thread never waits for room (whoever reads a link takes each message when due, which bounds what
is in flight), a send lasts only as long as the wire takes the bytes; and since the sender sends
from its own thread, a hop costs no thread hand-off on the sending side (on the receiving side it
overlaps the reader's computation). An idle link carries a ping every ``PING_S``, so gloo's
timeout (``LINK_TIMEOUT_S``) fires only on a peer that is alive but stuck.

A message on a link whose only payload is ``KIND_DATA``'s (activations, gradients, results,
targets) is one frame of bytes (header and tensors, of a size fixed by the layout), so one send
per hop; such a link also carries ``KIND_SKIP`` (``nonfinite="skip"``), with the same tensors
(a result whose loss was skipped) or none (a hole, a gradient that will not come), and
``KIND_PREDICT`` (a predicted sample's value or result), with the same tensors; the ranks call the process group's own ``send``/``recv`` and wait at once, skipping
``torch.distributed.send``'s checks. A link that breaks says so through the ``report_loss`` its
maker gives it: the run's ``Health.lost`` (``ranks.py``), which publishes it to every rank.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...core.boundary_values import TensorSpec, in_bytes
from ..messages import KIND_CLOSE, KIND_DATA, KIND_PING, KIND_PREDICT, KIND_SKIP, Message
from ..waiting import POLL_S, Aborted

PING_S = 2.0
"""How long a link may be idle before its sending thread sends a ping."""
LINK_TIMEOUT_S = 60.0
"""Gloo's timeout on every link: how long a send or receive may last, idle time included."""


class Mailbox:
    """An unbounded FIFO from a link's receiving thread to whoever reads the link."""

    def __init__(self) -> None:
        self._items: deque[Message] = deque()
        self._cond = threading.Condition()

    def put(self, item: Message) -> None:
        """Append ``item``; never waits."""
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def get(self, check: Callable[[], None] | None = None) -> Message:
        """The oldest item, waiting for one; ``check`` is called every ``POLL_S`` of waiting and
        whatever it raises propagates."""
        with self._cond:
            while not self._items:
                if not self._cond.wait(POLL_S) and check is not None:
                    check()
            return self._items.popleft()


_HEADER = 4 * 8  # kind, index, scalar, whether tensors follow: float64
_ALIGN = 64  # where each tensor starts in a frame, so that any dtype can view it


def _frame_layout(specs: Sequence[TensorSpec], start: int) -> tuple[list[int], int]:
    """Where each tensor of ``specs`` starts in a frame whose first one starts at ``start``, and its size."""
    offsets, end = [], start
    for spec in specs:
        end = -(-end // _ALIGN) * _ALIGN
        offsets.append(end)
        end += spec.nbytes
    return offsets, end


class RankLink:
    """One direction between two ranks, with ``put``/``get`` like ``shared_memory.Channel``: a process
    group of its own, the sender's ``put`` sending at once and a thread at the other end that
    receives every message as it comes.

    A message travels as bytes: a header ``(kind, index, scalar, whether it has tensors)`` and the
    tensors that ``payload`` gives for its kind (on a packed link a SKIP may have them or not). On a link whose only payload is ``KIND_DATA``'s (activations, gradients,
    results, targets) header and tensors go as one frame of fixed size, one send per message; on
    the others (control, reply) the header goes alone, then the tensors, if the kind has any.
    ``put`` copies the tensors into the frame, so the caller keeps them; ``get`` hands out views
    of a frame of its own.

    ``put`` sends from the caller's thread, holding the link's lock (one operation at a time on
    its group, whoever sends): since the other end's thread is always receiving, a send lasts as
    long as the wire takes the bytes (on one host, a copy into the socket's buffer) and no thread
    wakes up per message to send it. The sending end's own thread only keeps an idle link alive (a
    ping once ``PING_S`` passed without a message) and sends the CLOSE of ``hang_up``.
    """

    def __init__(
        self,
        name: str,
        group: Any,
        peer: int,
        sending: bool,
        payload: Mapping[int, tuple[TensorSpec, ...]],
        device: torch.device,
        report_loss: Callable[[str, int, BaseException], None],
        deliver: Callable[[Message], None] | None = None,
    ):
        self.name, self.group, self.peer, self.device = name, group, peer, device
        self._report_loss = report_loss  # (link's name, peer, what broke it): the loss of the peer
        self.sending, self.payload = sending, payload
        self._to = dist.get_group_rank(group, peer)  # the process group's own calls: no per-call checks
        self._packed = set(payload) == {KIND_DATA}
        self._layouts = {kind: _frame_layout(specs, _HEADER if self._packed else 0) for kind, specs in payload.items()}
        self._lock = threading.Lock()  # held while a message goes on the wire
        self._sent_at = time.monotonic()
        self._hung_up = False
        self._hang_up = threading.Event()
        # On the CPU a send is over once ``wait`` returns, so a packed link reuses one frame (on a
        # GPU ``wait`` only orders streams: a new frame per message there).
        self._frame: tuple[Tensor, Any, tuple[Tensor, ...]] | None = None
        if sending and self._packed and self.device.type == "cpu":
            frame = torch.empty(self._layouts[KIND_DATA][1], dtype=torch.uint8)
            header = frame[:_HEADER].view(torch.float64).numpy()  # written in place: no tensor per message
            self._frame = (frame, header, self._tensors(KIND_DATA, frame))
        self._box = Mailbox()
        self._control = deliver is not None
        self._deliver = deliver or self._box.put
        loop = self._send_loop if sending else self._receive_loop
        self._thread = threading.Thread(target=loop, name=f"partime {name}", daemon=True)
        self._thread.start()

    def put(
        self,
        kind: int,
        index: int,
        tensors: Sequence[Tensor] = (),
        scalar: float = 0.0,
        *,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Send one message; it is on the wire when ``put`` returns, and the caller keeps the tensors.

        A ValueError names the link and both layouts unless the tensors are the ones ``payload``
        gives for ``kind``. Once the link is hung up or broken (a broken link is reported to
        ``report_loss`` first, as the loss of the peer), ``check`` is asked, and what it raises
        propagates: rank 0's caller, whose check raises the run's failure, gets the error that names
        the stage, as it does while it waits. Otherwise ``Aborted``. A send never waits for room;
        while another send holds the wire, ``check`` is asked every ``POLL_S``.
        """
        specs = self.payload.get(KIND_DATA if self._packed and kind in (KIND_SKIP, KIND_PREDICT) else kind, ())
        got = tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors)
        if got != specs and not (got == () and kind == KIND_SKIP):
            raise ValueError(
                f"link {self.name!r}: got tensors {[str(s) for s in got]} for a message of kind "
                f"{kind}, but it carries {[str(s) for s in specs]}"
            )
        broken: Exception | None = None
        while not self._lock.acquire(timeout=POLL_S):  # a ping to a peer that is gone may hold it long
            if check is not None:
                check()
        try:
            if not self._hung_up:
                try:
                    self._send(kind, index, scalar, tensors)
                    return
                except Exception as exc:  # noqa: BLE001 - the peer is gone, or the wire: raised below
                    self._report_loss(self.name, self.peer, exc)
                    broken = exc
        finally:
            self._lock.release()
        if check is not None:
            check()
        raise Aborted from broken

    def get(self, *, check: Callable[[], None] | None = None) -> Message:
        """The oldest message the receiving thread has read, waiting for one; its tensors are the
        receiver's own. Whatever ``check`` raises while waiting propagates."""
        return self._box.get(check)

    def _send(self, kind: int, index: int, scalar: float, tensors: Sequence[Tensor]) -> None:
        """Put the message on the wire; the caller holds the lock."""
        if self._frame is not None:  # the common case, made cheap: a packed link on the CPU
            frame, header, slots = self._frame
            header[0], header[1], header[2], header[3] = kind, index, scalar, bool(tensors)
            for slot, t in zip(slots, tensors):
                slot.copy_(t.detach())
            frames: tuple[Tensor, ...] = (frame,)
        else:
            frames = self._frames(kind, index, scalar, tensors)
        for frame in frames:
            self.group.send([frame], self._to, 0).wait()
        self._sent_at = time.monotonic()

    def _frames(self, kind: int, index: int, scalar: float, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """The message as the frames that go on the wire, newly made."""
        header = torch.tensor([kind, index, scalar, bool(tensors)], dtype=torch.float64).view(torch.uint8)
        if not self._packed:
            header = header.to(self.device)
            if not tensors:
                return (header,)
        offsets, size = self._layouts[KIND_DATA if self._packed else kind]
        frame = torch.empty(size, dtype=torch.uint8, device=self.device)
        for t, at, spec in zip(tensors, offsets, self.payload[KIND_DATA if self._packed else kind]):
            in_bytes(frame[at : at + spec.nbytes], spec).copy_(t.detach())  # in the strides the receiver reads
        if not self._packed:
            return (header, frame)
        frame[:_HEADER].copy_(header)
        return (frame,)

    def _tensors(self, kind: int, frame: Tensor) -> tuple[Tensor, ...]:
        """The tensors of a message of ``kind`` in ``frame``, as views."""
        if self._packed:
            kind = KIND_DATA
        specs = self.payload.get(kind, ())
        offsets = self._layouts[kind][0] if specs else ()
        # each in its layout's strides (a channels_last activation crosses as it is)
        return tuple(in_bytes(frame[at : at + s.nbytes], s) for s, at in zip(specs, offsets))

    def hang_up(self) -> None:
        """Sending end: CLOSE goes after every message sent so far, and the thread ends; later
        ``put``s raise ``Aborted``. Returns at once; idempotent."""
        self._hung_up = True
        self._hang_up.set()

    @property
    def thread(self) -> threading.Thread:
        """The thread of this end: it ends once both ends have hung up (or the link broke)."""
        return self._thread

    def _send_loop(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            while not self._hang_up.wait(max(0.0, self._sent_at + PING_S - time.monotonic())):
                with self._lock:
                    if not self._hung_up and time.monotonic() - self._sent_at >= PING_S:
                        self._send(KIND_PING, 0, 0.0, ())
            with self._lock:
                self._send(KIND_CLOSE, 0, 0.0, ())
        except BaseException as exc:  # noqa: BLE001 - the run's failure, seen from this link
            self._report_loss(self.name, self.peer, exc)

    def _receive(self, size: int) -> Tensor:
        frame = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.group.recv([frame], self._to, 0).wait()
        return frame

    def _receive_loop(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            while True:
                frame = self._receive(self._layouts[KIND_DATA][1] if self._packed else _HEADER)
                header = frame[:_HEADER].cpu().numpy()
                # numpy's stubs give ndarray its __buffer__ only for Python >= 3.12 (mypy checks for 3.10)
                kind, index, scalar, full = struct.unpack_from("=4d", header)  # type: ignore[arg-type]
                kind, index = int(kind), int(index)
                if kind == KIND_CLOSE:
                    if self._control:  # the other end of a control link needs to hear it
                        self._deliver(Message(kind, index, scalar, ()))
                    return
                if not self._packed and full and self.payload.get(kind):  # its tensors follow
                    frame = self._receive(self._layouts[kind][1])
                if kind != KIND_PING:
                    try:
                        self._deliver(Message(kind, index, scalar, self._tensors(kind, frame) if full else ()))
                    except Aborted:  # the run is over: go on receiving, until the other end hangs up
                        pass
        except BaseException as exc:  # noqa: BLE001 - the run's failure, seen from this link
            self._report_loss(self.name, self.peer, exc)


class Permits(threading.Semaphore):
    """The permits of a stage's ticks. ``waiting.wait`` spins on non-blocking tries; here each
    one lets the other threads of the process run, since one of them grants the permits."""

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        if not blocking:
            time.sleep(0)  # releases the GIL
        return super().acquire(blocking, timeout)

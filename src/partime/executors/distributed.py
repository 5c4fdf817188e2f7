"""The distributed executor: one stage per torch.distributed rank, started by torchrun (internal module).

Every rank runs the same script under ``torchrun``; rank r hosts stage r, on ``cuda:LOCAL_RANK``
where there are GPUs and on the CPU otherwise. Rank 0 reads the stream, so ``stream``, ``step``
and ``flush`` return results there; the last rank sends them back::

    rank 0                      rank 1                       rank D-1
    caller ──x──► stage 0 ──a──► stage 1 ──a──► … ──a──► stage D-1 ──result──► caller (rank 0)
                  stage 0 ◄──g── stage 1 ◄──g── … ◄──g── stage D-1 ◄──target── caller (rank 0)
    caller ──permits, snapshot requests──► every rank ──weights──► caller

Each stage runs ``worker.run_segment``, the loop the process executor's workers run: on rank 0 in a
thread beside the caller (which only feeds samples and takes results), on the other ranks in the
script's own thread, inside ``Pipeline.open`` (``with pipe:``), until rank 0 closes the pipeline.
There ``stream`` then yields nothing, ``step`` returns None and ``flush`` []. A stage starts a
tick only once rank 0's caller has offered it (a permit travels to every rank per tick), so between
two ticks ``pipe.module`` on rank 0 can fetch every stage's weights: each rank sends its stage's
``state_dict`` when asked (at every ``flush`` and every read of ``pipe.module``); optimizer states
stay on their ranks. At the first sample rank 0 publishes the cut and every boundary's layout in
the process group's store and sends each rank its stage's weights, so all ranks start alike.

Communication: a thread per link end, each link its own process group. Gloo's known traps are
that ``isend``/``irecv`` progress only inside ``wait()``, that several outstanding operations can
hang, and that ``batch_isend_irecv`` has hung. Here every operation is a blocking ``send`` or
``recv`` (post and wait at once) made by a thread that does nothing else, so no operation is ever
outstanding without someone waiting on it; and every link (activations i→i+1, gradients i+1→i,
results, targets, control 0→r, reply r→0) has a process group of its own with one thread at each
end, so no group ever has two operations in flight on one side, both sides see its messages in
one order, and nothing is batched. (NCCL needs the same: one thread per communicator.)

A fixed order of blocking operations per tick was the alternative. It was not chosen because
``run_segment`` sends an activation forward before it receives the gradient back, and with
unbuffered sends stage i would wait on stage i+1 to receive while i+1 waits on i to take its
gradient: a deadlock, avoided only by ordering every tick's transfers boundary by boundary, which
serialises the D-1 hops of a tick and makes rank 0's caller take part in every one. With threads,
``put`` returns once the message is queued (at most ``CAPACITY`` wait), ``get`` takes what the
receiving thread has already read off the wire, a hop overlaps the next computation, and the
stage loop is the one the shared-memory executor runs. Receiving threads never wait for room
(the caller takes each result when due, which bounds what is in flight on every link to about
D ticks), so a send lasts only as long as the wire; an idle link carries a ping every ``PING_S``,
so gloo's timeout (``LINK_TIMEOUT_S``) fires only on a peer that is alive but stuck.

A message on an activation, gradient, result or target link is one frame of bytes (header and
tensors, of a size fixed by the layout), so one send per hop; the threads call the process
group's own ``send``/``recv`` and wait at once, skipping ``torch.distributed.send``'s checks.

Failures: a stage that fails, or a rank that sees a link break, publishes the failure (stage,
sample, phase, traceback) in the process group's store, where the first one wins. Every rank
looks there whenever a wait has lasted ``POLL_S`` and stops with that failure as a
``StageError`` (a ``WorkerDiedError`` for a rank that vanished): within a fraction of a second,
not at a timeout. A rank whose process dies closes its sockets, which breaks its neighbours'
links at once. A blocking receive cannot be interrupted, so every rank, failed or not, hangs up
all its links when it stops and waits (``FAILED_CLOSE_S`` at most after a failure) for the other
ends to hang up too: a thread still blocked in gloo when the interpreter exits aborts the process.
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import pickle
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import schedule
from ..errors import PipelineClosedError, StageError, WorkerDiedError
from ..partition import check_balance, split
from ..stage import Stage, StageConfig
from ..transport import KIND_DATA, KIND_END, POLL_S, Aborted, Channel, Message, wait
from ..values import TensorSpec, as_tensors, rebuild
from ..worker import Links, Where, run_segment
from .base import LOOKAHEAD, Executor, Layout, Result

log = logging.getLogger(__name__)

KIND_PERMIT = 3
"""Rank 0 to rank r: ``index`` ticks have been offered in all (permits only grow)."""
KIND_STATE = 4
"""A stage's ``state_dict`` tensors: its first weights (0 to r), or a snapshot (r to 0)."""
KIND_SNAPSHOT = 5
"""Rank 0 to rank r: send the weights as they are once ``index`` ticks are done."""
KIND_PING = 6
"""Nothing: keeps an idle link inside gloo's timeout."""
KIND_CLOSE = 7
"""The last message on a link."""

CAPACITY = 2
"""Messages a stage may queue on a link before ``put`` waits for the sending thread."""
PING_S = 2.0
"""How long a link may be idle before its sending thread sends a ping."""
LINK_TIMEOUT_S = 60.0
"""Gloo's timeout on every link: how long a send or receive may last, idle time included."""
CLOSE_S = 30.0
"""How long ``close`` waits for the other ranks to finish their current tick and hang up."""
FAILED_CLOSE_S = 3.0
"""The same after a failure, when a rank may be gone."""


def device_of_rank() -> torch.device:
    """The device this rank's stage runs on: ``cuda:LOCAL_RANK`` where there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def join_group(depth: int | None = None) -> int:
    """This process's rank, once it is in the default process group (joined from torchrun's
    environment if the script has not); with ``depth``, a ValueError unless there is one rank per stage."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(
                "the distributed executor runs one process per stage, started by torchrun "
                "(RANK and WORLD_SIZE are not set): torchrun --standalone --nproc-per-node=D script.py"
            )
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if depth is not None and world != depth:
        raise ValueError(
            f"the distributed executor runs one stage per rank, but there are {depth} stages and "
            f"{world} ranks; start {depth} ranks (torchrun --nproc-per-node={depth}) or cut the model "
            f"into {world} stages"
        )
    if not dist.is_initialized():
        device = device_of_rank()
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return rank


# -- what every rank knows of a failure ----------------------------------------------------------


class _Health:
    """This rank's view of the run: closing, or failed (its own failure or the first published)."""

    def __init__(self, store: Any, prefix: str, rank: int):
        self.store, self.prefix, self.rank = store, prefix, rank
        self.closing = False
        self.failure: dict[str, Any] | None = None

    def fail(self, report: dict[str, Any]) -> None:
        """Publish ``report`` unless a failure was published first; remember the first."""
        try:
            report = pickle.loads(self.store.compare_set(self.prefix + "failure", "", pickle.dumps(report)))
        except Exception as exc:  # noqa: BLE001 - the store is gone: this rank's own report stands
            log.debug("could not publish a failure: %s", exc)
        if self.failure is None:
            self.failure = report

    def lost(self, link: str, peer: int, exc: BaseException) -> None:
        """A link's thread ended with ``exc``: a failure of the peer, unless the run is over anyway."""
        if self.closing or self.failure is not None or isinstance(exc, Aborted):
            return
        self.fail(dict(stage=peer, sample=None, phase="running", died=True, traceback="",
                       message=f"rank {peer} is gone: rank {self.rank} on {socket.gethostname()} lost its {link} "
                               f"link to it ({type(exc).__name__}: {exc})"))

    def stage_failed(self, where: Where, exc: BaseException) -> None:
        """This rank's stage failed."""
        report = where.report(self.rank, exc)
        self.fail(dict(report, message=f"{report['message']} (rank {self.rank} on {socket.gethostname()})"))

    def poll(self) -> None:
        if self.failure is not None:
            return
        try:
            if self.store.check([self.prefix + "failure"]):
                self.failure = pickle.loads(self.store.get(self.prefix + "failure"))
        except Exception as exc:  # noqa: BLE001 - no store, no run
            self.failure = dict(stage=0, sample=None, phase="running", died=True, traceback="",
                                message=f"the process group's store is unreachable; it lives in rank 0 or "
                                        f"in torchrun's agent ({type(exc).__name__}: {exc})")

    def stop_check(self) -> None:
        """For the stage loop and the links: raise ``Aborted`` once the run fails or closes."""
        self.poll()
        if self.failure is not None or self.closing:
            raise Aborted

    def check(self) -> None:
        """For the caller: raise the run's failure, if there is one."""
        self.poll()
        if self.failure is not None:
            raise self.error()

    def error(self) -> StageError:
        report = dict(self.failure)
        kind = WorkerDiedError if report.pop("died", False) else StageError
        return kind(**report)


# -- links ---------------------------------------------------------------------------------------


class _Mailbox:
    """A FIFO between two threads of one rank, with room for ``capacity`` items (None: no limit)."""

    def __init__(self, capacity: int | None):
        self.capacity = capacity
        self._items: deque[Message] = deque()
        self._cond = threading.Condition()

    def put(self, item: Message, check: Callable[[], None] | None = None, *, force: bool = False) -> None:
        with self._cond:
            while not force and self.capacity is not None and len(self._items) >= self.capacity:
                if not self._cond.wait(POLL_S) and check is not None:
                    check()
            if item.kind == KIND_PERMIT and self._items and self._items[-1].kind == KIND_PERMIT:
                self._items[-1] = item  # permits only grow: the newest count says it all
            else:
                self._items.append(item)
            self._cond.notify_all()

    def get(self, check: Callable[[], None] | None = None, timeout: float | None = None) -> Message | None:
        """The oldest item; None once ``timeout`` has passed without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items:
                left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
                if left <= 0:
                    return None
                if not self._cond.wait(left) and check is not None:
                    check()
            item = self._items.popleft()
            self._cond.notify_all()
            return item


_HEADER = 3 * 8  # kind, index, scalar: float64
_ALIGN = 64  # where each tensor starts in a frame, so that any dtype can view it


def _frame_layout(specs: Sequence[TensorSpec], start: int) -> tuple[list[int], int]:
    """Where each tensor of ``specs`` starts in a frame whose first one starts at ``start``, and its size."""
    offsets, end = [], start
    for spec in specs:
        end = -(-end // _ALIGN) * _ALIGN
        offsets.append(end)
        end += spec.nbytes
    return offsets, end


class _Link:
    """One direction between two ranks, with ``put``/``get`` like ``transport.Channel``: a process
    group of its own and one thread at each end that sends (or receives) its messages in order.

    A message travels as bytes: a header ``(kind, index, scalar)`` and the tensors that ``payload``
    gives for its kind. On a link whose only payload is ``KIND_DATA``'s (activations, gradients,
    results, targets) header and tensors go as one frame of fixed size, one send per message; on
    the others (control, reply) the header goes alone, then the tensors, if the kind has any.
    ``put`` copies the tensors into the frame, so the caller keeps them; ``get`` hands out views
    of a frame of its own.
    """

    def __init__(self, name: str, group: Any, peer: int, sending: bool, payload: dict[int, tuple[TensorSpec, ...]],
                 device: torch.device, health: _Health, deliver: Callable[[Message], None] | None = None):
        self.name, self.group, self.peer, self.device, self.health = name, group, peer, device, health
        self.sending, self.payload = sending, payload
        self._to = dist.get_group_rank(group, peer)  # the process group's own calls: no per-call checks
        self._packed = set(payload) == {KIND_DATA}
        self._layouts = {kind: _frame_layout(specs, _HEADER if self._packed else 0) for kind, specs in payload.items()}
        self._hung_up = False
        self._box = _Mailbox(CAPACITY if sending else None)
        self._control = deliver is not None
        self._deliver = deliver or (lambda message: self._box.put(message))
        loop = self._send_loop if sending else self._receive_loop
        self._thread = threading.Thread(target=loop, name=f"partime {name}", daemon=True)
        self._thread.start()

    def put(self, kind: int, index: int, tensors: Sequence[Tensor] = (), scalar: float = 0.0, *,
            check: Callable[[], None] | None = None) -> None:
        specs = self.payload.get(kind, ())
        got = tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors)
        if got != specs:
            raise ValueError(f"link {self.name!r}: got tensors {[str(s) for s in got]} for a message of kind "
                             f"{kind}, but it carries {[str(s) for s in specs]}")
        self._box.put(Message(kind, index, scalar, self._frames(kind, index, scalar, tensors)), check)

    def get(self, *, check: Callable[[], None] | None = None) -> Message:
        return self._box.get(check)

    def _frames(self, kind: int, index: int, scalar: float, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """The message as the frames that go on the wire."""
        header = torch.tensor([kind, index, scalar], dtype=torch.float64)
        if not self._packed:
            header = (header.view(torch.uint8).to(self.device),)
            if not tensors:
                return header
        offsets, size = self._layouts[KIND_DATA if self._packed else kind]
        frame = torch.empty(size, dtype=torch.uint8, device=self.device)
        for t, at in zip(tensors, offsets):
            frame[at:at + t.nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
        if not self._packed:
            return header + (frame,)
        frame[:_HEADER].copy_(header.view(torch.uint8))
        return (frame,)

    def _tensors(self, kind: int, frame: Tensor) -> tuple[Tensor, ...]:
        """The tensors of a message of ``kind`` in ``frame``, as views."""
        specs = self.payload.get(kind, ())
        offsets = self._layouts[kind][0] if specs else ()
        return tuple(frame[at:at + s.nbytes].view(s.dtype).view(s.shape) for s, at in zip(specs, offsets))

    def hang_up(self) -> None:
        """Sending end: CLOSE goes after the messages already queued, and the thread ends (once)."""
        if not self._hung_up:
            self._hung_up = True
            self._box.put(Message(KIND_CLOSE, 0, 0.0, self._frames(KIND_CLOSE, 0, 0.0, ())), force=True)

    @property
    def thread(self) -> threading.Thread:
        """The thread of this end: it ends once both ends have hung up (or the link broke)."""
        return self._thread

    def _send_loop(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            ping = self._frames(KIND_PING, 0, 0.0, ())
            while True:
                message = self._box.get(timeout=PING_S) or Message(KIND_PING, 0, 0.0, ping)
                for frame in message.tensors:
                    self.group.send([frame], self._to, 0).wait()
                if message.kind == KIND_CLOSE:
                    return
        except BaseException as exc:  # noqa: BLE001 - the run's failure, seen from this link
            self.health.lost(self.name, self.peer, exc)

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
                kind, index, scalar = frame[:_HEADER].view(torch.float64).tolist()
                kind, index = int(kind), int(index)
                if kind == KIND_CLOSE:
                    if self._control:  # the other end of a control link needs to hear it
                        self._deliver(Message(kind, index, scalar, ()))
                    return
                if not self._packed and self.payload.get(kind):  # its tensors follow
                    frame = self._receive(self._layouts[kind][1])
                if kind != KIND_PING:
                    try:
                        self._deliver(Message(kind, index, scalar, self._tensors(kind, frame)))
                    except Aborted:  # the run is over: go on receiving, until the other end hangs up
                        pass
        except BaseException as exc:  # noqa: BLE001 - the run's failure, seen from this link
            self.health.lost(self.name, self.peer, exc)


class _Permits(threading.Semaphore):
    """The permits of a stage's ticks. ``transport.wait`` spins on non-blocking tries; here each
    one lets the other threads of the process run, since one of them grants the permits."""

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        if not blocking:
            time.sleep(0)  # releases the GIL
        return super().acquire(blocking, timeout)


# -- one pipeline's run, as every rank sees it ---------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """What rank 0 tells every rank at the first sample."""

    balance: tuple[int, ...]
    layout: Layout
    config: dict[str, Any]  # learning, supervised, grad_mode, compensation
    states: tuple[tuple[tuple[str, TensorSpec], ...], ...]  # every stage's state_dict: names and layouts


def _state_specs(module: nn.Module) -> tuple[tuple[str, TensorSpec], ...]:
    return tuple((k, TensorSpec(tuple(v.shape), v.dtype)) for k, v in module.state_dict().items())


def _config_key(config: StageConfig) -> dict[str, Any]:
    return dict(learning=config.learning, supervised=bool(config.supervised), grad_mode=config.grad_mode,
                compensation=tuple(config.compensation))


class _Run:
    """One pipeline's links and failure state on this rank. Every rank opens the same pipelines in
    the same order, so a count of them names each run's keys in the store."""

    count = 0

    def __init__(self, rank: int, depth: int):
        _Run.count += 1
        self.rank, self.depth = rank, depth
        self.prefix = f"partime/{_Run.count}/"
        self.store = dist.distributed_c10d._get_default_store()
        self.health = _Health(self.store, self.prefix, rank)
        self.device = device_of_rank()
        # Activations go over NCCL between GPUs where the process group has it, else over gloo.
        nccl = self.device.type == "cuda" and "nccl" in str(dist.get_backend())
        self.wire = self.device if nccl else torch.device("cpu")
        self.links: dict[str, _Link] = {}
        self.groups: list[Any] = []

    def wait_store(self, key: str, check: Callable[[], None], least: int | None = None) -> Any:
        """The value of ``key`` in the store, once it is there (with ``least``: once the counter
        under it reaches that), asking ``check`` every ``POLL_S``."""
        while True:
            if least is not None:
                if self.store.add(self.prefix + key, 0) >= least:
                    return None
            elif self.store.check([self.prefix + key]):
                return pickle.loads(self.store.get(self.prefix + key))
            check()
            time.sleep(POLL_S)

    def connect(self, plan: _Plan, control: Callable[[Message], None] | None = None) -> None:
        """Make every link's process group (on every rank, in one order) and start this rank's ends."""
        depth, layout = self.depth, plan.layout
        learning, supervised = plan.config["learning"], plan.config["supervised"]
        timeout = datetime.timedelta(seconds=LINK_TIMEOUT_S)
        acts = layout.activations
        wires = [(f"activation {i}->{i + 1}", i, i + 1, {KIND_DATA: acts[i].tensors}) for i in range(depth - 1)]
        if learning:
            wires += [(f"gradient {i + 1}->{i}", i + 1, i, {KIND_DATA: acts[i].tensors}) for i in range(depth - 1)]
        if depth > 1:
            wires.append(("result", depth - 1, 0, {KIND_DATA: layout.output.tensors}))
            if supervised:
                wires.append(("target", 0, depth - 1, {KIND_DATA: layout.target.tensors}))
        for r in range(1, depth):
            state = {KIND_STATE: tuple(spec for _, spec in plan.states[r])}
            wires += [(f"control 0->{r}", 0, r, state), (f"reply {r}->0", r, 0, state)]
        for name, src, dst, payload in wires:
            small = name.startswith(("control", "reply"))  # always gloo: on the CPU, beside NCCL
            group = dist.new_group([src, dst], timeout=timeout, backend="gloo" if small else None)
            self.groups.append(group)
            if self.rank in (src, dst):
                sending = self.rank == src
                self.links[name] = _Link(
                    name, group, dst if sending else src, sending, payload,
                    torch.device("cpu") if small else self.wire, self.health,
                    deliver=control if name.startswith("control") and not sending else None,
                )

    def link(self, name: str) -> _Link | None:
        return self.links.get(name)

    def close(self) -> None:
        """Hang up every link and wait for the other ends to hang up too, also after a failure:
        a thread still in a blocking receive when the process exits may abort the process."""
        for link in self.links.values():
            if link.sending:
                link.hang_up()
        start, threads = time.monotonic(), [link.thread for link in self.links.values()]
        while alive := [t for t in threads if t.is_alive()]:
            self.health.poll()
            limit = CLOSE_S if self.health.failure is None else FAILED_CLOSE_S
            if time.monotonic() - start > limit:
                log.warning("%d links were not hung up within %.0f s: leaving them", len(alive), limit)
                break
            alive[0].join(POLL_S)
        if not alive and self.health.failure is None:
            for group in self.groups:
                if group != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(group)
        self.links, self.groups = {}, []


def _local(specs: Sequence[TensorSpec], capacity: int, name: str) -> Channel:
    """A ``transport.Channel`` between two threads of rank 0 (threads share the GIL: no spinning)."""
    return Channel(SimpleNamespace(Semaphore=threading.Semaphore), specs, capacity, name=name, spin_s=0)


# -- the executor, on rank 0 ---------------------------------------------------------------------


class DistributedExecutor(Executor):
    """Rank 0's part: stage 0 in a thread, and the caller's links to every rank (module docstring).

    ``Pipeline`` asks the class which rank it is on (``rank``); on ranks > 0 it calls ``serve``
    in ``open``, and on rank 0 ``cancel`` if it closes before its first sample.
    """

    rank = staticmethod(join_group)

    def start(self, layout: Layout) -> None:
        depth, config = self.depth, self.config
        self._run = run = _Run(0, depth)
        self._layout = layout
        self._names = [[k for k, _ in _state_specs(s)] for s in self.stages]
        self._offered = self._fed = self._seen = self._synced = 0
        plan = _Plan(tuple(len(s) for s in self.stages), layout, _config_key(config),
                     tuple(_state_specs(s) for s in self.stages))
        run.store.set(run.prefix + "plan", pickle.dumps(plan))
        run.wait_store("ready", run.health.check, least=depth - 1)  # every rank took the plan
        run.connect(plan)
        for r in range(1, depth):  # every rank starts with rank 0's weights
            run.link(f"control 0->{r}").put(KIND_STATE, 0, list(self.stages[r].state_dict().values()),
                                            check=run.health.check)
        last = depth == 1
        self._inputs = _local(layout.input.tensors, CAPACITY, "input")
        self._results = run.link("result") or _local(layout.output.tensors, CAPACITY, "result")
        self._targets = None
        if layout.target is not None:
            self._targets = run.link("target") or _local(layout.target.tensors, depth + 1 + LOOKAHEAD, "target")
        self._permits, self._ticks = _Permits(0), threading.Semaphore(0)
        links = Links(
            index=0, layout=layout, act_in=self._inputs, act_out=run.link("activation 0->1"),
            grad_in=run.link("gradient 1->0"), targets=self._targets if last else None,
            results=self._results if last else None, permits=self._permits, ticks=self._ticks,
        )
        self._threads_before = torch.get_num_threads()
        self._thread = threading.Thread(target=self._stage_zero, args=(links,), name="partime stage 0", daemon=True)
        self._thread.start()

    def _stage_zero(self, links: Links) -> None:
        health, where = self._run.health, Where()
        try:
            torch.set_num_threads(self.threads)
            stage = Stage(0, self.stages[0], self.config, self._run.device)
            while True:
                run_segment(stage, links, health.stop_check, where)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the caller as data
            health.stage_failed(where, exc)

    def feed(self, index: int, x: Any, y: Any) -> None:
        check = self._run.health.check
        self._inputs.put(KIND_DATA, index, as_tensors(x, "sample"), check=check)
        if self._targets is not None:
            self._targets.put(KIND_DATA, index, as_tensors(y, "target"), check=check)
        self._offer(1)
        self._fed += 1

    def end(self) -> None:
        self._inputs.put(KIND_END, self._fed, check=self._run.health.check)
        self._offer(schedule.segment_ticks(self._fed, self.depth, self.config.learning) - self._fed)
        self._fed = 0

    def _offer(self, ticks: int) -> None:
        """Let every stage run ``ticks`` more ticks."""
        if ticks <= 0:
            return
        self._permits.release(ticks)
        self._offered += ticks
        for r in range(1, self.depth):
            self._run.link(f"control 0->{r}").put(KIND_PERMIT, self._offered, check=self._run.health.check)

    def next_result(self) -> Result:
        message = self._results.get(check=self._run.health.check)
        output = rebuild(self._layout.output, message.tensors)
        return Result(message.index, output, message.scalar if self.config.learning else None)

    def sync(self) -> None:
        """Wait until every stage has run every tick offered, and fetch the weights of ranks > 0."""
        run, check = self._run, self._run.health.check
        if self._synced == self._offered:
            return
        for r in range(1, self.depth):
            run.link(f"control 0->{r}").put(KIND_SNAPSHOT, self._offered, check=check)
        while self._seen < self._offered:
            wait(self._ticks, check, spin_s=0)
            self._seen += 1
        for r in range(1, self.depth):
            message = run.link(f"reply {r}->0").get(check=check)
            assert message.kind == KIND_STATE and message.index == self._offered, (message.kind, message.index)
            self.stages[r].load_state_dict(dict(zip(self._names[r], message.tensors)))
        self._synced = self._offered

    def close(self) -> None:
        run, self._run = getattr(self, "_run", None), None
        if run is None:
            return
        run.health.closing = True  # stage 0 leaves at its next wait
        for r in range(1, self.depth):
            if f"control 0->{r}" in run.links:
                run.links[f"control 0->{r}"].hang_up()  # rank r leaves at its next wait
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(CLOSE_S)
            torch.set_num_threads(self._threads_before)
        run.close()

    @staticmethod
    def cancel(failure: str | None) -> None:
        """Rank 0 closes before its first sample: the other ranks stop waiting for it."""
        run = _Run(0, 0)
        run.store.set(run.prefix + "plan", pickle.dumps(failure))

    @staticmethod
    def serve(rank: int, model: nn.Sequential, config: StageConfig, threads: int) -> None:
        """Ranks > 0: run stage ``rank`` of the pipeline rank 0 starts, until rank 0 closes it.

        Returns at once if rank 0 closes the pipeline before its first sample; raises the run's
        failure (a ``StageError``) if any rank fails.
        """
        run = _Run(rank, config.depth)
        health = run.health
        plan = run.wait_store("plan", health.check)
        if not isinstance(plan, _Plan):
            if plan is not None:
                raise PipelineClosedError(f"rank 0 stopped before its first sample: {plan}")
            return
        try:
            check_balance(model, plan.balance)
            module = split(model, plan.balance)[rank]
            _check_plan(plan, rank, module, config)
        except ValueError as exc:
            health.fail(dict(stage=rank, sample=None, phase="start", message=str(exc), traceback=""))
            raise
        run.store.add(run.prefix + "ready", 1)
        config = replace(config, supervised=plan.config["supervised"])
        loaded, permits, ticks = threading.Event(), _Permits(0), threading.Semaphore(0)
        granted = done = 0

        def control(message: Message) -> None:  # in the thread that receives rank 0's control link
            nonlocal granted, done
            if message.kind == KIND_STATE:
                module.load_state_dict(dict(zip((k for k, _ in plan.states[rank]), message.tensors)))
                loaded.set()
            elif message.kind == KIND_PERMIT and message.index > granted:
                permits.release(message.index - granted)
                granted = message.index
            elif message.kind == KIND_SNAPSHOT:
                while done < message.index:
                    wait(ticks, health.stop_check, spin_s=0)
                    done += 1
                run.link(f"reply {rank}->0").put(KIND_STATE, message.index, list(module.state_dict().values()),
                                                 check=health.stop_check)
            elif message.kind == KIND_CLOSE:
                health.closing = True

        before, where = torch.get_num_threads(), Where()
        try:
            run.connect(plan, control)
            while not loaded.wait(POLL_S):
                health.stop_check()
            torch.set_num_threads(threads)
            last = rank == config.depth - 1
            links = Links(
                index=rank, layout=plan.layout, act_in=run.link(f"activation {rank - 1}->{rank}"),
                act_out=run.link(f"activation {rank}->{rank + 1}"), grad_in=run.link(f"gradient {rank + 1}->{rank}"),
                grad_out=run.link(f"gradient {rank}->{rank - 1}"), targets=run.link("target") if last else None,
                results=run.link("result") if last else None, permits=permits, ticks=ticks,
            )
            stage = Stage(rank, module, config, run.device)
            while True:
                run_segment(stage, links, health.stop_check, where)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - published, then raised below
            health.stage_failed(where, exc)
        finally:
            torch.set_num_threads(before)
            run.close()
        if health.failure is not None:
            raise health.error()


def _check_plan(plan: _Plan, rank: int, module: nn.Module, config: StageConfig) -> None:
    """A ValueError unless this rank was given the pipeline rank 0 was given."""
    ours, theirs = _config_key(config), dict(plan.config)
    ours.pop("supervised"), theirs.pop("supervised")  # rank 0 alone sees the targets
    if ours != theirs:
        raise ValueError(f"rank {rank} was given another pipeline than rank 0: {ours} on rank {rank}, "
                         f"{theirs} on rank 0")
    if _state_specs(module) != plan.states[rank]:
        ours, theirs = ([f"{k} {s}" for k, s in specs] for specs in (_state_specs(module), plan.states[rank]))
        raise ValueError(f"stage {rank} of the model differs between rank {rank} and rank 0: {ours} on rank {rank}, "
                         f"{theirs} on rank 0")


# -- figures (run on every rank, under torchrun) --------------------------------------------------


def measure_link_hop(nbytes: int = 65536, rounds: int = 1000) -> dict[str, float] | None:
    """The cost of one hop of a float32 tensor of ``nbytes`` between ranks 0 and 1: over a bare
    gloo ``send``/``recv``, and over this executor's links (queues, threads, a frame with a header).

    Every rank calls it (it makes process groups); rank 0 gets ``hop_us_median`` (links) and
    ``raw_hop_us_median`` (bare) in microseconds, each half the median round trip after as many
    warm-up rounds (at most 100); the other ranks get None.
    """
    if nbytes < 4 or nbytes % 4:
        raise ValueError(f"nbytes must be a positive multiple of 4 (float32), got {nbytes}")
    rank = join_group()
    if dist.get_world_size() < 2:
        return None
    run = _Run(rank, dist.get_world_size())
    timeout = datetime.timedelta(seconds=LINK_TIMEOUT_S)
    run.groups = [dist.new_group([0, 1], timeout=timeout, backend="gloo") for _ in range(3)]
    if rank > 1:
        run.close()
        return None
    peer, cpu, payload = 1 - rank, torch.device("cpu"), {KIND_DATA: (TensorSpec((nbytes // 4,), torch.float32),)}
    there = _Link("hop 0->1", run.groups[1], peer, rank == 0, payload, cpu, run.health)
    back = _Link("hop 1->0", run.groups[2], peer, rank == 1, payload, cpu, run.health)
    run.links = {"there": there, "back": back}
    x, check = torch.randn(nbytes // 4), run.health.check

    def raw() -> None:
        if rank == 0:
            dist.send(x, 1, group=run.groups[0])
            dist.recv(x, 1, group=run.groups[0])
        else:
            dist.recv(x, 0, group=run.groups[0])
            dist.send(x, 0, group=run.groups[0])

    def linked() -> None:
        if rank == 0:
            there.put(KIND_DATA, 0, (x,), check=check)
            back.get(check=check)
        else:
            back.put(KIND_DATA, 0, there.get(check=check).tensors, check=check)

    figures = {}
    for name, one in (("raw_hop_us_median", raw), ("hop_us_median", linked)):
        hops = []
        for i in range(min(rounds, 100) + rounds):
            t0 = time.perf_counter()
            one()
            hops.append((time.perf_counter() - t0) / 2)
        figures[name] = sorted(hops[-rounds:])[rounds // 2] * 1e6
    run.close()
    return figures if rank == 0 else None


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def bench_distributed(samples: int = 300, size: int = 32, layers: int = 12, *, channels: int = 32,
                      modes: Sequence[str] = ("inference", "learning"), warmup: int = 20, blocks: int = 5,
                      seed: int = 0, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]] | None:
    """``partime.bench.run_bench`` for this executor: every rank calls it, under torchrun.

    With D ranks, one row per mode for the sequential baselines (rank 0 alone, one thread and
    every core) and one for ``Pipeline(model, D, executor="distributed")``, keyed as
    ``run_bench``'s rows are, with the hop costs of this executor's links (``hop_64kb_us``,
    ``hop_activation_us``) and of a bare gloo send/recv (``hop_64kb_raw_us``) between ranks 0
    and 1. Rank 0 gets the rows; the other ranks serve their stages and get None.
    """
    from ..bench import CLASSES, _time_pipeline, _time_sequential, conv_net, cpu_clocks, others_busy, sgd
    from ..pipeline import Pipeline

    rank = join_group()
    depth, cores = dist.get_world_size(), os.cpu_count() or 1
    store, call = dist.distributed_c10d._get_default_store(), _Run.count  # the same on every rank
    report = progress if progress is not None and rank == 0 else (lambda label: None)
    report("hop cost")
    activation_bytes = channels * size * size * 4
    nan = dict(hop_us_median=float("nan"), raw_hop_us_median=float("nan"))  # one rank: no hop
    hop_64kb, hop_activation = (measure_link_hop(n) or nan for n in (65536, activation_bytes))
    gen = torch.Generator().manual_seed(seed)
    total = warmup + samples + depth
    xs = torch.randn(total, 1, 3, size, size, generator=gen)
    ys = torch.randint(0, CLASSES, (total, 1), generator=gen)
    timing = dict(samples=samples, warmup=warmup, blocks=blocks)
    rows: list[dict[str, Any]] = []
    for mode in modes:
        learning = mode == "learning"
        model = conv_net(layers, channels, classes=CLASSES if learning else None, seed=seed)
        if rank > 0:  # serve this rank's stage while rank 0 times the baselines and the pipeline
            kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=sgd) if learning else {}
            cpu = _cpu_seconds()
            with Pipeline(model, depth, executor="distributed", threads=1, **kw):
                pass
            store.set(f"partime/bench/{call}/{mode}/cpu/{rank}", repr(_cpu_seconds() - cpu))
            continue
        base, first = {}, len(rows)
        for threads in sorted({1, cores}):
            report(f"{mode}: sequential, {threads} thread{'s' if threads > 1 else ''}")
            clocks = cpu_clocks()  # the other ranks wait meanwhile: what they use is others' work
            base[threads] = _time_sequential(copy.deepcopy(model), xs, ys if learning else None, threads, **timing)
            rows.append(dict(mode=mode, depth=0, executor=f"sequential ({threads} thr)", threads=threads,
                             ms_per_sample=base[threads], others_busy=others_busy(clocks, cores)))
        report(f"{mode}: D={depth}, distributed")
        clocks = cpu_clocks()
        ms, partition = _time_pipeline(copy.deepcopy(model), depth, "distributed", xs, ys if learning else None,
                                       **timing)
        busy = others_busy(clocks, cores)
        if busy is not None and os.environ.get("LOCAL_WORLD_SIZE") == str(depth):  # one host: take the ranks out
            keys = [f"partime/bench/{call}/{mode}/cpu/{r}" for r in range(1, depth)]
            store.wait(keys)
            ranks_cpu = sum(float(store.get(k)) for k in keys)
            busy = max(0.0, busy - ranks_cpu / ((cpu_clocks()[0] - clocks[0]) * cores))
        else:
            busy = None
        times = partition.stage_times or ()
        rows.append(dict(mode=mode, depth=depth, executor="distributed", threads=1, ms_per_sample=ms,
                         others_busy=busy, partition=str(partition), balance=list(partition.balance),
                         stage_ms=[t * 1e3 for t in times], max_stage_ms=max(times, default=float("nan")) * 1e3))
        for row in rows[first:]:
            row.update(speedup_vs_seq_1thread=base[1] / row["ms_per_sample"],
                       speedup_vs_seq_allcores=base[cores] / row["ms_per_sample"], samples=samples, size=size,
                       layers=layers, channels=channels, activation_bytes=activation_bytes,
                       hop_64kb_us=hop_64kb["hop_us_median"], hop_64kb_raw_us=hop_64kb["raw_hop_us_median"],
                       hop_activation_us=hop_activation["hop_us_median"])
    return rows if rank == 0 else None

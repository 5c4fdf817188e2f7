"""What every rank of one pipeline shares: the process group, the links, the failure.

Every rank runs the same script under ``torchrun`` and opens the same pipelines in the same order,
so a count of them names each run's keys in the default process group's store, and every rank
makes the run's process groups (one per link, ``link.py``) in one order.

Failures: a stage that fails, or a rank that sees a link break, publishes the failure (stage,
sample, phase, traceback) in the store, where the first one wins. Every rank looks there whenever
a wait has lasted ``POLL_S`` and stops with that failure as a ``StageError`` (a ``WorkerDiedError``
for a rank that vanished): within a fraction of a second, not at a timeout. A rank whose process
dies closes its sockets, which breaks its neighbours' links at once. A blocking receive cannot be
interrupted, so every rank, failed or not, hangs up all its links when it stops and waits
(``FAILED_CLOSE_S`` at most after a failure) for the other ends to hang up too: a thread still
blocked in gloo when the interpreter exits aborts the process.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...core.boundary_values import TensorSpec
from ...errors import StageError, WorkerDiedError
from ..messages import Message
from ..waiting import POLL_S, Aborted
from ..worker_loop import Where
from .link import LINK_TIMEOUT_S, RankLink

log = logging.getLogger(__name__)

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


class Health:
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
        self.fail(
            dict(
                stage=peer,
                sample=None,
                phase="running",
                died=True,
                traceback="",
                message=f"rank {peer} is gone: rank {self.rank} on {socket.gethostname()} lost its {link} "
                f"link to it ({type(exc).__name__}: {exc})",
            )
        )

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
            self.failure = dict(
                stage=0,
                sample=None,
                phase="running",
                died=True,
                traceback="",
                message=f"the process group's store is unreachable; it lives in rank 0 or "
                f"in torchrun's agent ({type(exc).__name__}: {exc})",
            )

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
        """The run's failure as an exception; only once there is one."""
        if self.failure is None:
            raise RuntimeError(f"rank {self.rank} asked for the run's failure, but the run has not failed")
        report = dict(self.failure)
        kind = WorkerDiedError if report.pop("died", False) else StageError
        return kind(**report)


@dataclass(frozen=True)
class Wire:
    """A link to make: its name, the ranks at its ends, and the tensors each kind of message carries."""

    name: str
    src: int
    dst: int
    payload: dict[int, tuple[TensorSpec, ...]]


class Run:
    """One pipeline's links and failure state on this rank. Every rank opens the same pipelines in
    the same order, so a count of them names each run's keys in the store."""

    count = 0

    def __init__(self, rank: int, depth: int):
        Run.count += 1
        self.rank, self.depth = rank, depth
        self.prefix = f"partime/{Run.count}/"
        self.store = dist.distributed_c10d._get_default_store()
        self.health = Health(self.store, self.prefix, rank)
        self.device = device_of_rank()
        # Activations go over NCCL between GPUs where the process group has it, else over gloo.
        nccl = self.device.type == "cuda" and "nccl" in str(dist.get_backend())
        self.wire = self.device if nccl else torch.device("cpu")
        self.links: dict[str, RankLink] = {}
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

    def publish(self, key: str, value: bytes) -> None:
        """Put ``value`` under ``key`` in the store, for ``wait_store`` on the other ranks."""
        # torch's stub types Store.set's value as str; the binding takes bytes too (a std::string).
        self.store.set(self.prefix + key, value)  # type: ignore[arg-type]

    def connect(self, wires: Sequence[Wire], control: Callable[[Message], None] | None = None) -> None:
        """Make every wire's process group (every rank, in the order of ``wires``) and start this
        rank's ends of them; ``control`` takes the messages of a receiving end named ``control …``."""
        timeout = datetime.timedelta(seconds=LINK_TIMEOUT_S)
        for wire in wires:
            small = wire.name.startswith(("control", "reply"))  # always gloo: on the CPU, beside NCCL
            group = dist.new_group([wire.src, wire.dst], timeout=timeout, backend="gloo" if small else None)
            self.groups.append(group)
            if self.rank in (wire.src, wire.dst):
                sending = self.rank == wire.src
                self.links[wire.name] = RankLink(
                    wire.name,
                    group,
                    wire.dst if sending else wire.src,
                    sending,
                    wire.payload,
                    torch.device("cpu") if small else self.wire,
                    self.health.lost,
                    deliver=control if wire.name.startswith("control") and not sending else None,
                )

    def link(self, name: str) -> RankLink | None:
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

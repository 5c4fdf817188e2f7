"""What a user would run instead of a pipeline for inference: D replicas of the model, for ``partime bench``.

``Replicas(model, copies, sample)`` starts ``copies`` worker processes (``torch.multiprocessing``,
``spawn``), each with its own copy of the model (by cloudpickle). ``stream`` deals the frames
round-robin and takes the results back in the same order, so they leave in sample order::

    caller:  put x0 → w0   put x1 → w1   put x2 → w0   put x3 → w1   get y0 ← w0   put x4 → w0   get y1 ← w1 …
    w0:                    y0 = model(x0) ........ y2 = model(x2) ........ y4 = model(x4)
    w1:                                  y1 = model(x1) ........ y3 = model(x3) ……

Every worker holds up to ``in_flight`` frames (one running, the next waiting), so it never waits
for the caller. Frames and results travel through ``shared_memory.Channel`` rings whose semaphores
(``semaphore.SharedSemaphore``) are unlinked once every worker holds them. A worker is a plain
loop; a failure comes back as data (its sample and traceback) and the caller raises it as one
``ReplicaError``. Leaving the ``with`` block stops and joins every worker, also on an error.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from collections.abc import Iterable, Iterator
from types import SimpleNamespace, TracebackType
from typing import TYPE_CHECKING, Any

import cloudpickle
import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

from partime.internals import KIND_DATA, POLL_S, Aborted, Channel, Flag, SharedSemaphore, TensorSpec, keep_freed_memory

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

TIMEOUT_S = 300.0
"""How long a worker may take to answer a frame, by default (as ``Pipeline``'s default timeout)."""

START_S = 300.0
"""How long a worker may take to start (to import torch and load its model)."""

JOIN_S = 10.0
"""How long a stopping worker may take to leave (it notices the stop within ``POLL_S``, once its
current forward returns) before it is terminated."""

_SHARED = SimpleNamespace(Semaphore=SharedSemaphore)  # what the channels make their semaphores with


class ReplicaError(RuntimeError):
    """A replica failed or ended early; names the replica, the sample and the original traceback."""


def _serve(
    index: int, model_bytes: bytes, threads: int, inbox: Channel, outbox: Channel, stop: Flag, report: Any
) -> None:
    """Worker ``index``: answer every frame of ``inbox`` with the model's output on ``outbox``,
    until ``stop`` is set or the caller is gone. ``report`` gets ``("ready",)``, or
    ``("failed", sample, traceback)``."""
    parent = mp.parent_process()

    def check() -> None:
        if stop.is_set() or (parent is not None and not parent.is_alive()):
            raise Aborted("the replicas are stopping")

    sample = None
    try:
        torch.set_num_threads(threads)
        keep_freed_memory()  # as partime's own stage processes do: the same allocator for every contender
        model = cloudpickle.loads(model_bytes)
        report.send(("ready",))
        with torch.no_grad():
            while True:
                msg = inbox.get(check=check)
                if msg.kind != KIND_DATA:
                    return
                sample = msg.index
                outbox.put(KIND_DATA, msg.index, (model(*msg.tensors),), check=check)
    except Aborted:
        return
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller as data
        report.send(("failed", sample, traceback.format_exc()))
    finally:
        report.close()


class Replicas:
    """``copies`` copies of ``model`` in as many worker processes, each with ``threads`` torch threads.

    ``sample`` is a frame as ``stream`` will get them (one tensor); every frame must have its
    shape and dtype, and the model must return one tensor. The workers start on entering the
    ``with`` block (once each has its model) and are stopped and joined on leaving it. A worker
    that takes longer than ``START_S`` to start, or than ``timeout`` seconds to answer a frame, is
    a ``ReplicaError``.
    """

    def __init__(
        self,
        model: nn.Module,
        copies: int,
        sample: Tensor,
        *,
        threads: int = 1,
        in_flight: int = 2,
        timeout: float = TIMEOUT_S,
    ):
        if copies < 1 or in_flight < 1 or timeout <= 0:
            raise ValueError(
                f"need copies >= 1, in_flight >= 1 and timeout > 0, got copies={copies}, in_flight={in_flight}, "
                f"timeout={timeout}"
            )
        if not isinstance(sample, Tensor):
            raise TypeError(f"sample must be one tensor, got {type(sample).__name__}")
        with torch.no_grad():
            output = model(sample)
        if not isinstance(output, Tensor):
            raise TypeError(f"the model must return one tensor, it returned a {type(output).__name__}")
        self.copies, self.in_flight, self.timeout = copies, in_flight, timeout
        self._model_bytes = cloudpickle.dumps(model)
        self._threads = threads
        frame, result = TensorSpec(tuple(sample.shape), sample.dtype), TensorSpec(tuple(output.shape), output.dtype)
        self._inboxes = [Channel(_SHARED, [frame], in_flight, name=f"frames to replica {k}") for k in range(copies)]
        self._outboxes = [Channel(_SHARED, [result], in_flight, name=f"results of replica {k}") for k in range(copies)]
        self._stop = Flag()
        self._workers: list[Any] = []
        self._reports: list[Any] = []
        self._failure: ReplicaError | None = None

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        for k in range(self.copies):
            reader, writer = ctx.Pipe(duplex=False)
            args = (k, self._model_bytes, self._threads, self._inboxes[k], self._outboxes[k], self._stop, writer)
            worker = ctx.Process(target=_serve, args=args, name=f"partime-replica-{k}", daemon=True)
            worker.start()
            writer.close()  # the worker holds the writing end now
            self._workers.append(worker)
            self._reports.append(reader)
        ready, deadline = [False] * self.copies, time.monotonic() + START_S
        while not all(ready):
            k = ready.index(False)
            if self._reports[k].poll(POLL_S):
                ready[k] = self._reports[k].recv() == ("ready",)
                if not ready[k]:
                    raise self._failed(k)
            elif not self._workers[k].is_alive():
                raise self._failed(k)
            elif time.monotonic() > deadline:
                raise ReplicaError(f"replica {k} did not start within {START_S:g} s")
        self._unlink()

    def _unlink(self) -> None:
        for channel in self._inboxes + self._outboxes:
            channel.unlink()

    def close(self) -> None:
        """Stop and join every worker (terminating one that does not leave within ``JOIN_S``)."""
        self._stop.set()
        for worker in self._workers:
            worker.join(JOIN_S)
            if worker.is_alive():
                log.warning("%s did not stop within %.0f s; terminating it", worker.name, JOIN_S)
                worker.terminate()
                worker.join()
        for reader in self._reports:
            reader.close()
        self._workers, self._reports = [], []
        self._unlink()

    def stream(self, frames: Iterable[Tensor]) -> Iterator[Tensor]:
        """The model's output for every frame of ``frames``, in order (frame i goes to replica
        i mod ``copies``). Frames are pulled ahead of the results, up to ``copies * in_flight``;
        a ``break`` out of the loop drops the results still in flight, so the next stream starts
        empty. A failed replica raises ``ReplicaError``, and then the replicas can only be closed.
        """
        if len(self._workers) != self.copies:
            raise RuntimeError("the replicas are not running: use them inside a `with` block")
        pending: deque[int] = deque()
        try:
            for i, frame in enumerate(frames):
                self._check()
                self._inboxes[i % self.copies].put(KIND_DATA, i, (frame,), check=self._check)
                pending.append(i)
                if len(pending) == self.copies * self.in_flight:
                    yield self._take(pending.popleft())
            while pending:
                yield self._take(pending.popleft())
        finally:
            while pending and self._failure is None:
                self._take(pending.popleft())

    def _take(self, index: int) -> Tensor:
        deadline = time.monotonic() + self.timeout

        def check() -> None:
            self._check()
            if time.monotonic() > deadline:
                self._failure = ReplicaError(
                    f"replica {index % self.copies} gave no result for sample {index} within {self.timeout:g} s"
                )
                raise self._failure

        msg = self._outboxes[index % self.copies].get(check=check)
        if msg.index != index:
            raise RuntimeError(f"replica {index % self.copies} answered sample {msg.index}, expected {index}")
        return msg.tensors[0]

    def _check(self) -> None:
        """Raise the failure of a replica that failed or ended (also one found before)."""
        if self._failure is None:
            for k, worker in enumerate(self._workers):
                if self._reports[k].poll() or not worker.is_alive():
                    self._failure = self._failed(k)
                    break
        if self._failure is not None:
            raise self._failure

    def _failed(self, k: int) -> ReplicaError:
        report = self._reports[k].recv() if self._reports[k].poll(POLL_S) else None
        if report is not None and report[0] == "failed":
            _, sample, text = report
            where = f"replica {k}" + ("" if sample is None else f", sample {sample}")
            return ReplicaError(f"{where} failed\n\nOriginal traceback (in the replica):\n{text.rstrip()}")
        worker = self._workers[k]
        worker.join(POLL_S)
        return ReplicaError(f"replica {k} ended early (exit code {worker.exitcode})")

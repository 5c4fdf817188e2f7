"""The Python floor: the simplest Python pipeline that does the work of partime's default, a speed to beat.

``PythonFloor(model, balance, sample, optimizer=...)`` cuts an ``nn.Sequential`` into stages
``model[a:b]`` of ``balance``: stage D - 1 runs in the caller, every other stage in a process of
its own (``torch.multiprocessing``, spawn), each with one torch thread. Activations go forward,
and gradients back, through rings of preallocated shared-memory tensors (``share_memory_()``),
each slot guarded by semaphores. At tick t stage i forwards sample t - i (SPEC.md); learning, the
last stage computes the cross-entropy of its sample, its backward and its optimizer's step, and
sends the gradient of its input back; stage i < D - 1 keeps the autograd graph of each forward
(by sample number) and, when the gradient of a sample comes back 2 (D - 1 - i) ticks later, runs
that graph back with the weights it has now (as partime's ``graph-stash``) and steps. No
compensation, no checks. ``stream`` yields the output of each sample (inference, under
``inference_mode``) or its loss (learning), in order. ``close()`` (or leaving the ``with``
block) stops and joins every worker.

It is loaded by path by ``partime bench --sizes`` (``partime_tools.bench.floor``), which times it
beside partime's pipelines on the same cut.
"""

from __future__ import annotations

import copy
import itertools
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp
from torch import Tensor, nn

if TYPE_CHECKING:
    from typing_extensions import Self

SLOTS = 2
"""Slots per ring: a stage may put its next value while the one before is still being read."""

SPIN_S = 100e-6
"""How long a wait spins (non-blocking acquires and ``sched_yield``) before it blocks."""

POLL_S = 0.05
"""How often a blocked wait checks that the pipeline is not stopping and its peers still run."""

END = -1
"""The sample number that ends a stream."""


class Stopped(Exception):
    """The floor is closing, or a peer is gone."""


def acquire(semaphore: Any, check: Callable[[], None]) -> None:
    """``semaphore.acquire()``: spinning for ``SPIN_S``, then blocking, calling ``check`` every ``POLL_S``."""
    deadline = time.perf_counter() + SPIN_S
    while time.perf_counter() < deadline:
        if semaphore.acquire(False):
            return
        os.sched_yield()
    while not semaphore.acquire(timeout=POLL_S):
        check()


class Ring:
    """Values of one shape from one producer to one consumer, through ``SLOTS`` shared tensors."""

    def __init__(self, ctx: Any, shape: Sequence[int]):
        self.slots = [torch.zeros(shape).share_memory_() for _ in range(SLOTS)]
        self.samples = torch.zeros(SLOTS, dtype=torch.int64).share_memory_()
        self.free, self.full = ctx.Semaphore(SLOTS), ctx.Semaphore(0)
        self.put_at = self.taken_at = 0  # the producer's and the consumer's own counts

    def put(self, sample: int, value: Tensor | None, check: Callable[[], None]) -> None:
        acquire(self.free, check)
        slot = self.put_at % SLOTS
        if value is not None:
            self.slots[slot].copy_(value)
        self.samples[slot] = sample
        self.put_at += 1
        self.full.release()

    def take(self, check: Callable[[], None]) -> tuple[int, Tensor]:
        """The next sample number and its slot, which is the consumer's until ``release()``."""
        acquire(self.full, check)
        slot = self.taken_at % SLOTS
        return int(self.samples[slot]), self.slots[slot]

    def release(self) -> None:
        self.taken_at += 1
        self.free.release()


def work(
    stage: nn.Module,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None,
    delay: int,
    inputs: Ring,
    outputs: Ring,
    grads_in: Ring | None,
    grads_out: Ring | None,
    done: Any,
    stop: Tensor,
) -> None:
    """A stage before the last, in its own process: forward each input; learning, keep its graph and
    run back the gradient that comes ``delay`` ticks later. At the end of a stream, send the end
    on, run back the gradients still to come, and release ``done``."""
    torch.set_num_threads(1)
    stage = copy.deepcopy(stage)  # its own memory, not the pages shared with the caller
    step = None if optimizer is None else optimizer(stage.parameters())
    parent = mp.parent_process()
    kept: dict[int, tuple[Tensor, Tensor]] = {}  # sample -> (its input, its output): the graph between them

    def check() -> None:
        if stop[0] or (parent is not None and not parent.is_alive()):
            raise Stopped

    def backward() -> None:
        assert step is not None and grads_in is not None
        sample, grad = grads_in.take(check)
        x, out = kept.pop(sample)
        step.zero_grad()
        out.backward(grad)
        grads_in.release()
        if grads_out is not None:
            grads_out.put(sample, x.grad, check)
        step.step()

    try:
        while True:
            sample, slot = inputs.take(check)
            if sample == END:
                inputs.release()
                outputs.put(END, None, check)
                while kept:
                    backward()
                done.release()
            elif step is None:
                with torch.inference_mode():
                    out = stage(slot)
                inputs.release()
                outputs.put(sample, out, check)
            else:
                x = slot.clone().requires_grad_(grads_out is not None)
                inputs.release()
                # The steps between this forward and its backward change the weights in place, and
                # autograd refuses a graph whose saved tensors changed: these hooks let them through,
                # so the product reads the weights as they are then (as partime's graph-stash).
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    out = stage(x)
                kept[sample] = x, out
                outputs.put(sample, out.detach(), check)
                if len(kept) > delay:
                    backward()
    except Stopped:
        return


class PythonFloor:
    """``model`` (an ``nn.Sequential``) cut by ``balance`` into a pipeline of ``len(balance)`` >= 2
    stages: see the module. ``sample`` is an input as ``stream`` gets them; with ``optimizer``
    (a factory of parameters) the pipeline learns with cross-entropy, else it infers. The workers
    start here; ``close()`` stops them."""

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int],
        sample: Tensor,
        optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    ):
        if len(balance) < 2 or sum(balance) != len(model):
            raise ValueError(f"need 2 stages or more of the model's {len(model)} layers, got balance {list(balance)}")
        bounds = [sum(balance[:i]) for i in range(len(balance) + 1)]
        stages = [model[a:b] for a, b in itertools.pairwise(bounds)]
        self.depth, learning = len(stages), optimizer is not None
        shapes = [sample.shape]
        with torch.no_grad():
            for stage in stages[:-1]:
                shapes.append(stage(torch.zeros(shapes[-1])).shape)
        ctx = mp.get_context("spawn")
        rings = [Ring(ctx, shape) for shape in shapes]  # ring i: the input of stage i
        grads = [Ring(ctx, shape) for shape in shapes[1:]] if learning else []  # ring i: back to stage i
        self.stop = torch.zeros(1, dtype=torch.bool).share_memory_()
        self.done = [ctx.Semaphore(0) for _ in stages[:-1]]
        self.workers = []
        # A worker imports this file by its name (``work`` is pickled by reference), and spawn gives
        # it the caller's sys.path: loaded by path, the file's folder is on it while they start.
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        try:
            for i, stage in enumerate(stages[:-1]):
                back = (grads[i], grads[i - 1] if i > 0 else None) if learning else (None, None)
                delay = 2 * (self.depth - 1 - i)
                # a copy: sending a module moves its tensors into shared memory, and the caller's stay put
                args = (copy.deepcopy(stage), optimizer, delay, rings[i], rings[i + 1], *back, self.done[i], self.stop)
                worker = ctx.Process(target=work, args=args, daemon=True)
                worker.start()
                self.workers.append(worker)
        except BaseException:
            self.close()
            raise
        finally:
            sys.path.remove(str(Path(__file__).resolve().parent))
        # held to the close: a ring's semaphores are unlinked with the caller's last reference to
        # them, and a worker opens them only once it runs
        self.rings, self.grads = rings, grads
        self.first, self.last, self.grad = rings[0], rings[-1], grads[-1] if learning else None
        self.stage = copy.deepcopy(stages[-1])
        self.step = None if optimizer is None else optimizer(self.stage.parameters())
        self.loss_fn = nn.CrossEntropyLoss()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop and join every worker. The rings' semaphores (named, in /dev/shm) are unlinked as
        the last reference to them goes: the workers' and then the floor's."""
        self.stop[0] = True
        for worker in self.workers:
            worker.join(10)
            if worker.is_alive():
                worker.terminate()
                worker.join()
        self.workers, self.done, self.rings, self.grads = [], [], [], []
        self.first = self.last = self.grad = None  # type: ignore[assignment]

    def check(self) -> None:
        """Raise if a worker is gone (its traceback went to its stderr)."""
        for i, worker in enumerate(self.workers):
            if not worker.is_alive():
                raise RuntimeError(f"stage {i} of the Python floor ended (exit code {worker.exitcode})")

    def stream(self, xs: Iterable[Tensor], ys: Iterable[Tensor] | None = None) -> Iterator[Tensor]:
        """The output (inference) or the loss (learning, against ``ys``) of each sample of ``xs``, in
        order; every gradient has been applied when it ends. Drain one stream before the next."""
        targets = None if ys is None else iter(ys)
        waiting: deque[Tensor] = deque()  # the targets of the samples in the pipeline
        for sample, x in enumerate(xs):
            if targets is not None:
                waiting.append(next(targets))
            self.first.put(sample, x, self.check)
            if sample >= self.depth - 1:  # at tick t the last stage runs sample t - (D - 1)
                yield self.last_stage(*self.last.take(self.check), waiting)
        self.first.put(END, None, self.check)
        while (taken := self.last.take(self.check))[0] != END:
            yield self.last_stage(*taken, waiting)
        self.last.release()
        for done in self.done:
            acquire(done, self.check)

    def last_stage(self, sample: int, slot: Tensor, waiting: deque[Tensor]) -> Tensor:
        """The last stage's tick on the value in ``slot``: its output, or its loss."""
        if self.step is None:
            with torch.inference_mode():
                out = self.stage(slot)
            self.last.release()
            return out
        x = slot.detach().requires_grad_()
        loss = self.loss_fn(self.stage(x), waiting.popleft())
        self.step.zero_grad()
        loss.backward()
        self.last.release()
        self.grad.put(sample, x.grad, self.check)  # type: ignore[union-attr]
        self.step.step()
        return loss.detach()

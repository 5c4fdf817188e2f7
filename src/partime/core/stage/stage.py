"""One stage of a pipeline: its forward, its loss, its gradient step.

A ``Stage`` knows how to run one forward and one backward of its slice of the model under a
grad mode; it knows nothing of ticks, processes or transport. Every executor drives the same
``Stage`` objects, so what a stage computes is written once.

The grad modes differ only in what the vector-Jacobian product of a late gradient uses
(SPEC.md, "Learning: loss and backward"):

- ``partime``: the stage's newest input and its current weights;
- ``stash``: the input of the sample the gradient belongs to, and the current weights;
- ``weight-stash``: that input, and the weights it went forward with;
- ``graph-stash``: the graph of that sample's own forward (its activations, its dropout masks),
  run back with the current weights (``KeptGraph``): one forward per sample, no weight copy.

With weight prediction (``compensation``), a forward runs with the predicted weights and the
product of its gradient uses them too, whatever the grad mode.

With ``config.autocast`` (a dtype) every forward, run again or not, and the loss run under
``torch.autocast`` of that dtype on the stage's device type; the backward and the step run outside it.

With ``config.compile`` (``torch.compile``'s keyword arguments) every forward, run again or not,
runs through ``torch.compile`` of the module, made once in the stage's worker and compiled there
at its first call (``warm_up``, or the first tick), at the worker's thread count; the loss, the
backward's product and the step are as without it. Each way a stage runs its forward (with
gradients or without, with its own weights or others held in their place) is one compiled graph,
the same at every tick.

Where the graph of a forward is still valid for the product (built from the right input with
weights that no step has changed since, or kept by ``graph-stash``) it is reused instead of
running the forward again: in ``partime`` mode that is every tick with a forward, at the last
stage it is every tick, and in ``graph-stash`` mode every forward.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...learning.compensation import detached_copies, same_kind
from ...learning.optimizer_state import LOSS_PREFIX, trainable
from ..boundary_values import as_tensors, copy_tensors, is_float
from ..schedule import delay
from .config import StageConfig
from .kept_graph import KeptGraph, normalisation_in
from .learning import compensation_state, load_compensation_state, make_learning, unshared
from .random_stream import RandomStream
from .record import ForwardRecord, record_from, record_state, to_device, value_of
from .tensor_slots import TensorSlots

log = logging.getLogger("partime.core.stage")

_NOTHING = contextlib.nullcontext()
"""A context that does nothing, made once (it can be entered again and again)."""


@dataclass(frozen=True)
class Learnt:
    """What the last stage's ``learn`` gives: the loss, the gradient w.r.t. the stage's input
    (None at stage 0, and when skipped) and whether the sample was skipped (a non-finite loss
    under ``nonfinite="skip"``: no gradient, no step)."""

    loss: float
    gradient: Any
    skipped: bool = False


class Stage:
    """Stage ``index`` of a pipeline of ``config.depth`` stages, running ``module`` on ``device``.

    A learning stage with trainable parameters makes its optimizer with ``config.optimizer``: a
    TypeError if that returns anything but a ``torch.optim.Optimizer``, a ValueError if the
    optimizer holds none of the stage's trainable parameters; a warning names those it leaves out
    (they do not learn; a factory may choose to leave some out). With ``config.lr_scheduler`` it
    makes its scheduler of that optimizer (``lr_scheduler``), stepped after each step; with
    ``config.max_grad_norm`` each step's gradient is clipped to that norm over the stage's own
    parameters (the loss's too, at the last stage). ``steps`` counts its steps and ``grad_norm`` is
    its last step's gradient norm before clipping (with ``config.stats`` or ``max_grad_norm``; else None).

    A stage before the first with something to train (``config.first_trained``: the layers before
    are frozen) runs its forwards without a graph, keeps nothing for a gradient and takes none
    (``takes_gradient`` is False); the first such stage sends no gradient back (``sends_gradient``).
    """

    def __init__(self, index: int, module: nn.Module, config: StageConfig, device: str | torch.device = "cpu"):
        self.index = index
        self.config = config
        self.device = torch.device(device)
        self.module = module.to(self.device)
        self._slots = TensorSlots(self.module)  # to run a forward with other weights or buffers
        # what runs the module: itself, or torch.compile of it (which shares its weights and buffers)
        self._forward: Callable[..., Any] = (
            self.module if config.compile is None else torch.compile(self.module, **config.compile)
        )
        named = trainable(module)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # A loss with parameters is part of the last stage: they learn there, with its optimizer.
        loss_fn = config.loss_fn
        self._loss_module = loss_fn if index == config.depth - 1 and isinstance(loss_fn, nn.Module) else None
        loss_named = trainable(self._loss_module, LOSS_PREFIX) if config.learning else []
        self._loss_params = [p for _, p in loss_named]
        self._learning = make_learning(index, config, named, loss_named)  # its optimizer and compensation
        # a stage before every one with something to train runs its forwards as in inference: no
        # graph, no gradient; the first such stage needs no gradient w.r.t. its input
        self.takes_gradient = config.takes_gradient(index)
        self.sends_gradient = config.sends_gradient(index)
        self.optimizer = self._learning.optimizer
        self.lr_scheduler = self._learning.scheduler
        # graph-stash: a delayed stage's forwards keep their graphs across its steps (the last
        # stage's graph serves in the tick it is made, and predicted weights are copies anyway),
        # unless a normalisation layer's saved statistics would not fit the weights now (kept_graph)
        keeps = (
            config.grad_mode == "graph-stash"
            and delay(index, config.depth) > 0
            and self.optimizer is not None
            and self._learning.predictor is None
        )
        normalisation = normalisation_in(self.module) if keeps else None
        if normalisation is not None:
            log.info(
                "stage %d forms each late gradient's product with the weights its sample went forward with "
                "(as grad_mode='weight-stash'): it holds the normalisation layer %s, whose statistics a kept "
                "graph would mix with the weights now",
                index,
                normalisation,
            )
        self._kept = KeptGraph(index, self._params) if keeps and normalisation is None else None
        self._stashes_weights = config.grad_mode == "weight-stash" or normalisation is not None
        self._same_kind = same_kind(self._params)  # its weights can be copied in one pass
        # the stage's own random stream (None: a stage made apart from a pipeline draws from the process's)
        self._random = None if config.random_state is None else RandomStream(index, config.random_state)
        self._newest: ForwardRecord | None = None  # partime: the newest input
        self._pending: dict[int, ForwardRecord] = {}  # stash modes: forwards awaiting their gradient
        self._out_is_tuple = False
        # what a boundary value is called in an error (made once: a tick formats no text)
        self._input_name = f"input of stage {index}"
        self._gradient_name = f"gradient at stage {index}"
        self._output_name = f"output of stage {index}"
        self.phase = "start"  # what the stage is doing: forward, loss, backward or step
        self.steps = 0  # optimizer steps taken
        self.grad_norm: Tensor | None = None  # the last step's gradient norm, when measured (config.stats, clipping)

    def forward(self, sample: int, value: Any, learn: bool = True) -> Any:
        """Run sample ``sample`` forward; returns the output, detached, for the next stage.

        ``learn`` False (a sample that is only predicted): the forward runs as the module's own call
        under ``torch.no_grad()``, with the stage's weights as they are (also under weight
        prediction), its random stream and its modules' modes, and keeps nothing for a gradient."""
        self.phase = "forward"
        value = to_device(value, self.device)
        if not (self.takes_gradient and learn):
            with torch.no_grad(), self._drawing(), self._autocasting():
                return self._forward(value)
        tensors = as_tensors(value, self._input_name)
        record = ForwardRecord(sample, tuple(self._leaf(t) for t in tensors), not isinstance(value, Tensor))
        if self.index < self.config.depth - 1:  # a delayed stage may run this forward again
            if self._random is None:
                record.random = torch.get_rng_state()
            elif self._random.draws is not False:  # a stage that draws nothing needs no state to draw again
                record.random = self._random.state
        record.weights = self._learning.forward_weights(sample, self._stash if self._stashes_weights else None)
        if self._kept is not None:
            record.saved = []
        record.outputs = self._run(record)
        if self.config.grad_mode == "partime":
            self._newest = record
        else:
            self._pending[sample] = record
        return value_of(tuple(t.detach() for t in record.outputs), self._out_is_tuple)

    def warm_up(self, value: Any) -> None:
        """One forward of ``value`` by a copy of this stage, as its ticks run it (with gradients when
        it learns, under its autocast, compiled with ``config.compile``), from a copy of the process's
        random state: what a fresh process does once only (its thread pool started, its kernels
        chosen for these shapes, its memory mapped, dynamo's compile of the forward for these shapes,
        this thread count and this grad mode) is done before the first tick, and this stage, its
        buffers and every random stream are as they were."""
        # the copy draws from the process's stream (forked here), not from a stage stream of its own
        config = dataclasses.replace(self.config, random_state=None)
        with torch.random.fork_rng(devices=[]):
            Stage(self.index, copy.deepcopy(self.module), config, self.device).forward(0, value)

    def learn(self, sample: int, target: Any = None) -> Learnt:
        """Last stage: the loss of ``sample`` (just run forward), its backward and step.

        Returns the loss and the gradient w.r.t. this stage's input (``Learnt``). A loss that is not
        finite raises a FloatingPointError, or with ``nonfinite="skip"`` comes back skipped, with
        the gradient None: nothing is back-propagated and the optimizer does not step.

        When this stage has trainable parameters, a loss that does not require grad, or that has
        no gradient path to any of them, raises a ValueError before any step (a zero gradient,
        as of ``(output * 0).sum()``, is a path).
        """
        self.phase = "loss"
        loss_fn = self.config.loss_fn
        if loss_fn is None:
            raise RuntimeError(f"stage {self.index} has no loss_fn: a pipeline without one does not learn")
        record, outputs = self._record_for(sample)
        output = value_of(outputs, self._out_is_tuple)
        with self._drawing(), self._autocasting():
            loss = loss_fn(output, to_device(target, self.device)) if self.config.supervised else loss_fn(output)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor, got {shape} for sample {sample}; reduce it, e.g. with .mean()"
            )
        if self.optimizer is not None and not loss.requires_grad:
            raise ValueError(
                f"loss_fn returned a tensor with no gradient (requires_grad=False) for sample {sample}: "
                f"do not detach it or rebuild it from .item(); stage {self.index} would never learn"
            )
        value = loss.item()
        if not math.isfinite(value):
            if self.config.nonfinite == "skip":
                self.drop(sample)
                return Learnt(value, None, skipped=True)
            raise FloatingPointError(f"the loss of sample {sample} is not finite: {value}")
        return Learnt(value, self._apply(sample, record, (loss,), None))

    def backward(self, sample: int, grad: Any) -> Any:
        """Apply the gradient of ``sample`` w.r.t. this stage's output, as the grad mode says.

        Steps the optimizer; returns the gradient w.r.t. this stage's input (None at stage 0).
        """
        self.phase = "backward"
        record, outputs = self._record_for(sample)
        grads = tuple(t.to(self.device) for t in as_tensors(grad, self._gradient_name))
        return self._apply(sample, record, outputs, grads)

    def drop(self, sample: int) -> None:
        """``sample`` will bring no gradient (it was skipped): forget its forward; no step."""
        self._pending.pop(sample, None)
        self._learning.forget(sample)

    def state_dict(self) -> dict[str, Any]:
        """Everything of this stage that decides its future ticks, as copies in plain values.

        Its weights and buffers, its optimizer's state and its lr scheduler's, its random stream,
        the forwards it keeps for a later product (inputs; weights in ``weight-stash`` mode or with weight prediction;
        the random state each started from; whether a graph of it was still valid, and in
        ``graph-stash`` mode what that graph saved), the layout of its output and the compensation
        state (with delay correction, the weights each sample in flight went forward with).
        """
        return {
            "module": copy_tensors(self.module.state_dict()),
            "loss_fn": None
            if self._loss_module is None or not self._loss_params
            else copy_tensors(self._loss_module.state_dict()),
            "optimizer": None if self.optimizer is None else copy_tensors(self.optimizer.state_dict()),
            "optimizer_class": type(self.optimizer).__name__,
            # absent from checkpoints written before schedules: they load where there is none
            "lr_scheduler": None if self.lr_scheduler is None else copy_tensors(self.lr_scheduler.state_dict()),
            "lr_scheduler_class": scheduler_class(self.lr_scheduler),
            "newest": None if self._newest is None else record_state(self._newest),
            "pending": [record_state(r) for r in self._pending.values()],
            "out_is_tuple": self._out_is_tuple,
            **compensation_state(self._learning),
            "random": None if self._random is None else self._random.state.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Become the stage that ``state_dict`` described; it then computes what that one would.

        The stage takes over the tensors of ``state`` (pass a copy to keep using them).

        The graphs that were valid are built again, with the weights they were built with and on
        copies of the buffers, so that BatchNorm's statistics see no extra forward.
        """
        if state["optimizer_class"] != type(self.optimizer).__name__:
            raise ValueError(
                f"stage {self.index}: the checkpoint's optimizer is {state['optimizer_class']}, "
                f"this stage's is {type(self.optimizer).__name__}"
            )
        if state.get("lr_scheduler_class") != scheduler_class(self.lr_scheduler):
            raise ValueError(
                f"stage {self.index}: the checkpoint's lr scheduler is {state.get('lr_scheduler_class')}, "
                f"this stage's is {scheduler_class(self.lr_scheduler)}"
            )
        self.module.load_state_dict(state["module"])
        if self._loss_params and state.get("loss_fn") is not None:
            assert self._loss_module is not None  # a stage with loss parameters has a loss module
            self._loss_module.load_state_dict(state["loss_fn"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        load_compensation_state(self._learning, state, self.device)
        if self._random is not None and state.get("random") is not None:
            self._random.state, self._random.draws = state["random"].clone(), None
        self._newest = None
        self._pending = {}
        rebuild = []
        kept = ([state["newest"]] if state["newest"] is not None else []) + state["pending"]
        for kept_state in kept:
            record = record_from(kept_state, self._leaf, self.device)
            if self.config.grad_mode == "partime":
                self._newest = record
            else:
                self._pending[record.sample] = record
            if kept_state["graph"]:
                rebuild.append(record)
        for record in rebuild:
            record.outputs = self._run(record, again=True)
        self._out_is_tuple = state["out_is_tuple"]

    # -- internals ------------------------------------------------------------------------------

    def _stash(self) -> list[Tensor]:
        """Leaf copies of the stage's weights now (``weight-stash``: a forward's own weights)."""
        return [w.requires_grad_() for w in detached_copies(self._params, self._same_kind)]

    def _leaf(self, t: Tensor) -> Tensor:
        leaf = t.detach()
        if self.sends_gradient and is_float(leaf):
            leaf.requires_grad_()
        return leaf

    def _run(self, record: ForwardRecord, again: bool = False) -> tuple[Tensor, ...]:
        """The forward of ``record.inputs`` with the weights the grad mode asks for, with graph.

        A sample's own forward draws from the stage's random stream and updates the module's
        buffers (BatchNorm's running statistics) as a plain forward does. Run ``again`` (for a
        product, or to rebuild a checkpoint's graph), it is the same forward: it draws what the
        sample's own drew, and runs on copies of the buffers, so that every sample updates them once.

        A record with ``saved`` gets a graph kept across steps (``KeptGraph``): what it saves is
        collected there, or, run ``again``, taken from there (a checkpoint's copies)."""
        # On a clone, so that a layer working in place changes neither a stashed input nor a leaf.
        value = value_of(tuple(t.clone() for t in record.inputs), record.is_tuple)
        swapped = dict(zip(self._names, record.weights)) if record.weights else {}
        if again:
            swapped.update((name, b.clone()) for name, b in self.module.named_buffers())
        if self._plain_forward(record, again):
            out = self._call(value, swapped)
        else:
            with self._around(record, again):
                out = self._call(value, swapped)
        self._out_is_tuple = not isinstance(out, Tensor)
        return as_tensors(out, self._output_name)

    def _call(self, value: Any, swapped: dict[str, Tensor]) -> Any:
        """The module on ``value``, with the ``swapped`` tensors in place of its own."""
        if not swapped:
            return self._forward(value)
        with self._slots.holding(swapped):
            return self._forward(value)

    def _plain_forward(self, record: ForwardRecord, again: bool) -> bool:
        """Whether the forward of ``record`` needs nothing around it: autograd is on already, it keeps
        no graph across steps, and it draws nothing from a stream of its own (the steady tick of most
        stages: a plain call of the module)."""
        return (
            not again
            and record.saved is None
            and (self._random is None or self._random.draws is False)
            and torch.is_grad_enabled()
            and self.config.autocast is None
        )

    @contextlib.contextmanager
    def _around(self, record: ForwardRecord, again: bool) -> Iterator[None]:
        """Autograd on, the kept graph's hooks (``record.saved``: collected, or taken from there
        ``again``), the stage's random stream (``again``: replayed from ``record.random``) and the
        pipeline's autocast (run ``again``, a forward computes in the precision it first did)."""
        hooks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if record.saved is not None:
            assert self._kept is not None  # only a graph-stash stage's records save
            keep = self._kept.replaying if again else self._kept.keeping
            hooks = keep(record.sample, record.saved)
        randomness = RandomStream.replaying(record.random) if again else self._drawing()
        with torch.enable_grad(), hooks, randomness, self._autocasting():
            yield

    def _autocasting(self) -> contextlib.AbstractContextManager[Any]:
        """Within it, the stage computes under ``torch.autocast`` of the pipeline's dtype on its
        device's type (``config.autocast``; None: in the precision of its weights and inputs)."""
        if self.config.autocast is None:
            return _NOTHING
        return torch.autocast(device_type=self.device.type, dtype=self.config.autocast)

    def _drawing(self) -> contextlib.AbstractContextManager[None]:
        """Within it, what the stage's forward or loss draws comes from the stage's own stream."""
        if self._random is None or self._random.draws is False:
            return _NOTHING  # a stage that draws nothing needs no turn at the generator
        return self._random.drawing()

    def _record_for(self, sample: int) -> tuple[ForwardRecord, tuple[Tensor, ...]]:
        """The forward whose graph the product of ``sample``'s gradient uses, made valid, and its outputs."""
        if self.config.grad_mode == "partime":
            if self._newest is None:
                raise RuntimeError(f"stage {self.index} has run no forward for the gradient of sample {sample}")
            record = self._newest
        else:
            record = self._pending.pop(sample)
        outputs = record.outputs
        if outputs is None:  # a step made its graph stale: run it again with the weights now
            outputs = record.outputs = self._run(record, again=True)
        return record, outputs

    def _apply(
        self, sample: int, record: ForwardRecord, outputs: tuple[Tensor, ...], grads: tuple[Tensor, ...] | None
    ) -> Any:
        """Back-propagate ``sample``'s ``grads`` through ``record`` (None: ``outputs`` is the loss),
        step, return the gradient w.r.t. the input."""
        weights = record.weights or self._params
        learnt = list(weights) + (self._loss_params if grads is None else [])  # the loss's, with the loss
        wanted = learnt + [t for t in record.inputs if t.requires_grad]
        live = [k for k, o in enumerate(outputs) if o.requires_grad]
        found: tuple[Tensor | None, ...] = (None,) * len(wanted)
        self.phase = "backward"
        if live and wanted:
            found = torch.autograd.grad(
                [outputs[k] for k in live],
                wanted,
                grad_outputs=None if grads is None else [grads[k] for k in live],
                allow_unused=True,
            )
        record.outputs = None  # autograd.grad has freed its graph
        if grads is None and self.optimizer is not None and all(g is None for g in found[: len(weights)]):
            raise ValueError(
                f"the loss of sample {sample} has no gradient path to any parameter of stage {self.index}: "
                "loss_fn must compute it from the output it is given, not return a constant or a tensor "
                f"made apart from it; stage {self.index} would never learn"
            )
        if self.optimizer is not None:
            self.phase = "step"
            own = found[: len(learnt)]
            if self._learning.changes_gradients:
                own = unshared(own, found[len(learnt) :] + (grads or ()))
            self.grad_norm = self._learning.step_for(sample, self._params + self._loss_params, own)
            self.steps += 1
            self._drop_stale_graphs()
        if not self.sends_gradient:
            return None
        from_autograd = iter(found[len(learnt) :])
        input_grads = []
        for t in record.inputs:
            g = next(from_autograd) if t.requires_grad else None
            input_grads.append(torch.zeros_like(t) if g is None else g)
        return value_of(tuple(input_grads), record.is_tuple)

    def _drop_stale_graphs(self) -> None:
        """After a step, graphs built with the live weights no longer hold for a product."""
        if self._newest is not None:
            self._newest.outputs = None
        for record in self._pending.values():
            if not record.weights and record.saved is None:
                record.outputs = None


def scheduler_class(scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> str | None:
    """The class name a stage checkpoint keeps of its lr scheduler; None for none."""
    return None if scheduler is None else type(scheduler).__name__

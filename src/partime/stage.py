"""One stage of a pipeline: its forward, its loss, its gradient step (internal module).

A ``Stage`` knows how to run one forward and one backward of its slice of the model under a
grad mode; it knows nothing of ticks, processes or transport. Every executor drives the same
``Stage`` objects, so what a stage computes is written once.

The grad modes differ only in what the vector-Jacobian product of a late gradient uses
(SPEC.md, "Learning: loss and backward"):

- ``partime``: the stage's newest input and its current weights;
- ``stash``: the input of the sample the gradient belongs to, and the current weights;
- ``weight-stash``: that input, and the weights it went forward with.

With weight prediction (``compensation``), a forward runs with the predicted weights and the
product of its gradient uses them too, whatever the grad mode.

Where the graph of a forward is still valid for the product (built from the right input with
weights that no step has changed since) it is reused instead of running the forward again: in
``partime`` mode that is every tick with a forward, and at the last stage it is every tick.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .compensation import (
    DelayCorrection,
    StepSizeScale,
    WeightPredictor,
    chosen_compensation,
    delay,
    scale_step_size,
)
from .lookahead import (
    OptimizerPrediction,
    SpikeCompensation,
    check_holds,
    described,
    lengthen_momentum,
)
from .values import as_tensors, copy_tensors, is_float

log = logging.getLogger(__name__)

GRAD_MODES = ("partime", "stash", "weight-stash")
NONFINITE = ("raise", "skip")

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
LossFn = Callable[..., Tensor]


@dataclass
class StageConfig:
    """What every stage of one pipeline shares: how it learns, if it learns."""

    depth: int
    loss_fn: LossFn | None = None
    optimizer: OptimizerFactory | None = None
    grad_mode: str = "stash"
    supervised: bool = False
    compensation: tuple[str, ...] = ()
    nonfinite: str = "raise"  # a non-finite loss: "raise", or "skip" (no gradient, no step)

    @property
    def learning(self) -> bool:
        return self.optimizer is not None


def check_loss_fn(loss_fn: Any) -> None:
    """A TypeError unless ``loss_fn`` is callable (or None: no learning), and not a loss class
    where an instance of it is meant."""
    wanted = "loss_fn must be a callable such as nn.MSELoss() or a function (output, target) -> scalar tensor"
    if isinstance(loss_fn, type) and issubclass(loss_fn, nn.Module):
        raise TypeError(f"{wanted}, got the class {loss_fn.__name__}; pass an instance: {loss_fn.__name__}()")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{wanted}, got {described(loss_fn)}")


def takes_target(loss_fn: LossFn) -> bool | None:
    """Whether ``loss_fn`` is called as ``loss_fn(output, target)`` (True) or ``loss_fn(output)``.

    None when its signature does not say (``*args``): then the stream decides.
    """
    target = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return sum(p.default is p.empty for p in positional) >= 2


@dataclass(frozen=True)
class Learnt:
    """What the last stage's ``learn`` gives: the loss, the gradient w.r.t. the stage's input
    (None at stage 0, and when skipped) and whether the sample was skipped (a non-finite loss
    under ``nonfinite="skip"``: no gradient, no step)."""

    loss: float
    gradient: Any
    skipped: bool = False


@dataclass
class _Forward:
    """What a stage keeps of one forward, for a later backward."""

    sample: int
    inputs: tuple[Tensor, ...]  # leaves: the gradient w.r.t. them goes to the previous stage
    is_tuple: bool  # whether the input value was a tuple
    weights: list[Tensor] = field(default_factory=list)  # weight-stash: the weights it went with
    outputs: tuple[Tensor, ...] | None = None  # with their graph, while it is valid


class Stage:
    """Stage ``index`` of a pipeline of ``config.depth`` stages, running ``module`` on ``device``.

    A learning stage with trainable parameters makes its optimizer with ``config.optimizer``: a
    TypeError if that returns anything but a ``torch.optim.Optimizer``, a ValueError if the
    optimizer holds none of the stage's trainable parameters; a warning names those it leaves out
    (they do not learn; a factory may choose to leave some out).
    """

    def __init__(self, index: int, module: nn.Module, config: StageConfig, device: str | torch.device = "cpu"):
        self.index = index
        self.config = config
        self.device = torch.device(device)
        self.module = module.to(self.device)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.optimizer = None
        self._step_size: StepSizeScale | None = None
        self._predictor: WeightPredictor | OptimizerPrediction | None = None
        self._corrector: DelayCorrection | None = None
        self._spike: SpikeCompensation | None = None
        if config.optimizer is not None and self._params:  # config.learning, in a form mypy narrows
            self.optimizer = self._make_optimizer(config.optimizer)
            tau = delay(index, config.depth)
            chosen = chosen_compensation(config.compensation, self.optimizer)
            if "step-scale" in chosen and tau > 0:
                scale_step_size(self.optimizer, tau)
            if "lr-scale" in chosen:
                self._step_size = StepSizeScale(self.optimizer, tau)
            if "weight-prediction" in chosen:
                self._predictor = WeightPredictor(self._params, tau)
            if "long-momentum" in chosen and tau > 0:
                lengthen_momentum(self.optimizer)
            if "optimizer-prediction" in chosen:
                self._predictor = OptimizerPrediction(self.optimizer, self._params, tau)
            if "delay-correction" in chosen and tau > 0:
                self._corrector = DelayCorrection(named)
            if "spike" in chosen and tau > 0:
                self._spike = SpikeCompensation(self.optimizer, self._params, tau)
        self._anchors: dict[int, list[Tensor]] = {}  # delay-correction: the weights at each forward
        self._newest: _Forward | None = None  # partime: the newest input
        self._pending: dict[int, _Forward] = {}  # stash modes: forwards awaiting their gradient
        self._out_is_tuple = False
        self.phase = "start"  # what the stage is doing: forward, loss, backward or step

    def forward(self, sample: int, value: Any) -> Any:
        """Run sample ``sample`` forward; returns the output, detached, for the next stage."""
        self.phase = "forward"
        value = _to(value, self.device)
        if not self.config.learning:
            with torch.no_grad():
                return self.module(value)
        tensors = as_tensors(value, f"input of stage {self.index}")
        record = _Forward(sample, tuple(self._leaf(t) for t in tensors), not isinstance(value, Tensor))
        now: list[Tensor] = []  # a copy of the weights now, if the grad mode keeps one
        if self._predictor is not None:
            record.weights = self._predictor.predict()
        elif self.config.grad_mode == "weight-stash":
            record.weights = [p.detach().clone().requires_grad_() for p in self._params]
            now = [w.detach() for w in record.weights]
        if self._corrector is not None:
            self._anchors[sample] = now or self._corrector.anchor()
        record.outputs = self._run(record)
        if self.config.grad_mode == "partime":
            self._newest = record
        else:
            self._pending[sample] = record
        return value_of(tuple(t.detach() for t in record.outputs), self._out_is_tuple)

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
        if self.config.supervised:
            loss = loss_fn(output, _to(target, self.device))
        else:
            loss = loss_fn(output)
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
        grads = tuple(t.to(self.device) for t in as_tensors(grad, f"gradient at stage {self.index}"))
        return self._apply(sample, record, outputs, grads)

    def drop(self, sample: int) -> None:
        """``sample`` will bring no gradient (it was skipped): forget its forward; no step."""
        self._pending.pop(sample, None)
        self._anchors.pop(sample, None)

    def state_dict(self) -> dict[str, Any]:
        """Everything of this stage that decides its future ticks, as copies in plain values.

        Its weights and buffers, its optimizer's state, the forwards it keeps for a later
        product (inputs; weights in ``weight-stash`` mode or with weight prediction; whether a
        graph of it was still valid), the layout of its output and the compensation state (with
        delay correction, the weights each sample in flight went forward with).
        """
        state: dict[str, Any] = {
            "module": copy_tensors(self.module.state_dict()),
            "optimizer": None if self.optimizer is None else copy_tensors(self.optimizer.state_dict()),
            "optimizer_class": type(self.optimizer).__name__,
            "newest": None if self._newest is None else _record_state(self._newest),
            "pending": [_record_state(r) for r in self._pending.values()],
            "out_is_tuple": self._out_is_tuple,
            "lr_scale_steps": None if self._step_size is None else self._step_size.steps,
            "prediction": None,
            "anchors": [(sample, copy_tensors(anchor)) for sample, anchor in self._anchors.items()],
        }
        if isinstance(self._predictor, WeightPredictor):
            state["prediction"] = {
                "previous": copy_tensors(self._predictor.previous),
                "velocity": copy_tensors(self._predictor.velocity),
            }
        return state

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
        self.module.load_state_dict(state["module"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self._step_size is not None:
            self._step_size.steps = state["lr_scale_steps"]
        if isinstance(self._predictor, WeightPredictor):
            with torch.no_grad():
                for dst, src in zip(
                    self._predictor.previous + self._predictor.velocity,
                    state["prediction"]["previous"] + state["prediction"]["velocity"],
                ):
                    dst.copy_(src)
        self._anchors = {sample: [t.to(self.device) for t in anchor] for sample, anchor in state.get("anchors", ())}
        self._newest = None
        self._pending = {}
        rebuild = []
        kept = ([state["newest"]] if state["newest"] is not None else []) + state["pending"]
        for record_state in kept:
            record = self._record_from(record_state)
            if self.config.grad_mode == "partime":
                self._newest = record
            else:
                self._pending[record.sample] = record
            if record_state["graph"]:
                rebuild.append(record)
        for record in rebuild:
            record.outputs = self._run(record, scratch_buffers=True)
        self._out_is_tuple = state["out_is_tuple"]

    # -- internals ------------------------------------------------------------------------------

    def _make_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """``factory``'s optimizer of this stage's trainable parameters, checked (see the class)."""
        optimizer = factory(self._params)
        source = (
            f"stage {self.index}: the optimizer factory, called on its {len(self._params)} trainable "
            f"parameters ({_listed(self._names)}),"
        )
        left_out = check_holds(optimizer, self._params, source, f"stage {self.index} would never learn")
        if left_out:
            log.warning(
                "stage %d: the optimizer leaves out %d of its %d trainable parameters, which will not learn: %s",
                self.index,
                len(left_out),
                len(self._params),
                _listed([self._names[k] for k in left_out]),
            )
        return optimizer

    def _record_from(self, state: dict[str, Any]) -> _Forward:
        """A kept forward from ``_record_state``, without its graph."""
        inputs = tuple(self._leaf(t.to(self.device)) for t in state["inputs"])
        weights = [w.detach().to(self.device).requires_grad_() for w in state["weights"]]
        return _Forward(state["sample"], inputs, state["is_tuple"], weights)

    def _leaf(self, t: Tensor) -> Tensor:
        leaf = t.detach()
        if self.index > 0 and is_float(leaf):
            leaf.requires_grad_()
        return leaf

    def _run(self, record: _Forward, scratch_buffers: bool = False) -> tuple[Tensor, ...]:
        """The forward of ``record.inputs`` with the weights the grad mode asks for, with graph;
        with ``scratch_buffers``, on copies of the buffers (the module's own stay as they are)."""
        # On a clone, so that a layer working in place changes neither a stashed input nor a leaf.
        value = value_of(tuple(t.clone() for t in record.inputs), record.is_tuple)
        swapped = dict(zip(self._names, record.weights))
        if scratch_buffers:
            swapped.update((name, b.clone()) for name, b in self.module.named_buffers())
        with torch.enable_grad():
            if swapped:
                out = torch.func.functional_call(self.module, swapped, (value,))
            else:
                out = self.module(value)
        self._out_is_tuple = not isinstance(out, Tensor)
        return as_tensors(out, f"output of stage {self.index}")

    def _record_for(self, sample: int) -> tuple[_Forward, tuple[Tensor, ...]]:
        """The forward whose graph the product of ``sample``'s gradient uses, made valid, and its outputs."""
        if self.config.grad_mode == "partime":
            if self._newest is None:
                raise RuntimeError(f"stage {self.index} has run no forward for the gradient of sample {sample}")
            record = self._newest
        else:
            record = self._pending.pop(sample)
        outputs = record.outputs
        if outputs is None:  # a step made its graph stale: run it again with the weights now
            outputs = record.outputs = self._run(record)
        return record, outputs

    def _apply(
        self, sample: int, record: _Forward, outputs: tuple[Tensor, ...], grads: tuple[Tensor, ...] | None
    ) -> Any:
        """Back-propagate ``sample``'s ``grads`` through ``record`` (None: ``outputs`` is the loss),
        step, return the gradient w.r.t. the input."""
        weights = record.weights or self._params
        wanted = list(weights) + [t for t in record.inputs if t.requires_grad]
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
            for p, g in zip(self._params, found[: len(weights)]):
                p.grad = g
            self.phase = "step"
            if self._corrector is not None:
                self._corrector.correct(self._anchors.pop(sample))
            if self._step_size is not None:
                self._step_size.before_step()
            if self._spike is not None:
                self._spike.before_step()
            self.optimizer.step()
            if self._spike is not None:
                self._spike.after_step()
            for p in self._params:
                p.grad = None
            if isinstance(self._predictor, WeightPredictor):
                self._predictor.after_step()
            self._drop_stale_graphs()
        if self.index == 0:
            return None
        from_autograd = iter(found[len(weights) :])
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
            if not record.weights:
                record.outputs = None


def _listed(names: list[str], most: int = 6) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


def _record_state(record: _Forward) -> dict[str, Any]:
    return {
        "sample": record.sample,
        "inputs": copy_tensors(list(record.inputs)),
        "is_tuple": record.is_tuple,
        "weights": copy_tensors(record.weights),
        "graph": record.outputs is not None,
    }


def value_of(tensors: tuple[Tensor, ...], is_tuple: bool) -> Any:
    """A boundary value made of ``tensors``: the tuple itself, or its one tensor."""
    return tuple(tensors) if is_tuple else tensors[0]


def _to(value: Any, device: torch.device) -> Any:
    if value is None:
        return None
    if isinstance(value, Tensor):
        return value.to(device)
    return tuple(t.to(device) for t in value)

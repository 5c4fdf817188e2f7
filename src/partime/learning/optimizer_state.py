"""Compensation that reads the optimizer's own state: SGD, SGD with momentum, Adam, AdamW.

Stage ``i`` applies each gradient ``τ_i`` steps after the forward it belongs to
(``core.schedule.delay``). The two remedies here use what the optimizer already knows about the
steps to come: its momentum (SGD's ``momentum_buffer``, Adam's ``exp_avg``) and, for Adam, its
step count and second moments. Both are exactly plain online learning at ``τ = 0``.

``"optimizer-prediction"``: the forward of a sample, and the product of its gradient, use the
    weights the optimizer will reach over the next ``τ`` steps from its momentum alone, as if no
    new gradient came (the multi-step Nesterov look-ahead of FTPipe's weight predictors,
    Eliad et al., "Fine-tuning giant neural networks on commodity hardware with automatic
    pipeline model parallelism", USENIX ATC 2021, ``weight_prediction/{sgd,adam}.py``; PipeOptim,
    arXiv 2312.00839, predicts with the same update rule). With ``k`` counting the coming steps,

    - SGD with momentum ``μ`` (``torch.optim.SGD``):
      ``θ̂ = θ − lr · Σ_{k=1..τ} μ^k · buf`` (Nesterov: ``μ^(k+1)``); plain SGD keeps no
      momentum, and its prediction is ``θ`` itself;
    - Adam, AdamW: ``θ̂ = θ − Σ_{k=1..τ} lr / (1 − β1^(t+k)) · β1^k · m / (√(v / (1 − β2^(t+k))) + ε)``
      at step count ``t`` (``v``: the running maximum with ``amsgrad``), less
      ``τ · lr · wd · θ`` with decoupled weight decay (AdamW).

``"spike"``: spike compensation (Kosson et al., "Pipelined Backpropagation at Scale: Training
    Large Models without Batches", MLSys 2021). A late gradient ``g`` has missed the ``τ`` steps
    in which momentum would already have applied it; it is applied once with what it missed,
    and every gradient in the momentum is discounted by as much as it is late:

    - SGD with momentum ``μ`` and dampening ``d``: the step is ``lr · (a · buf + b · (1 − d) · g)``
      with ``a = μ^τ``, ``b = (1 − μ^τ) / (1 − μ)`` (Kosson et al.'s eq. 5), in place of
      ``lr · buf``; plain SGD (``μ = 0``) is unchanged;
    - Adam, AdamW: ``m`` in the step is replaced by ``β1^τ · m + (1 − β1^τ) · g``, the same
      rule for an exponential average (``g`` with L2 weight decay folded in, as Adam folds it).

    Nesterov momentum is refused (its look-ahead already counts each gradient twice).

``"long-momentum"``: on a stage with delay, the momentum coefficient (SGD's ``μ``, Adam's ``β1``)
    is raised to ``LONG_MOMENTUM = 0.99``, after Ajanthan et al., "Nesterov Method for
    Asynchronous Pipeline Parallel Optimization" (ICML 2025), who pair a look-ahead with
    ``β1 = 0.99`` on asynchronous pipelines: with a long momentum, a late gradient is a small
    part of each step and the look-ahead of ``"optimizer-prediction"`` foresees the rest, so it
    is meant to go with that option. SGD's dampening is raised with it so that a steady gradient
    still moves the weights as fast (``(1 − d) / (1 − μ)`` is kept); Adam's average is normalised
    already. A stage with no delay keeps the user's coefficients.

Measurements: experiments/measured-and-not-kept.md.
"""

from __future__ import annotations

import inspect
import math
import reprlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .compensation import detached_copies, same_kind

SUPPORTED = "torch.optim.SGD (with or without momentum), torch.optim.Adam and torch.optim.AdamW"
OPTIONS = ("optimizer-prediction", "spike", "long-momentum")
"""The compensation options that read the optimizer's state."""


EXAMPLE = "lambda params: torch.optim.SGD(params, lr=0.01)"
"""A factory to show in an error message."""


def check_optimizer_factory(
    factory: Callable[[Any], torch.optim.Optimizer] | None,
    names: Sequence[str],
    named: Sequence[tuple[str, Tensor]],
) -> None:
    """That ``factory`` (None: no learning) makes, of copies of the model's trainable parameters
    ``named`` (handed to it as ``(name, parameter)`` pairs, as ``model.named_parameters()`` gives
    them, in order), an optimizer that holds some of
    them and can step without a closure, and that every option of ``names`` that reads the
    optimizer's state knows it.

    The factory is called on detached copies, never on made-up parameters: a factory that a plain
    loop accepts (``factory(list(model.named_parameters()))``) is accepted, one that a plain loop
    would refuse is refused here. A ValueError if there is no trainable parameter (nothing would
    learn). A TypeError if ``factory`` is not callable (a string, an optimizer instance), returns anything but a
    ``torch.optim.Optimizer``, or makes one whose ``step`` needs arguments (``check_steps_alone``);
    a ValueError if its optimizer holds none of the parameters; an error of the kind ``factory``
    raised (a RuntimeError for kinds other than TypeError and ValueError) chained to it if the
    call fails; then ``check_optimizer``'s errors.
    """
    if factory is None:
        return
    wanted = "optimizer must be a factory params -> Optimizer, e.g. " + EXAMPLE
    if isinstance(factory, torch.optim.Optimizer):
        raise TypeError(
            f"{wanted}; got an instance of {type(factory).__name__} (each stage makes its own "
            "optimizer of its own parameters)"
        )
    if isinstance(factory, str) or not callable(factory):
        raise TypeError(f"{wanted}; got {described(factory)}")
    if not named:
        raise ValueError(
            "optimizer= was given, but nothing would learn: every parameter of the model (and of the loss) "
            "has requires_grad=False, where a plain loop's optimizer of them raises 'optimizer got an empty "
            "parameter list'; unfreeze what should learn (p.requires_grad_(True)), or leave out loss_fn= and "
            "optimizer= to run the model without learning"
        )
    # Copies, so that nothing the factory does (an initialisation, a hook) reaches the model.
    copies = [(name, torch.nn.Parameter(p.detach().clone())) for name, p in named]
    source = (
        f"the optimizer factory, called on copies of the model's {len(copies)} trainable parameters "
        f"({shapes_listed(named)}),"
    )
    optimizer = call_factory(factory, copies, source, "a plain loop's factory(model.named_parameters()) fails alike")
    check_holds(optimizer, [p for _, p in copies], source, "no stage would learn")
    check_steps_alone(optimizer, source)
    for name in names:
        if name in OPTIONS:
            check_optimizer(optimizer, name)


def call_factory(factory: Callable[[Any], Any], params: list[Any], source: str, note: str) -> Any:
    """``factory(params)``; if it raises, an error of its kind (TypeError, ValueError, else
    RuntimeError) chained to it, that says ``source`` failed, ``note`` and what a user can do."""
    try:
        return factory(params)
    except Exception as exc:
        kind = type(exc) if type(exc) in (TypeError, ValueError) else RuntimeError
        raise kind(
            f"{source} failed: {type(exc).__name__}: {exc}; {note}. Each stage calls the factory with "
            "its own trainable parameters: make it accept them all, or give those it cannot take to "
            "no optimizer (leave them out of the one it returns: they then do not learn, with a "
            "warning; or set requires_grad=False), or return an optimizer that steps them with "
            "another rule (e.g. partime.optim.MuonWithAdamW, one optimizer that steps the matrices with "
            "Muon and the rest with AdamW)"
        ) from exc


def check_steps_alone(optimizer: torch.optim.Optimizer, source: str) -> None:
    """A TypeError if ``optimizer.step()`` cannot be called without arguments (LBFGS's ``step``
    requires a closure, which evaluates the loss again, several times per step): a stage steps on
    the gradient of one sample, once, and has no closure to give."""
    # The class's step, bound here: an lr scheduler wraps the instance's step in one whose
    # signature, read through functools.wraps, is the unbound function's, self included.
    try:
        signature = inspect.signature(type(optimizer).step)
    except (TypeError, ValueError):  # a step whose signature Python cannot read: it is taken as it is
        return
    try:
        signature.bind(optimizer)
    except TypeError:
        required = [
            n
            for n, p in list(signature.parameters.items())[1:]
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        raise TypeError(
            f"{source} made {type(optimizer).__name__}, whose step() requires {', '.join(required)} (a closure "
            "that evaluates the loss again, several times per step, as LBFGS does): a pipeline learns from "
            "one gradient per sample per tick and has no closure to give; use an optimizer that steps on "
            "the gradient alone, e.g. torch.optim.SGD or torch.optim.Adam"
        ) from None


def shapes_listed(named: Sequence[tuple[str, Tensor]], most: int = 6) -> str:
    """Parameters in a message: each name with its shape, the first ``most`` of them."""
    shown = ", ".join(f"{n} {tuple(p.shape)}" for n, p in named[:most])
    return shown if len(named) <= most else f"{shown} and {len(named) - most} more"


def check_holds(optimizer: Any, params: Sequence[Tensor], source: str, consequence: str) -> list[int]:
    """The positions in ``params`` of those that ``optimizer``, which ``source`` made of them, leaves out.

    A TypeError unless ``optimizer`` is a ``torch.optim.Optimizer``; a ValueError if it holds none
    of ``params``. Both messages say ``consequence``, e.g. "stage 1 would never learn".
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        hint = " (a def must return it)" if optimizer is None else ""
        raise TypeError(
            f"{source} returned {described(optimizer)}, not a torch.optim.Optimizer: {consequence}; "
            f"the factory must return the optimizer it makes of the params it is given{hint}, "
            f"e.g. {EXAMPLE}"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    left_out = [k for k, p in enumerate(params) if id(p) not in held]
    if params and len(left_out) == len(params):
        raise ValueError(
            f"{source} returned {type(optimizer).__name__} holding none of them (it holds {len(held)} "
            f"other parameters): {consequence}; the optimizer factory must optimise the params "
            f"it is given, e.g. {EXAMPLE}, not other_model.parameters()"
        )
    return left_out


def described(value: Any) -> str:
    """``value`` in an error message: its type and a short repr."""
    return "None" if value is None else f"{type(value).__name__} {reprlib.repr(value)}"


def check_optimizer(optimizer: torch.optim.Optimizer, option: str) -> None:
    """A TypeError unless ``option`` knows the kind of ``optimizer``; a ValueError if it cannot
    take one of its settings."""
    if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam)):
        raise TypeError(
            f"compensation {option!r} reads the optimizer's state and supports {SUPPORTED}; "
            f"got {type(optimizer).__name__}"
        )
    nesterov = isinstance(optimizer, torch.optim.SGD) and any(g["nesterov"] for g in optimizer.param_groups)
    if option == "spike" and nesterov:
        raise ValueError(
            "compensation 'spike' does not support SGD with nesterov=True; "
            "use nesterov=False or compensation 'optimizer-prediction'"
        )


LONG_MOMENTUM = 0.99
"""The momentum coefficient of a delayed stage under ``"long-momentum"``."""


def lengthen_momentum(optimizer: torch.optim.Optimizer, to: float = LONG_MOMENTUM) -> None:
    """Raise every group's momentum coefficient to ``to`` (``"long-momentum"``); plain SGD has none."""
    check_optimizer(optimizer, "long-momentum")
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD):
            mu = float(group["momentum"])
            if 0 < mu < to:
                group["dampening"] = 1 - (1 - float(group["dampening"])) * (1 - to) / (1 - mu)
                group["momentum"] = to
        else:
            beta1, beta2 = group["betas"]
            if beta1 < to:
                group["betas"] = (to, beta2)


def _decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


def _sign(group: dict) -> float:
    return -1.0 if group.get("maximize", False) else 1.0


class OptimizerPrediction:
    """The weights ``delay`` steps ahead by the optimizer's momentum (``"optimizer-prediction"``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[Tensor],
        delay: int,
        scale: Callable[[], float] | None = None,
    ):
        check_optimizer(optimizer, "optimizer-prediction")
        self.optimizer = optimizer
        self.params = list(params)
        self.delay = delay
        self.scale = scale  # how much of each of the optimizer's steps the stage takes (None: all)
        self._members = members_by_group(optimizer, self.params)
        self._together = same_kind(self.params)

    @torch.no_grad()
    def predict(self) -> list[Tensor]:
        """Leaf copies of the weights the optimizer reaches in ``delay`` steps with no new gradient.

        Each group's parameters are shifted together, with torch's ``_foreach`` ops: the same
        arithmetic, element by element, as one parameter at a time, in a few calls per step ahead
        instead of a few per parameter."""
        ahead = detached_copies(self.params, self._together)
        if self.delay > 0:
            for group, members in zip(self.optimizer.param_groups, self._members):
                if members:
                    self._shift(group, [self.params[k] for k in members], [ahead[k] for k in members])
        return [a.requires_grad_() for a in ahead]

    def _shift(self, group: dict, params: list[Tensor], out: list[Tensor]) -> None:
        """Move ``out`` (copies of ``params``, of one group) along the group's next ``delay`` steps."""
        tau, lr = self.delay, float(group["lr"])  # buffers hold the sign the optimizer descends along
        if self.scale is not None:
            lr *= self.scale()
        states = [self.optimizer.state.get(p, {}) for p in params]
        if isinstance(self.optimizer, torch.optim.SGD):
            mu = float(group["momentum"])
            if mu == 0:  # plain SGD keeps no momentum: its prediction is the weights as they are
                return
            moving = [(o, s["momentum_buffer"]) for o, s in zip(out, states) if s.get("momentum_buffer") is not None]
            if not moving:
                return
            first = 2 if group["nesterov"] else 1
            torch._foreach_add_(
                [o for o, _ in moving],
                [b for _, b in moving],
                alpha=-lr * sum(mu**k for k in range(first, first + tau)),
            )
            return
        kept = [(p, o, s) for p, o, s in zip(params, out, states) if "exp_avg" in s]
        if not kept:
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        steps = [float(s["step"]) for _, _, s in kept]
        moved = [o for _, o, _ in kept]
        averages = [s["exp_avg"] for _, _, s in kept]
        roots = torch._foreach_sqrt([s["max_exp_avg_sq"] if group["amsgrad"] else s["exp_avg_sq"] for _, _, s in kept])
        for k in range(1, tau + 1):
            denoms = torch._foreach_div(roots, [math.sqrt(1 - beta2 ** (t + k)) for t in steps])
            torch._foreach_add_(denoms, group["eps"])
            torch._foreach_addcdiv_(moved, averages, denoms, [-lr * beta1**k / (1 - beta1 ** (t + k)) for t in steps])
        if group["weight_decay"] and _decoupled(self.optimizer, group):
            torch._foreach_add_(moved, [p.detach() for p, _, _ in kept], alpha=-tau * lr * group["weight_decay"])


class SpikeCompensation:
    """Kosson et al.'s spike compensation of a step ``delay`` steps late (``"spike"``).

    ``before_step()`` reads the gradients in ``.grad``; ``after_step()`` turns the optimizer's
    own step into the compensated one. Both work on each group's parameters together, with
    torch's ``_foreach`` ops: the arithmetic of one parameter at a time, in a few calls per group.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[Tensor], delay: int):
        check_optimizer(optimizer, "spike")
        self.optimizer = optimizer
        self.params = list(params)
        self.delay = delay
        self._members = members_by_group(optimizer, self.params)
        # per group: the parameters with a gradient, and each gradient as the optimizer folds it in
        self._grads: list[tuple[list[Tensor], list[Tensor]]] = []

    @torch.no_grad()
    def before_step(self) -> None:
        """Keep each gradient as the optimizer will fold it in (with L2 weight decay)."""
        self._grads = []
        for group, members in zip(self.optimizer.param_groups, self._members):
            params = [p for p in (self.params[k] for k in members) if p.grad is not None]
            if not params:
                self._grads.append(([], []))
                continue
            grads = list(torch._foreach_mul([p.grad for p in params if p.grad is not None], _sign(group)))
            if group["weight_decay"] and not _decoupled(self.optimizer, group):
                torch._foreach_add_(grads, params, alpha=group["weight_decay"])
            self._grads.append((params, grads))

    @torch.no_grad()
    def after_step(self) -> None:
        """Add to each parameter the difference between the compensated step and the one taken."""
        for group, (params, grads) in zip(self.optimizer.param_groups, self._grads):
            if params:
                self._correct(group, params, grads)
        self._grads = []

    def _correct(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        states = [self.optimizer.state[p] for p in params]
        tau, lr = self.delay, float(group["lr"])  # buffers hold the sign the optimizer descends along
        if isinstance(self.optimizer, torch.optim.SGD):
            mu = float(group["momentum"])
            if mu == 0:
                return
            a, b = mu**tau, (1 - mu**tau) / (1 - mu)
            # taken: lr · buf; wanted: lr · (a · buf + b · (1 − d) · g)
            change = torch._foreach_mul([s["momentum_buffer"] for s in states], a - 1)
            torch._foreach_add_(change, torch._foreach_mul(grads, b * (1 - float(group["dampening"]))))
            torch._foreach_add_(params, change, alpha=-lr)
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        steps = [float(s["step"]) for s in states]
        denoms = torch._foreach_sqrt([s["max_exp_avg_sq"] if group["amsgrad"] else s["exp_avg_sq"] for s in states])
        torch._foreach_div_(denoms, [math.sqrt(1 - beta2**t) for t in steps])
        torch._foreach_add_(denoms, group["eps"])
        # taken: m; wanted: β1^τ · m + (1 − β1^τ) · g, both over the same bias correction and denominator
        missed = torch._foreach_sub(grads, [s["exp_avg"] for s in states])
        torch._foreach_addcdiv_(params, missed, denoms, [-lr * (1 - beta1**tau) / (1 - beta1**t) for t in steps])


def members_by_group(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> list[list[int]]:
    """For each of ``optimizer``'s param groups, the positions in ``params`` of those it holds, in
    the group's order. By position, not by group: loading an optimizer's state makes new group
    dicts, with the same parameters."""
    position = {id(p): k for k, p in enumerate(params)}
    return [[position[id(p)] for p in group["params"] if id(p) in position] for group in optimizer.param_groups]


LOSS_PREFIX = "loss_fn."
"""What the names of a loss module's parameters start with, where a stage hands them to its optimizer."""


def trainable(module: Any, prefix: str = "") -> list[tuple[str, torch.nn.Parameter]]:
    """``module``'s trainable parameters in order, each named ``prefix`` + its name; none if it is
    no ``nn.Module`` (a loss function without parameters). A pipeline's optimizers are handed the
    model's, then a loss module's (``trainable(loss_fn, LOSS_PREFIX)``), which learn at the last stage."""
    if not isinstance(module, torch.nn.Module):
        return []
    return [(prefix + n, p) for n, p in module.named_parameters() if p.requires_grad]

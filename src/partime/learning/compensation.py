"""Staleness compensation: what a stage can do about learning from late gradients.

Stage ``i`` of a pipeline of depth ``D`` applies each gradient ``τ_i = 2(D - 1 - i)`` steps
after the forward it belongs to (SPEC.md). The remedies after the literature are options of
``Pipeline(compensation=...)``, each measured by ``partime fidelity``; those that read the
optimizer's state (``"optimizer-prediction"``, ``"long-momentum"``, ``"spike"``) live in
``partime.learning.optimizer_state``. ``"auto"``, the default, chooses among them by the kind of optimizer
(``AUTOMATIC``).

``"step-scale"``: a delay-aware step size kept for good: each step of stage ``i`` moves its
    weights by ``1 / (1 + τ_i) ** p`` of what its optimizer's step moved them (``p =
    STEP_SCALE_POWER = 1``): for the optimizers whose step is proportional to ``lr`` (SGD with or
    without momentum, Adam, AdamW, ...), a step with ``lr / (1 + τ_i) ** p``. PipeMare's analysis
    (below) finds that the largest stable step shrinks as the delay grows; a step size that suits
    sequential learning best sits near the edge of stability, and there the delayed stages of the
    panning camera diverge with every optimizer.

``"lr-scale"``: delay-aware step size, after PipeMare (Yang et al., "PipeMare: Asynchronous
    Pipeline Parallel DNN Training", MLSys 2021, learning-rate rescheduling). The ``k``-th step of
    stage ``i`` is scaled so, by ``(1 + τ_i) ** -(1 - min(k / K, 1))``: as with ``lr / (1 + τ_i)``
    at first, annealed to ``lr`` over ``K = LR_ANNEAL_STEPS`` steps, so deep stages, whose
    gradients are the stalest, take small steps while the weights still move fast.

Both scale the step the optimizer took, never its ``param_groups``' ``lr``: that stays the lr the
factory gave, or that a schedule made in the factory sets (an ``LRScheduler`` stepped by a step
hook of the optimizer), and the two compose: a delayed stage's step is its scale times the step
with the scheduled lr.

``"weight-prediction"``: linear weight prediction, after Kosson et al., "Pipelined
    Backpropagation at Scale: Training Large Models without Batches" (MLSys 2021). A stage runs
    its forward, and the product of that sample's gradient, with its weights extrapolated
    ``τ_i`` steps ahead along their recent velocity (a moving average of the change per step),
    so that a gradient is computed at about the weights it will be applied to.

``"delay-correction"``: the late gradient corrected, to first order, for the steps the stage
    took while it was on its way, after DC-ASGD (Zheng et al., "Asynchronous Stochastic Gradient
    Descent with Delay Compensation", ICML 2017). Its Taylor expansion
    ``g(θ_now) ≈ g + H (θ_now − θ_then)`` needs the Hessian ``H``; DC-ASGD takes ``λ g gᵀ``, the
    outer product of the gradient with itself times a tuned ``λ``, and keeps only its diagonal.
    Here it is kept whole within each output unit of a layer (a convolution's filter with its
    bias, a linear layer's row) and dropped between units, so that each unit's part ``g_u`` of
    the gradient is scaled by ``1 + λ g_uᵀ(θ_u now − θ_u then)``, clipped to
    ``[DELAY_CORRECTION_FLOOR, 1]``. When a unit's steps since the forward already went the way
    ``g_u`` asks (a digit held for several frames sends its gradient again and again),
    ``g_uᵀΔθ_u < 0`` and the late gradient is shrunk by how much of it was already applied. It is
    never enlarged, and never shrunk below ``DELAY_CORRECTION_FLOOR``. It keeps one copy of the
    stage's weights per sample in flight (in ``weight-stash`` mode, the copies that mode stashes
    already). ``λ = DELAY_CORRECTION_STRENGTH`` and the floor were chosen with ``partime fidelity``
    for plain SGD at lr 0.07, and may not suit another optimizer or step size.

With ``D = 1`` every delay is 0 and each is exactly plain online learning.

Measurements, and the variants tried and not kept: docs/measured-and-not-kept.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

COMPENSATIONS = (
    "step-scale",
    "delay-correction",
    "optimizer-prediction",
    "long-momentum",
    "spike",
    "lr-scale",
    "weight-prediction",
)

LR_ANNEAL_STEPS = 2000
"""Steps over which ``lr-scale`` anneals a stage's step size back to the optimizer's own."""

DELAY_CORRECTION_STRENGTH = 16.0
"""``λ`` of ``delay-correction``: how strongly the steps since a forward shrink its late gradient."""

DELAY_CORRECTION_FLOOR = 0.25
"""The least share of a late gradient that ``delay-correction`` keeps."""

STEP_SCALE_POWER = 1.0
"""``p`` of ``step-scale``: a stage with delay ``τ`` steps with ``lr / (1 + τ) ** p``."""

VELOCITY_MOMENTUM = 0.9
"""How much of its previous value the velocity estimate of ``weight-prediction`` keeps per step."""


AUTO = "auto"
AUTOMATIC = {
    "sgd": ("step-scale", "delay-correction"),
    "momentum": ("step-scale", "optimizer-prediction", "long-momentum"),
    "adam": ("step-scale", "optimizer-prediction", "long-momentum"),
}
"""What ``"auto"`` chooses for each kind of optimizer, from ``partime fidelity``'s measurements
(README, "Learning with delay"): ``step-scale`` keeps every stream learning at the step size
that suits sequential learning best, and beside it the rest did best with that optimizer."""


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """``"sgd"``, ``"momentum"`` or ``"adam"`` (AdamW included); None for any other optimizer."""
    if isinstance(optimizer, torch.optim.SGD):
        return "momentum" if any(group["momentum"] for group in optimizer.param_groups) else "sgd"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    return None


def chosen_compensation(names: Sequence[str], optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The options in force for a stage learning with ``optimizer``: ``names``, with ``"auto"``
    as ``AUTOMATIC`` says for that kind of optimizer (nothing for an optimizer it does not know)."""
    if AUTO not in names:
        return tuple(names)
    return AUTOMATIC.get(optimizer_kind(optimizer) or "", ())


def check_compensation(names: str | Sequence[str]) -> tuple[str, ...]:
    """The compensation options as a tuple; a ValueError naming any unknown one."""
    names = (names,) if isinstance(names, str) else tuple(names)
    if AUTO in names and len(names) > 1:
        raise ValueError(
            f"compensation 'auto' chooses every option itself; give it alone, not with "
            f"{', '.join(repr(n) for n in names if n != AUTO)}"
        )
    for name in names:
        if name == AUTO:
            continue
        if name not in COMPENSATIONS:
            raise ValueError(f"unknown compensation {name!r}; choose 'auto' or any of {', '.join(COMPENSATIONS)}")
    if {"weight-prediction", "optimizer-prediction"} <= set(names):
        raise ValueError(
            "compensations 'weight-prediction' and 'optimizer-prediction' both choose the weights "
            "a forward runs with; give one of them"
        )
    return names


def step_scale(delay: int, power: float | None = None) -> float:
    """The scale of every step of a stage with ``delay`` under ``"step-scale"``: ``(1 + delay) ** -power``."""
    return float((1 + delay) ** -(STEP_SCALE_POWER if power is None else power))


class StepSizeScale:
    """PipeMare's delay-aware step size for one stage (``"lr-scale"``): the scale of each step."""

    def __init__(self, delay: int, anneal_steps: int | None = None):
        self.delay = delay
        self.anneal_steps = LR_ANNEAL_STEPS if anneal_steps is None else anneal_steps
        self.steps = 0

    def factor(self) -> float:
        """The scale of the next step: ``(1 + τ) ** -(1 - min(k / K, 1))``."""
        progress = min(self.steps / self.anneal_steps, 1.0)
        return float((1 + self.delay) ** -(1 - progress))

    def next_factor(self) -> float:
        """The scale of the step about to be taken; the one after is the next step's."""
        factor = self.factor()
        self.steps += 1
        return factor


@torch.no_grad()
def scale_steps(params: Sequence[Tensor], before: Sequence[Tensor], factor: float) -> None:
    """Make the step that took ``params`` from ``before`` ``factor`` times as long.

    ``θ = θ_before + factor · (θ − θ_before)``, as one ``lerp`` from ``θ`` toward ``θ_before``."""
    torch._foreach_lerp_(list(params), list(before), 1.0 - factor)


class WeightPredictor:
    """Kosson et al.'s linear weight prediction for one stage (``"weight-prediction"``)."""

    def __init__(self, params: Sequence[Tensor], delay: int, momentum: float | None = None):
        self.params = list(params)
        self.delay = delay
        self.momentum = VELOCITY_MOMENTUM if momentum is None else momentum
        self.previous = [p.detach().clone() for p in self.params]
        self.velocity = [torch.zeros_like(p) for p in self.params]

    def predict(self) -> list[Tensor]:
        """Leaf copies of the weights, ``τ`` steps ahead along the velocity, for a forward."""
        if self.delay == 0:
            return [p.detach().clone().requires_grad_() for p in self.params]
        return [(p.detach() + self.delay * v).requires_grad_() for p, v in zip(self.params, self.velocity)]

    def after_step(self) -> None:
        """Fold the change of this step into the velocity."""
        with torch.no_grad():
            for p, prev, v in zip(self.params, self.previous, self.velocity):
                v.mul_(self.momentum).add_(p - prev, alpha=1 - self.momentum)
                prev.copy_(p)


class DelayCorrection:
    """DC-ASGD's correction of a late gradient, one factor per output unit (``"delay-correction"``).

    A stage's parameters fall into output units: row ``r`` of every parameter of one layer whose
    first dimension has the same length (a convolution's filter ``r`` and its bias ``r``; a
    linear layer's output ``r``). ``anchor()`` copies the weights when a sample goes forward;
    ``correct(anchor)``, called with the gradient of that sample in the parameters' ``.grad``,
    scales each unit's part ``g_u`` of it in place by
    ``clip(1 + λ g_uᵀ(θ_u now − θ_u at the anchor), floor, 1)`` with ``λ = strength``, and returns
    the factors, one tensor per layer's units.

    With the ``optimizer`` that steps the parameters, a parameter of a group that maximizes
    (``maximize=True``, whose step goes along ``+g``) has ``−g_uᵀΔθ_u`` in its factor: the steps
    since went the way its gradient asks when that product is positive. Maximizing ``−loss`` is then
    corrected exactly as minimizing ``loss``. Without it every parameter is taken to minimize.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, Tensor]],
        strength: float | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ):
        self.params = [p for _, p in named]
        self.strength = DELAY_CORRECTION_STRENGTH if strength is None else strength
        self.groups = output_units(named)  # the parameters that share one set of units
        groups = optimizer.param_groups if optimizer is not None else []
        ascended = {id(p) for group in groups if group.get("maximize", False) for p in group["params"]}
        # whether each parameter's step goes along +g (read once: a group's maximize is set when it is made)
        self.maximize = [id(p) in ascended for p in self.params]

    def anchor(self) -> list[Tensor]:
        """Copies of the weights now, for the gradient of the sample going forward."""
        return [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def correct(self, anchor: Sequence[Tensor]) -> list[Tensor]:
        """Scale the gradients in ``.grad`` for the steps taken since ``anchor``; the factors."""
        factors = []
        for group in self.groups:
            grads = [(i, grad) for i in group if (grad := self.params[i].grad) is not None]
            if not grads:
                continue
            # g_uᵀΔθ_u along the way the optimizer goes: negated where it ascends (exact in floats)
            terms = [_per_row(grad * (self.params[i] - anchor[i])) for i, grad in grads]
            terms = [-t if self.maximize[i] else t for (i, _), t in zip(grads, terms)]
            moved = sum(terms[1:], terms[0])  # a tensor: with a start, sum() never gives its 0
            factor = (1.0 + self.strength * moved).clamp_(DELAY_CORRECTION_FLOOR, 1.0)
            for _, grad in grads:
                grad.mul_(factor.reshape(-1, *([1] * (grad.dim() - 1))) if grad.dim() else factor[0])
            factors.append(factor)
        return factors


def output_units(named: Sequence[tuple[str, Tensor]]) -> list[list[int]]:
    """The parameters (by position in ``named``) that share output units: those of one layer
    (the same name up to its last dot) whose first dimension has the same length."""
    units: dict[tuple[str, int], list[int]] = {}
    for i, (name, param) in enumerate(named):
        layer = name.rpartition(".")[0]
        units.setdefault((layer, _rows(param)), []).append(i)
    return list(units.values())


def _rows(t: Tensor) -> int:
    """How many output units ``t`` holds: the length of its first dimension; a scalar holds one."""
    return t.shape[0] if t.dim() else 1


def _per_row(t: Tensor) -> Tensor:
    """The sum of ``t`` over every dimension but the first, one value per unit."""
    return t.reshape(_rows(t), -1).sum(1)

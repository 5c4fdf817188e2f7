"""Staleness compensation: what a stage can do about learning from late gradients (internal).

Stage ``i`` of a pipeline of depth ``D`` applies each gradient ``τ_i = 2(D - 1 - i)`` steps
after the forward it belongs to (SPEC.md). Three remedies after the literature, each an option of
``Pipeline(compensation=...)`` and each measured by ``partime fidelity`` before it is kept:

``"lr-scale"``: delay-aware step size, after PipeMare (Yang et al., "PipeMare: Asynchronous
    Pipeline Parallel DNN Training", MLSys 2021, learning-rate rescheduling). Stage ``i`` steps
    with ``lr · (1 + τ_i) ** -(1 - min(k / K, 1))`` at its ``k``-th step: ``lr / (1 + τ_i)`` at
    first, annealed to ``lr`` over ``K = LR_ANNEAL_STEPS`` steps, so deep stages, whose
    gradients are the stalest, take small steps while the weights still move fast.

``"weight-prediction"``: linear weight prediction, after Kosson et al., "Pipelined
    Backpropagation at Scale: Training Large Models without Batches" (MLSys 2021). A stage runs
    its forward, and the product of that sample's gradient, with its weights extrapolated
    ``τ_i`` steps ahead along their recent velocity (a moving average of the change per step),
    so that a gradient is computed at about the weights it will be applied to.

``"delay-correction"``: the late gradient corrected, to first order, for the steps the stage
    took while it was on its way, after DC-ASGD (Zheng et al., "Asynchronous Stochastic Gradient
    Descent with Delay Compensation", ICML 2017). Its Taylor expansion
    ``g(θ_now) ≈ g + H (θ_now − θ_then)`` needs the Hessian ``H``; DC-ASGD takes the outer
    product ``g gᵀ`` of the gradient with itself and then keeps only its diagonal. Kept whole,
    the correction is a scalar: ``g · (1 + gᵀ(θ_now − θ_then))``, clipped to ``[0, 1]`` times
    ``g``. When the stage's steps since the forward already went the way ``g`` asks (a digit held
    for several frames sends its gradient again and again), ``gᵀΔθ < 0`` and the late gradient is
    shrunk by how much of it was already applied. It is never enlarged: allowed to, it lost
    half the accuracy on moving digits at D = 8. It keeps one copy of the stage's weights per
    sample in flight (in ``weight-stash`` mode, the copies that mode stashes already).

With ``D = 1`` every delay is 0 and each is exactly plain online learning.

Measured (``partime fidelity``, moving digits at D = 8 with ``stash``, 6 seeds,
``docs/fidelity-d8.md``): ``delay-correction`` brings the gap to sequential online learning from
3.0 to 1.9 points, and on the shuffled control from 12.0 to 3.3; ``lr-scale`` and
``weight-prediction`` widen it (12.4 and 12.0 points on moving digits). At D = 4 on moving
digits ``delay-correction`` does worse than nothing (2.6 points against 1.7, 3 seeds).

Measured and not kept: DC-ASGD's own diagonal form, ``g + λ g ⊙ g ⊙ (θ_now − θ_then)``, gave
no gain on moving digits at D = 4 and 8 (within noise in five configurations).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

COMPENSATIONS = ("lr-scale", "weight-prediction", "delay-correction")

LR_ANNEAL_STEPS = 2000
"""Steps over which ``lr-scale`` anneals a stage's step size back to the optimizer's own."""

VELOCITY_MOMENTUM = 0.9
"""How much of its previous value the velocity estimate of ``weight-prediction`` keeps per step."""


def check_compensation(names: str | Sequence[str]) -> tuple[str, ...]:
    """The compensation options as a tuple; a ValueError naming any unknown one."""
    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        if name not in COMPENSATIONS:
            raise ValueError(f"unknown compensation {name!r}; choose from {', '.join(COMPENSATIONS)}")
    return names


def delay(stage: int, depth: int) -> int:
    """Steps between a sample's forward at ``stage`` and the step that applies its gradient."""
    return 2 * (depth - 1 - stage)


class StepSizeScale:
    """PipeMare's delay-aware step size for one stage's optimizer (``"lr-scale"``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, delay: int, anneal_steps: int | None = None):
        self.optimizer = optimizer
        self.delay = delay
        self.anneal_steps = LR_ANNEAL_STEPS if anneal_steps is None else anneal_steps
        self.base = [group["lr"] for group in optimizer.param_groups]
        self.steps = 0

    def factor(self) -> float:
        """The scale of the next step: ``(1 + τ) ** -(1 - min(k / K, 1))``."""
        progress = min(self.steps / self.anneal_steps, 1.0)
        return float((1 + self.delay) ** -(1 - progress))

    def before_step(self) -> None:
        """Set every group's learning rate for the coming step."""
        factor = self.factor()
        for group, base in zip(self.optimizer.param_groups, self.base):
            group["lr"] = base * factor
        self.steps += 1


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
    """DC-ASGD's correction of a late gradient with the full outer product (``"delay-correction"``).

    ``anchor()`` copies the weights when a sample goes forward; ``correct(anchor)``, called with
    the gradient of that sample in the parameters' ``.grad``, scales it in place by
    ``clip(1 + gᵀ(θ_now − θ_anchor), 0, 1)`` and returns the factor.
    """

    def __init__(self, params: Sequence[Tensor]):
        self.params = list(params)

    def anchor(self) -> list[Tensor]:
        """Copies of the weights now, for the gradient of the sample going forward."""
        return [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def correct(self, anchor: Sequence[Tensor]) -> float:
        """Scale the gradients in ``.grad`` for the steps taken since ``anchor``; the factor."""
        moved = sum((p.grad * (p - then)).sum() for p, then in zip(self.params, anchor) if p.grad is not None)
        factor = min(max(1.0 + float(moved), 0.0), 1.0)
        if factor != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(factor)
        return factor

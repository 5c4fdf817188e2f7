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
    already), and one more to work in. ``λ = DELAY_CORRECTION_STRENGTH`` and the floor were chosen with ``partime fidelity``
    for plain SGD at lr 0.07, and may not suit another optimizer or step size.

With ``D = 1`` every delay is 0 and each is exactly plain online learning.

Measurements, and the variants tried and not kept: experiments/measured-and-not-kept.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from ..optim import MuonWithAdamW

Compensation = Literal[
    "step-scale",
    "delay-correction",
    "optimizer-prediction",
    "long-momentum",
    "spike",
    "lr-scale",
    "weight-prediction",
]
"""One compensation option, for a type checker: the values of ``COMPENSATIONS``."""
Compensations = Literal["auto"] | Compensation | Sequence[Compensation]
"""What ``Pipeline(compensation=...)`` takes: ``"auto"``, one option, or a sequence of them (``()`` for none)."""
COMPENSATIONS: tuple[Compensation, ...] = (
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


AUTO: Literal["auto"] = "auto"
AUTOMATIC = {
    "sgd": ("step-scale", "delay-correction"),
    "momentum": ("step-scale", "optimizer-prediction", "long-momentum"),
    "adam": ("step-scale", "optimizer-prediction", "long-momentum"),
    "nadam": ("step-scale",),
    "muon": ("step-scale",),
}
"""What ``"auto"`` chooses for each kind of optimizer, from ``partime fidelity``'s measurements
(docs/results/fidelity.md, docs/guides/compensation.md): ``step-scale`` keeps every stream learning at the step size
that suits sequential learning best, and beside it the rest did best with that optimizer. NAdam
(β1 = 0.99) and Muon were measured with ``step-scale`` and with nothing
(experiments/learning/optimizers.md); the options that read the optimizer's state do not know them."""


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """``"sgd"``, ``"momentum"``, ``"adam"`` (AdamW included), ``"nadam"`` or ``"muon"``
    (``torch.optim.Muon``, ``partime.optim.MuonWithAdamW``); None for any other optimizer."""
    if isinstance(optimizer, torch.optim.SGD):
        return "momentum" if any(group["momentum"] for group in optimizer.param_groups) else "sgd"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    if isinstance(optimizer, torch.optim.NAdam):
        return "nadam"
    if isinstance(optimizer, (torch.optim.Muon, MuonWithAdamW)):
        return "muon"
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


def steps_along_the_gradient(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every step of ``optimizer`` is ``lr`` times its gradients and nothing else: plain
    ``torch.optim.SGD`` (no momentum, no weight decay), which keeps no state. Scaling the gradients
    of such an optimizer by ``f`` then scales its step by ``f``, as ``scale_steps`` would, up to
    the last bits; whatever lr a schedule sets in the step."""
    return type(optimizer) is torch.optim.SGD and all(
        not group["momentum"] and not group["weight_decay"] for group in optimizer.param_groups
    )


def same_kind(tensors: Sequence[Tensor]) -> bool:
    """Whether ``tensors`` (at least one) share one dtype and one device: ``detached_copies`` may
    then copy them ``together``."""
    return len(tensors) > 0 and len({(t.dtype, t.device) for t in tensors}) == 1


def detached_copies(tensors: Sequence[Tensor], together: bool) -> list[Tensor]:
    """Detached copies of ``tensors``, equal to them and of their shapes; with ``together`` (only
    if ``same_kind(tensors)``) in one pass, as views of one new buffer."""
    with torch.no_grad():
        if not together or len(tensors) == 1:  # torch's flattening of a single tensor is a view of it
            return [t.detach().clone() for t in tensors]
        flat = torch._utils._flatten_dense_tensors(tensors)
        return list(torch._utils._unflatten_dense_tensors(flat, tensors))


class WeightPredictor:
    """Kosson et al.'s linear weight prediction for one stage (``"weight-prediction"``)."""

    def __init__(self, params: Sequence[Tensor], delay: int, momentum: float | None = None):
        self.params = list(params)
        self.delay = delay
        self.momentum = VELOCITY_MOMENTUM if momentum is None else momentum
        self.previous = [p.detach().clone() for p in self.params]
        self.velocity = [torch.zeros_like(p) for p in self.params]
        self._together = same_kind(self.params)

    @torch.no_grad()
    def predict(self) -> list[Tensor]:
        """Leaf copies of the weights, ``τ`` steps ahead along the velocity, for a forward."""
        if self.delay == 0:
            ahead = detached_copies(self.params, self._together)
        else:
            ahead = list(torch._foreach_mul(self.velocity, float(self.delay)))
            torch._foreach_add_(ahead, self.params)
        return [a.requires_grad_() for a in ahead]

    @torch.no_grad()
    def after_step(self) -> None:
        """Fold the change of this step into the velocity."""
        torch._foreach_mul_(self.velocity, self.momentum)
        torch._foreach_add_(self.velocity, torch._foreach_sub(self.params, self.previous), alpha=1 - self.momentum)
        torch._foreach_copy_(self.previous, self.params)


class DelayCorrection:
    """DC-ASGD's correction of a late gradient, one factor per output unit (``"delay-correction"``).

    A stage's parameters fall into output units: row ``r`` of every parameter of one layer whose
    first dimension has the same length (a convolution's filter ``r`` and its bias ``r``; a
    linear layer's output ``r``). ``anchor()`` copies the weights when a sample goes forward;
    ``correct(anchor)``, called with the gradient of that sample in the parameters' ``.grad``,
    scales each unit's part ``g_u`` of it in place by
    ``clip(1 + λ g_uᵀ(θ_u now − θ_u at the anchor), floor, 1)`` with ``λ = strength``, and returns
    the factors, one tensor per layer's units (of the layers with a gradient; a parameter whose
    ``.grad`` is None is left so, and takes no part in its unit's factor).

    With the ``optimizer`` that steps the parameters, a parameter of a group that maximizes
    (``maximize=True``, whose step goes along ``+g``) has ``−g_uᵀΔθ_u`` in its factor: the steps
    since went the way its gradient asks when that product is positive. Maximizing ``−loss`` is then
    corrected exactly as minimizing ``loss``. Without it every parameter is taken to minimize.

    Both run a fixed number of fused torch calls for the whole stage, however many layers it has:
    ``anchor()`` copies the weights in one pass, and ``correct`` sums the products row by row and
    the rows into units over all parameters at once, with a layout of the rows made once for each
    set of parameters that have a gradient (``UnitLayout``).
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
        self._together = same_kind(self.params)
        self._layouts: dict[tuple[bool, ...], UnitLayout] = {}  # by which parameters have a gradient

    def anchor(self) -> list[Tensor]:
        """Copies of the weights now, for the gradient of the sample going forward."""
        return detached_copies(self.params, self._together)

    @torch.no_grad()
    def correct(self, anchor: Sequence[Tensor]) -> list[Tensor]:
        """Scale the gradients in ``.grad`` for the steps taken since ``anchor``; the factors."""
        grads = [p.grad for p in self.params]
        has = tuple(g is not None for g in grads)
        layout = self._layouts.get(has)
        if layout is None:
            layout = self._layouts[has] = UnitLayout(self, has)
        if not layout.positions:
            return []
        present = [g for g in grads if g is not None]
        if len(present) == len(grads):
            params, anchors = self.params, list(anchor)
        else:
            params = [self.params[i] for i in layout.positions]
            anchors = [anchor[i] for i in layout.positions]
        # g·Δθ element by element, summed per row, then per unit: the rows of a unit in the
        # order of the parameters, as a sum per layer would add them
        torch._foreach_copy_(layout.product_views, params)
        torch._foreach_sub_(layout.product_views, anchors)
        torch._foreach_mul_(layout.product_views, present)
        rows = torch.segment_reduce(layout.products, "sum", lengths=layout.lengths, unsafe=True)
        if layout.signs is not None:  # along the way the optimizer goes: negated where it ascends (exact)
            rows.mul_(layout.signs)
        units = rows.new_zeros(layout.units).index_add_(0, layout.row_units, rows)
        units.mul_(self.strength).add_(1.0).clamp_(DELAY_CORRECTION_FLOOR, 1.0)
        torch.index_select(units, 0, layout.row_units, out=layout.row_factors)
        torch._foreach_mul_(present, layout.row_factor_views)
        return list(units.split(layout.unit_counts))


class UnitLayout:
    """How ``DelayCorrection.correct`` reads the parameters that have a gradient (``positions``),
    made once for each set of them, with the buffers it works in.

    ``products`` holds one value per element of those parameters, one parameter after another
    (``product_views``: each parameter's part, of its shape), so that a row of a parameter is a
    run of ``lengths`` values in it, part of unit ``row_units`` (units numbered layer by layer,
    over the layers with a gradient: ``unit_counts`` of them per layer) and counted with the
    sign ``signs`` (−1 where its group maximizes; None if none does). ``row_factors`` holds one
    value per row, ``row_factor_views`` each parameter's part, shaped to broadcast over its rows.
    Besides ``products``, which has the parameters' size, everything has one value per row.
    """

    def __init__(self, correction: DelayCorrection, has: Sequence[bool]):
        params = correction.params
        first_unit: dict[int, int] = {}  # of each parameter with a gradient
        self.unit_counts: list[int] = []
        for group in correction.groups:
            members = [i for i in group if has[i]]
            for i in members:
                first_unit[i] = sum(self.unit_counts)
            if members:
                self.unit_counts.append(_rows(params[members[0]]))
        self.positions = sorted(first_unit)
        self.units = sum(self.unit_counts)
        lengths: list[int] = []
        row_units: list[int] = []
        signs: list[float] = []
        for i in self.positions:
            rows = _rows(params[i])
            lengths += [params[i].numel() // rows if rows else 0] * rows
            row_units += range(first_unit[i], first_unit[i] + rows)
            signs += [-1.0 if correction.maximize[i] else 1.0] * rows
        kept = [params[i] for i in self.positions]
        device = kept[0].device if kept else None
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in kept)) if kept else None
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=device)
        self.row_units = torch.tensor(row_units, dtype=torch.long, device=device)
        self.signs = torch.tensor(signs, dtype=dtype, device=device) if -1.0 in signs else None
        self.products = torch.empty(sum(p.numel() for p in kept), dtype=dtype, device=device)
        self.product_views = list(torch._utils._unflatten_dense_tensors(self.products, kept))
        self.row_factors = torch.empty(len(row_units), dtype=dtype, device=device)
        row_shapes = [torch.empty(p.shape[:1] + (1,) * (p.dim() - 1), device="meta") for p in kept]
        self.row_factor_views = list(torch._utils._unflatten_dense_tensors(self.row_factors, row_shapes))


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

"""How a model is cut into stages.

A model is an ``nn.Sequential``; a *balance* says how many of its top-level children each
stage gets, in order. ``check_balance`` says whether a balance can cut a model, ``split``
makes the stages, ``profile_layers`` measures each child, ``best_split`` chooses the balance
whose slowest stage, hops included (``hop_cost``), is fastest, and ``plan`` puts these together
(with ``planner`` for a number of stages or ``"auto"``) into a ``Partition``, which also says
what each stage is predicted to take. No cut separates two children that share a tensor (see
``ties``).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from numbers import Real

from torch import nn

from ..traced.fused import fused
from ..traced.tracing import balance_hint
from . import balance as balance_rules
from .balance import Balance, is_int
from .hop_cost import stage_hop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Partition:
    """How a model is cut: layers per stage, and (when profiled) what each stage is predicted to take.

    ``balance[i]`` is the number of top-level children in stage ``i``; ``layer_times[k]``, when
    given, is the measured time in seconds of child ``k``; ``hop_times[k - 1]``, when given, the
    seconds per tick that the boundary at cut position ``k`` (before child ``k``) costs each stage
    beside it, and ``overhead`` the seconds per tick of a stage's own work in a pipeline of two or
    more (see ``hop_cost``); ``sequential_time`` the predicted seconds per sample of the whole model in
    one stage, by default ``sum(layer_times)``. All are validated on construction.
    """

    balance: tuple[int, ...]
    layer_times: tuple[float, ...] | None = None
    hop_times: tuple[float, ...] | None = None
    overhead: float = 0.0
    sequential_time: float | None = None

    def __post_init__(self) -> None:
        balance = tuple(self.balance)
        if not balance or not all(is_int(b) and b >= 1 for b in balance):
            raise ValueError(f"balance must be one or more positive ints, got {list(balance)}")
        object.__setattr__(self, "balance", tuple(int(b) for b in balance))
        n = sum(self.balance)
        if self.layer_times is None:
            if (self.hop_times, self.overhead, self.sequential_time) != (None, 0.0, None):
                raise ValueError(
                    "hop_times, overhead and sequential_time are predictions of a profiled partition: "
                    f"give layer_times too (balance: {list(self.balance)})"
                )
            return
        times = tuple(float(t) for t in self.layer_times)
        if len(times) != n:
            raise ValueError(
                "layer_times and sum of balance differ "
                f"(layer_times: {len(times)}, sum of balance: {n}, balance: {list(self.balance)})"
            )
        hops = None if self.hop_times is None else tuple(float(t) for t in self.hop_times)
        if hops is not None and (len(hops) != n - 1 or not all(_seconds(t) for t in hops)):
            raise ValueError(
                f"hop_times must be {n - 1} finite numbers >= 0, one per cut position of {n} layers, "
                f"got {list(self.hop_times or ())}"
            )
        sequential = sum(times) if self.sequential_time is None else self.sequential_time
        for name, value in (("overhead", self.overhead), ("sequential_time", sequential)):
            if not _seconds(value):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        for name, checked in (("layer_times", times), ("hop_times", hops), ("overhead", float(self.overhead))):
            object.__setattr__(self, name, checked)
        object.__setattr__(self, "sequential_time", float(sequential))

    @property
    def depth(self) -> int:
        """The number of stages."""
        return len(self.balance)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` child indices of each stage, stop exclusive; they tile the model."""
        out, start = [], 0
        for b in self.balance:
            out.append((start, start + b))
            start += b
        return tuple(out)

    @property
    def stage_times(self) -> tuple[float, ...] | None:
        """Predicted compute seconds per stage (sum of its children's times); None if not profiled."""
        if self.layer_times is None:
            return None
        return tuple(sum(self.layer_times[a:b]) for a, b in self.bounds)

    @property
    def hop_costs(self) -> tuple[float, ...] | None:
        """Predicted seconds per tick each stage spends on its boundaries (``hop_cost.stage_hop``), or None."""
        if self.layer_times is None:
            return None
        n = len(self.layer_times)
        return tuple(stage_hop(a, b, n, self.hop_times, self.overhead) for a, b in self.bounds)

    @property
    def predicted_times(self) -> tuple[float, ...] | None:
        """Predicted seconds per sample of each stage, compute plus hop as ``best_split`` adds them, or None."""
        stages, hops = self.stage_times, self.hop_costs
        return None if stages is None or hops is None else tuple(t + h for t, h in zip(stages, hops, strict=True))

    @property
    def predicted_time(self) -> float | None:
        """Predicted seconds per sample of the pipeline: that of its slowest stage, hops included."""
        return None if self.predicted_times is None else max(self.predicted_times)

    @property
    def bound(self) -> float | None:
        """The fastest this cut could run, seconds per sample: the slowest stage's compute alone
        (hops free). Not the sequential time over the depth, which no uneven cut reaches."""
        return None if self.stage_times is None else max(self.stage_times)

    def __str__(self) -> str:
        text = f"{self.depth} stage{'s' if self.depth != 1 else ''}: {list(self.balance)} layers"
        times = self.predicted_times
        if times is None:
            return text
        scale, unit = time_unit(max(times))
        return text + ", predicted " + " / ".join(f"{t * scale:.2f}" for t in times) + f" {unit}"

    def summary(self) -> str:
        """A few lines for a person: each stage's predicted time per sample (compute + hop), the
        pipeline's (its slowest stage), the bound (the slowest compute, hops free) and the
        sequential time, with the speed-up they predict. ``str(self)`` if not profiled."""
        stages, hops, total, seq = self.stage_times, self.hop_costs, self.predicted_time, self.sequential_time
        if stages is None or hops is None or total is None or seq is None:
            return str(self)
        scale, unit = time_unit(max(total, seq))
        lines = [f"{self.depth} stage{'s' if self.depth != 1 else ''}: {list(self.balance)} layers"]
        lines += [
            f"  stage {i}: {(c + h) * scale:.3f} {unit} per sample = {c * scale:.3f} compute + {h * scale:.3f} hop"
            for i, (c, h) in enumerate(zip(stages, hops, strict=True))
        ]
        lines.append(
            f"  pipeline: {total * scale:.3f} {unit} per sample (its slowest stage), bound {max(stages) * scale:.3f} "
            f"{unit} (the slowest compute, hops free), sequential {seq * scale:.3f} {unit}: "
            f"{seq / total if total > 0 else math.inf:.2f}x predicted"
        )
        return "\n".join(lines)


def check_balance(model: nn.Sequential, balance: Balance) -> None:
    """``balance.check_balance``: a TypeError or ValueError naming the actual values unless ``balance``
    cuts ``model``. For a traced model's layers a ValueError also counts them and names their nodes,
    numbered in order (``traced.balance_hint``), so that a balance can be counted out on them."""
    try:
        balance_rules.check_balance(model, balance)
    except ValueError as exc:
        hint = "" if isinstance(balance, str) else balance_hint(model)
        if not hint:
            raise
        raise ValueError(f"{exc}; {hint}") from None


def split(model: nn.Sequential, balance: Sequence[int]) -> list[nn.Module]:
    """The stages of ``model`` cut by ``balance`` (layers per stage).

    Each stage is an ``nn.Sequential`` of a contiguous run of the model's children, in order,
    under the model's own child names (a traced model's run of nodes: one ``traced.fused.Fused``). The children are the model's own modules, not copies:
    training a stage trains the model, and running the stages one after another computes what
    the model computes.
    """
    if is_int(balance):
        raise TypeError(
            f"split needs the layers of each stage, e.g. [2, 3], got the int {balance}; "
            "use plan() to choose them for a number of stages"
        )
    check_balance(model, balance)
    # _modules rather than named_children(): the latter skips a module that appears twice.
    children = list(model._modules.items())
    return fused([nn.Sequential(OrderedDict(children[a:b])) for a, b in Partition(tuple(balance)).bounds])


def stage_time_table(
    layer_times: Sequence[float], hop_times: Sequence[float] | None, overhead: float
) -> list[list[float]]:
    """``table[a][b]``: the predicted time of a stage of layers ``a`` to ``b - 1``, its layers'
    times added left to right (as ``sum`` does) plus, when ``hop_times`` or ``overhead`` is given,
    what its boundaries cost it per tick (``hop_cost.stage_hop``), added as
    ``Partition.predicted_times`` adds it. Unchecked: the callers check their arguments."""
    n = len(layer_times)
    table = [[0.0] * (n + 1) for _ in range(n + 1)]
    priced = hop_times is not None or overhead != 0
    for a in range(n):
        total: float = 0
        for b in range(a + 1, n + 1):
            total += layer_times[b - 1]
            table[a][b] = total + stage_hop(a, b, n, hop_times, overhead) if priced else total
    return table


def best_split(
    layer_times: Sequence[float],
    depth: int,
    *,
    forbidden: Collection[int] = (),
    hop_times: Sequence[float] | None = None,
    overhead: float = 0.0,
) -> tuple[int, ...]:
    """The balance cutting ``layer_times`` into ``depth`` contiguous non-empty stages whose slowest
    stage is fastest (exactly, not a heuristic).

    A stage's time is its layers' sum, plus, when ``hop_times`` or ``overhead`` is given, what its
    boundaries cost it per tick (``hop_cost.stage_hop``: ``overhead`` and the cost ``hop_times[k - 1]``
    of each boundary k it touches), so that the cut is the exact optimum with hops counted. Without
    them every stage time is its group sum.

    Ties are broken deterministically: among splits with the same slowest stage, the one whose
    stage times, sorted from largest down, are lexicographically smallest (so the second-slowest
    stage is as fast as it can be, and so on); among those, the lexicographically smallest
    balance (fewer layers in earlier stages). Group sums are added left to right, as ``sum``
    does, and the hop cost added to them as ``Partition.predicted_times`` adds it, so the stage
    times compared are exactly those of the ``Partition``.

    No cut falls at a position in ``forbidden`` (position k cuts between layers k - 1 and k,
    1 <= k < len(layer_times)): the result is the best, by the same order, of the splits that
    avoid them all. A ValueError if none does.
    """
    times = list(layer_times)
    n = len(times)
    bad = [t for t in times if not _seconds(t)]
    if n == 0 or bad:
        raise ValueError(f"layer_times must be one or more finite numbers >= 0, got {times}")
    if not is_int(depth) or not 1 <= depth <= n:
        raise ValueError(f"cannot cut {n} layers into {depth!r} stages: depth must be an int from 1 to {n}")
    hops = None if hop_times is None else list(hop_times)
    if hops is not None and (len(hops) != n - 1 or not all(_seconds(t) for t in hops)):
        raise ValueError(f"hop_times must be {n - 1} finite numbers >= 0 for {n} layers, got {hops}")
    if not _seconds(overhead):
        raise ValueError(f"overhead must be a finite number of seconds >= 0, got {overhead!r}")
    banned = set(forbidden)
    outside = [k for k in forbidden if not (is_int(k) and 1 <= k < n)]
    if outside:
        raise ValueError(f"forbidden cuts must be ints from 1 to {n - 1} for {n} layers, got {outside}")
    if depth - 1 > n - 1 - len(banned):
        raise ValueError(
            f"cannot cut {n} layers into {depth} stages without cutting at {sorted(banned)}: "
            f"{depth} stages need {depth - 1} of the {n - 1} positions, and only "
            f"{n - 1 - len(banned)} are left"
        )
    seg = stage_time_table(times, hops, overhead)
    # best[b] holds, for the first b layers cut into k groups, the key (times sorted from largest
    # down, balance) of the best such cut. Appending one more group to two cuts keeps their
    # order under this key, so the best cut of b layers extends a best cut of some prefix.
    # The first k - 1 groups end at a, the new cut: one in ``banned`` is never taken, and b is
    # absent when no allowed cut of its first b layers into k groups exists.
    best: dict[int, tuple[tuple[float, ...], tuple[int, ...]]]
    best = {b: ((seg[0][b],), (b,)) for b in range(1, n + 1)}
    for k in range(2, depth + 1):
        longer: dict[int, tuple[tuple[float, ...], tuple[int, ...]]] = {}
        for b in range(k, n + 1):
            ends = [a for a in range(k - 1, b) if a in best and a not in banned]
            if ends:
                longer[b] = min(
                    (tuple(sorted(best[a][0] + (seg[a][b],), reverse=True)), best[a][1] + (b - a,)) for a in ends
                )
        best = longer
    return best[n][1]


def _seconds(t: object) -> bool:
    """Whether ``t`` is a number of seconds: real, finite and >= 0."""
    return isinstance(t, Real) and not isinstance(t, bool) and math.isfinite(t) and float(t) >= 0


def time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"

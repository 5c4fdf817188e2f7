"""How a model is cut into stages (internal module).

A model is an ``nn.Sequential``; a *balance* says how many of its top-level children each
stage gets, in order. ``check_balance`` says whether a balance can cut a model, ``split``
makes the stages, ``profile_layers`` measures each child, ``best_split`` chooses the balance
whose slowest stage is fastest, and ``plan`` puts these together into a ``Partition``.
No cut separates two children that share a tensor (see ``ties``).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from numbers import Real

from torch import nn

from partime.balance import _is_int, check_balance
from partime.profiling import Sample, profile_layers
from partime.ties import tied_cuts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Partition:
    """How a model is cut: layers per stage, and (when profiled) the predicted time of each stage.

    ``balance[i]`` is the number of top-level children in stage ``i``; ``layer_times[k]``, when
    given, is the measured time in seconds of child ``k``. Both are validated on construction.
    """

    balance: tuple[int, ...]
    layer_times: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        balance = tuple(self.balance)
        if not balance or not all(_is_int(b) and b >= 1 for b in balance):
            raise ValueError(f"balance must be one or more positive ints, got {list(balance)}")
        object.__setattr__(self, "balance", tuple(int(b) for b in balance))
        if self.layer_times is not None:
            times = tuple(float(t) for t in self.layer_times)
            if len(times) != sum(self.balance):
                raise ValueError(
                    "layer_times and sum of balance differ "
                    f"(layer_times: {len(times)}, sum of balance: {sum(self.balance)}, "
                    f"balance: {list(self.balance)})"
                )
            object.__setattr__(self, "layer_times", times)

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
        """Predicted seconds per stage (sum of its children's times); None if not profiled."""
        if self.layer_times is None:
            return None
        return tuple(sum(self.layer_times[a:b]) for a, b in self.bounds)

    def __str__(self) -> str:
        text = f"{self.depth} stage{'s' if self.depth != 1 else ''}: {list(self.balance)} layers"
        times = self.stage_times
        if times is None:
            return text
        scale, unit = _time_unit(max(times))
        return text + ", predicted " + " / ".join(f"{t * scale:.2f}" for t in times) + f" {unit}"


def split(model: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """The stages of ``model`` cut by ``balance`` (layers per stage).

    Each stage is an ``nn.Sequential`` of a contiguous run of the model's children, in order,
    under the model's own child names. The children are the model's own modules, not copies:
    training a stage trains the model, and running the stages one after another computes what
    the model computes.
    """
    if _is_int(balance):
        raise TypeError(
            f"split needs the layers of each stage, e.g. [2, 3], got the int {balance}; "
            "use plan() to choose them for a number of stages"
        )
    check_balance(model, balance)
    # _modules rather than named_children(): the latter skips a module that appears twice.
    children = list(model._modules.items())
    return [nn.Sequential(OrderedDict(children[a:b])) for a, b in Partition(tuple(balance)).bounds]


def best_split(layer_times: Sequence[float], depth: int, *, forbidden: Collection[int] = ()) -> tuple[int, ...]:
    """The balance cutting ``layer_times`` into ``depth`` contiguous non-empty groups whose largest
    group sum is smallest (exactly, not a heuristic).

    Ties are broken deterministically: among splits with the same largest sum, the one whose
    group sums, sorted from largest down, are lexicographically smallest (so the second-slowest
    stage is as fast as it can be, and so on); among those, the lexicographically smallest
    balance (fewer layers in earlier stages). Group sums are added left to right, as ``sum``
    does, so they equal ``sum(layer_times[a:b])`` exactly.

    No cut falls at a position in ``forbidden`` (position k cuts between layers k - 1 and k,
    1 <= k < len(layer_times)): the result is the best, by the same order, of the splits that
    avoid them all. A ValueError if none does.
    """
    times = list(layer_times)
    n = len(times)
    bad = [t for t in times if not (isinstance(t, Real) and math.isfinite(t) and t >= 0)]
    if n == 0 or bad:
        raise ValueError(f"layer_times must be one or more finite numbers >= 0, got {times}")
    if not _is_int(depth) or not 1 <= depth <= n:
        raise ValueError(f"cannot cut {n} layers into {depth!r} stages: depth must be an int from 1 to {n}")
    banned = set(forbidden)
    outside = [k for k in forbidden if not (_is_int(k) and 1 <= k < n)]
    if outside:
        raise ValueError(f"forbidden cuts must be ints from 1 to {n - 1} for {n} layers, got {outside}")
    if depth - 1 > n - 1 - len(banned):
        raise ValueError(
            f"cannot cut {n} layers into {depth} stages without cutting at {sorted(banned)}: "
            f"{depth} stages need {depth - 1} of the {n - 1} positions, and only "
            f"{n - 1 - len(banned)} are left"
        )
    # seg[a][b] = sum(times[a:b]), added left to right.
    seg = [[0.0] * (n + 1) for _ in range(n + 1)]
    for a in range(n):
        total: float = 0
        for b in range(a + 1, n + 1):
            total += times[b - 1]
            seg[a][b] = total
    # best[b] holds, for the first b layers cut into k groups, the key (sums sorted from largest
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


def plan(
    model: nn.Sequential,
    balance: int | Sequence[int],
    sample: Sample | None = None,
    *,
    learning: bool = False,
) -> Partition:
    """How to cut ``model``: ``balance`` as given if it lists layers per stage (not profiled), or,
    if it is a number of stages D, a cut of the child times profiled on ``sample``, with those
    times: for inference (forward times) the ``best_split``; when ``learning`` (forward and
    backward times), the ``delay_cut.delay_aware_split``, which keeps the layers with the most
    weights out of the early, delayed stages at a cost of at most ``DELAY_SLACK`` in speed.

    Either way no cut separates two children that share a tensor (``tied_cuts``): a list
    balance that would is refused, and D stages are chosen among the cuts that do not.
    """
    check_balance(model, balance)
    if isinstance(balance, Sequence):
        partition = Partition(tuple(int(b) for b in balance))
    else:
        if sample is None:
            raise ValueError(
                f"balance={balance} needs a sample to profile the model on to choose the cuts: "
                "pass sample=, or let the pipeline profile on the first streamed sample, "
                "or give the layers of each stage (e.g. balance=[2, 3])"
            )
        times = profile_layers(model, sample, learning=learning)
        forbidden = frozenset(tied_cuts(model))
        if learning:
            # delay_cut builds on best_split: imported here, not above
            from .delay_cut import delay_aware_split

            params = [sum(p.numel() for p in child.parameters() if p.requires_grad) for child in model]
            cut = delay_aware_split(times, params, int(balance), forbidden=forbidden)
            partition = Partition(cut, times)
        else:
            partition = Partition(best_split(times, int(balance), forbidden=forbidden), times)
    log.info("partition: %s", partition)
    return partition


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"

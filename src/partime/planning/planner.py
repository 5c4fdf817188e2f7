"""How many stages, and where to cut, by predicted throughput.

A stage's predicted time per sample is its layers' compute plus what its boundaries cost it at
every tick (``hop_cost``: the Python work of a tick and the copies of what crosses each boundary it
touches); a pipeline's is that of its slowest stage, and one stage alone, the model as it is, pays
no hop. ``choose_depth`` is the pure choice over such profiles: the depth and the cut whose
slowest stage is fastest, unless no pipeline beats one stage by ``AUTO_MARGIN``. ``plan_timed``
profiles a model and puts the choice into a ``Partition``, for ``balance=D`` (the cut alone) or
``balance="auto"`` (the depth as well, up to ``usable_cores()``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from . import hop_cost
from .balance import AUTO, Balance, is_int
from .partition import Partition, best_split, check_balance, time_unit
from .profiling import Sample, profile_layers
from .steady_cut import steady_split
from .ties import held_together, tied_cuts

log = logging.getLogger(__name__)

AUTO_MARGIN = 0.1
"""How much faster than one stage a pipeline must be predicted to run for ``"auto"`` to take it:
10% more samples per second. Below that the prediction's error (timings on a busy machine, the work
of a tick not counted) could make the pipeline slower than the model run as it is."""

Profile = Callable[..., tuple[float, ...]]
"""Times each layer once, as ``profile_layers`` does: called with ``on_output=`` (a ``HopMeter`` or None)."""


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the system says, else ``os.cpu_count()``."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def choose_depth(
    layer_times: Sequence[float] | Mapping[int, Sequence[float]],
    hop_times: Sequence[float] | None,
    *,
    max_depth: int | None = None,
    forbidden: Collection[int] = (),
    overhead: float | None = None,
    margin: float = AUTO_MARGIN,
) -> Partition:
    """The depth from 1 to ``max_depth`` and the cut whose predicted time per sample (its slowest
    stage, hops included: ``best_split``) is smallest, ties to fewer stages; or one stage, with
    the reason logged at INFO, unless that time times ``1 + margin`` is at most the sequential
    time (the layers' sum at depth 1, no hop). The choice is logged at INFO with the predicted
    time of every depth.

    ``layer_times`` are the layer times, or for each depth those its stages would run at (with
    their thread count); ``hop_times[k - 1]`` is the cost per tick of the boundary at cut
    position k (None: free), ``overhead`` the work of a tick in a pipeline of two or more
    (default ``hop_cost.TICK_OVERHEAD_S``, read now). ``max_depth`` (default: the number of layers, or
    the deepest a mapping gives) is lowered to what ``forbidden`` cut positions leave. Pure: no
    timing, no torch.
    """
    overhead = hop_cost.TICK_OVERHEAD_S if overhead is None else overhead
    hop_times = None if hop_times is None else tuple(hop_times)
    if max_depth is not None and (not is_int(max_depth) or max_depth < 1):
        raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")
    if isinstance(layer_times, Mapping):
        profiles = {d: tuple(t) for d, t in layer_times.items()}
        limit = max_depth or max(profiles, default=1)
    else:
        limit = max_depth or max(1, len(layer_times))
        profiles = {d: tuple(layer_times) for d in range(1, limit + 1)}
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < float("inf"):
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
    n = len(profiles.get(1, ()))
    ties = len(set(forbidden))
    top = max(1, min(limit, n - ties))
    missing = [d for d in range(1, top + 1) if n == 0 or len(profiles.get(d, ())) != n]
    if missing:
        lengths = {d: len(t) for d, t in sorted(profiles.items())}
        raise ValueError(
            f"layer_times must give one time per layer for every depth from 1 to {top}, the same number "
            f"for each: depths {missing} do not (layers per depth: {lengths})"
        )
    sequential = Partition((n,), profiles[1], hop_times, overhead)
    seq = _predicted(sequential)
    options = [sequential]
    for depth in range(2, top + 1):
        cut = best_split(profiles[depth], depth, forbidden=forbidden, hop_times=hop_times, overhead=overhead)
        options.append(Partition(cut, profiles[depth], hop_times, overhead, seq))
    best = min(options, key=lambda p: (_predicted(p), p.depth))
    scale, unit = time_unit(seq)
    said = f"predicted {unit} per sample: sequential {seq * scale:.3f}" + "".join(
        f", {p.depth} stages {_predicted(p) * scale:.3f}" for p in options[1:]
    )
    if len(options) > 1:
        said += " (hops included)"
    if best.depth > 1 and _predicted(best) * (1 + margin) <= seq:
        log.info("balance=%r: %d stages %s, %s", AUTO, best.depth, list(best.balance), said)
        return best
    if top == 1:
        reason = f"no pipeline can be made (max_depth: {limit}, layers: {n}, tied cut positions: {ties})"
    else:
        reason = f"no pipeline is predicted at least {margin:.0%} faster than sequential"
    log.info("balance=%r: 1 stage, %s; %s", AUTO, reason, said)
    return sequential


def plan_timed(
    model: nn.Sequential,
    balance: int | str,
    profile: Profile,
    *,
    learning: bool,
    threads: Callable[[int], int] | None = None,
) -> Partition:
    """The ``Partition`` of ``model`` for ``balance`` (a number of stages, or ``"auto"``), with its
    predictions, from the layer times ``profile`` measures and the boundary costs ``HopMeter``
    measures during the first of them (``plan`` calls it; ``balance`` is checked there).

    D stages: the ``steady_split`` cut (hops, tied cuts, boundary bytes and, when ``learning``,
    the weights counted), the layers timed once with the current torch threads. ``"auto"``:
    ``choose_depth`` up to ``usable_cores()`` (and the layers and tied cuts), each depth's layers
    timed with ``threads(depth)`` threads (once per distinct count; default: the current one); its
    cut is then the ``steady_split`` cut for that depth. The tick's work is
    ``hop_cost.TICK_OVERHEAD_S``, read now.
    """
    n, overhead = len(model), hop_cost.TICK_OVERHEAD_S
    forbidden = frozenset(tied_cuts(model))
    params = [sum(p.numel() for p in child.parameters() if p.requires_grad) for child in model] if learning else None
    meter = hop_cost.HopMeter(n, learning=learning)

    def steady(times: Sequence[float], depth: int) -> tuple[int, ...]:
        return steady_split(
            times,
            depth,
            layer_params=params,
            boundary_bytes=meter.nbytes,
            hop_times=meter.hop_times,
            overhead=overhead,
            forbidden=forbidden,
        )

    if balance != AUTO:
        times = profile(on_output=meter)
        partition = Partition(steady(times, int(balance)), times, meter.hop_times, overhead)
        if forbidden:
            _warn_if_tied_out(model, partition, forbidden)
    else:
        top = max(1, min(usable_cores(), n - len(forbidden)))
        counts = {d: torch.get_num_threads() if threads is None else threads(d) for d in range(1, top + 1)}
        by_count: dict[int, tuple[float, ...]] = {}
        for count in counts.values():
            if count not in by_count:  # the boundaries are timed once, with the first count
                with torch_threads(count):
                    by_count[count] = profile(on_output=None if by_count else meter)
        profiles = {d: by_count[count] for d, count in counts.items()}
        partition = choose_depth(profiles, meter.hop_times, max_depth=top, forbidden=forbidden, overhead=overhead)
        if partition.depth > 1:
            times = profiles[partition.depth]
            cut = steady(times, partition.depth)
            partition = Partition(cut, times, meter.hop_times, overhead, partition.sequential_time)
    log.debug("boundary bytes per tick: %s", meter.nbytes)
    return partition


def _warn_if_tied_out(model: nn.Sequential, partition: Partition, forbidden: Collection[int]) -> None:
    """Log a warning if no cut of ``model`` into D stages that avoids the ``forbidden`` tied cut
    positions (``partition`` is the one chosen, profiled) is predicted ``AUTO_MARGIN`` faster than
    the model as one stage, while a cut through a tie would be: the shared tensor keeps every
    useful cut out (a tied language-model head cuts a transformer after its first node), and the
    user asked for a pipeline. A warning, not an error: the results are right, and a refusal would
    turn on timings."""
    assert partition.layer_times is not None and partition.sequential_time is not None, "a profiled partition"
    times, hops, overhead, depth = partition.layer_times, partition.hop_times, partition.overhead, partition.depth
    sequential, got = partition.sequential_time, _predicted(partition)
    allowed = best_split(times, depth, forbidden=forbidden, hop_times=hops, overhead=overhead)
    if _predicted(Partition(allowed, times, hops, overhead)) * (1 + AUTO_MARGIN) <= sequential:
        return  # some cut the ties allow is worth making (the one chosen is among the fast ones)
    free = Partition(best_split(times, depth, hop_times=hops, overhead=overhead), times, hops, overhead)
    if _predicted(free) * (1 + AUTO_MARGIN) > sequential:  # no cut would help: not the tie's doing
        return
    scale, unit = time_unit(sequential)
    cuts = [stop for _, stop in free.bounds[:-1] if stop in forbidden]
    log.warning(
        "balance=%d: the cut %s is predicted %.3f %s per sample (its stages: %s), against %.3f %s for the "
        "model as one stage: no faster, because shared tensors keep every faster cut out: %s; a cut such as "
        "%s (%.3f %s) would split them. To pipeline this model, untie the weights: give one of the modules that "
        "share a tensor a copy of its own (for a tied language-model head, model.lm_head.weight = "
        "nn.Parameter(model.lm_head.weight.detach().clone())); for inference that changes no output, and when "
        "learning each copy then learns on its own. Or run the model as one stage (balance=1)",
        partition.depth,
        list(partition.balance),
        got * scale,
        unit,
        " / ".join(f"{t * scale:.3f}" for t in partition.predicted_times or ()),
        sequential * scale,
        unit,
        held_together(model, cuts),
        list(free.balance),
        _predicted(free) * scale,
        unit,
    )


def _predicted(partition: Partition) -> float:
    """The predicted seconds per sample of a profiled ``partition``."""
    time = partition.predicted_time
    assert time is not None, "a profiled partition predicts its time"
    return time


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch threads in this thread, then give back the count it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plan(
    model: nn.Sequential,
    balance: Balance,
    sample: Sample | None = None,
    *,
    learning: bool = False,
    threads: Callable[[int], int] | None = None,
) -> Partition:
    """How to cut ``model``: ``balance`` as given if it lists layers per stage (not profiled); for a
    number of stages D or ``"auto"``, the ``plan_timed`` cut (and, for ``"auto"``, depth)
    chosen on the child times (forward, and backward when ``learning``) and boundary costs profiled
    on ``sample``, with its predictions. ``threads(D)`` is the torch thread count each of D stages
    will run with, at which ``"auto"`` times the layers for D (default: the current count).

    Either way no cut separates two children that share a tensor (``tied_cuts``): a list
    balance that would is refused, and D stages are chosen among the cuts that do not, with a
    warning naming the tie and the fix where none of those is predicted ``AUTO_MARGIN`` faster
    than one stage while a cut through the tie would be.
    """
    check_balance(model, balance)
    if isinstance(balance, Sequence) and not isinstance(balance, str):
        partition = Partition(tuple(int(b) for b in balance))
    else:
        if sample is None:
            later = "" if isinstance(balance, str) else ", or let the pipeline profile on the first streamed sample"
            raise ValueError(
                f"balance={balance!r} needs a sample to profile the model on to choose the cuts: "
                f"pass sample={later}, or give the layers of each stage (e.g. balance=[2, 3])"
            )

        def profile(on_output: Callable[[int, object], None] | None = None) -> tuple[float, ...]:
            return profile_layers(model, sample, learning=learning, on_output=on_output)

        partition = plan_timed(model, balance, profile, learning=learning, threads=threads)
    log.info("partition: %s", partition)
    return partition

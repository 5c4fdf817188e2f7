"""How long one hop through a shared-memory channel takes between two processes, for ``partime bench``.

A user of ``partime.internals.Channel``: a spawned child echoes every message back, and half the round trip
is one ``put`` and one ``get``. Both ends run at one torch thread, as a pipeline's stages do (``threads=1``):
at torch's default count, a copy of more than 32,768 elements is split between threads, and on a machine with as
many cores as the two processes those threads wait for a core the other process holds (a hop of 216 KB took
about 3 ms on a 2-core VM at the default count, 20 µs at one thread).
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.multiprocessing as mp

from partime.internals import KIND_DATA, KIND_END, SPIN_S, Aborted, Channel, TensorSpec, torch_threads

log = logging.getLogger(__name__)


def _parent_alive() -> None:
    """Abort check for a child: raise if the process that started it is gone."""
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        raise Aborted("the parent process ended")


def _echo(inbox: Channel, outbox: Channel) -> None:
    """Child side of ``measure_hop``: send every DATA message straight back, until END."""
    torch.set_num_threads(1)
    while True:
        msg = inbox.get(check=_parent_alive)
        if msg.kind != KIND_DATA:
            return
        outbox.put(KIND_DATA, msg.index, msg.tensors, check=_parent_alive)


def measure_hop(nbytes: int = 65536, rounds: int = 2000, *, spin_s: float | None = None) -> dict[str, float]:
    """Time one hop of a float32 tensor of ``nbytes`` between this process and a spawned child.

    The tensor goes back and forth through two channels ``rounds`` times (after as many warm-up
    rounds, at most 200); a hop, half a round trip, includes a ``put`` and a ``get``. Waits spin
    for ``spin_s`` (default ``SPIN_S``; 0 blocks at once). Returns ``nbytes``, ``rounds``,
    ``hop_us_median`` and ``hop_us_p90``. The child is always joined (terminated if it hangs).
    """
    if nbytes < 4 or nbytes % 4:
        raise ValueError(f"nbytes must be a positive multiple of 4 (float32), got {nbytes}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    spin = SPIN_S if spin_s is None else spin_s
    ctx = mp.get_context("spawn")
    spec = TensorSpec((nbytes // 4,), torch.float32)
    ping = Channel(ctx, [spec], name="ping", spin_s=spin)
    pong = Channel(ctx, [spec], name="pong", spin_s=spin)
    child = ctx.Process(target=_echo, args=(ping, pong), name="partime-measure-hop", daemon=True)

    def child_alive() -> None:
        if not child.is_alive():
            raise RuntimeError(f"measure_hop: the echo process ended early (exit code {child.exitcode})")

    payload = (torch.randn(nbytes // 4),)
    warmup = min(rounds, 200)
    hops = []
    child.start()
    try:
        with torch_threads(1):
            for i in range(warmup + rounds):
                t0 = time.perf_counter()
                ping.put(KIND_DATA, i, payload, check=child_alive)
                pong.get(check=child_alive)
                if i >= warmup:
                    hops.append((time.perf_counter() - t0) / 2)
        ping.put(KIND_END, warmup + rounds, check=child_alive)
        child.join(timeout=10)
    finally:
        if child.is_alive():
            log.warning("measure_hop: the echo process is still running; terminating it")
            child.terminate()
        child.join()
    hops.sort()
    result = {
        "nbytes": float(nbytes),
        "rounds": float(rounds),
        "hop_us_median": hops[len(hops) // 2] * 1e6,
        "hop_us_p90": hops[min(len(hops) - 1, math.ceil(0.9 * len(hops)) - 1)] * 1e6,
    }
    log.debug("measure_hop: %s", result)
    return result

"""How busy other processes kept the machine while a figure was timed, for ``partime bench``.

Read from ``/proc/stat`` (every process on the machine) and ``os.times`` (this process and its
reaped children), so a figure can say how much of the machine it did not have; None where that
cannot be known (not Linux).
"""

from __future__ import annotations

import os
import time


def cpu_clocks() -> tuple[float, float, float] | None:
    """Now: wall seconds, the machine's busy CPU seconds (every process on it) and this process's
    with its reaped children's; None where ``/proc/stat`` cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _, _, irq, softirq = (int(v) for v in f.readline().split()[1:8])
    except (OSError, ValueError):
        return None
    mine = os.times()
    return (
        time.perf_counter(),
        (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"),
        mine.user + mine.system + mine.children_user + mine.children_system,
    )


def others_busy(start: tuple[float, float, float] | None, cores: int | None = None) -> float | None:
    """The fraction of the machine's ``cores`` (default: all) that processes other than this one
    and its reaped children kept busy since ``start`` (from ``cpu_clocks()``); None if unknown."""
    end = cpu_clocks()
    if start is None or end is None:
        return None
    wall, machine, mine = (b - a for a, b in zip(start, end))
    return max(0.0, (machine - mine) / (wall * (cores or os.cpu_count() or 1)))

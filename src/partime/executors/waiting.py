"""Waiting for a peer: on a semaphore, with an abort check, for every executor.

A wait spins briefly (a hop between busy stages costs microseconds) and then blocks in bounded
steps, asking an abort check after each one, so an idle worker costs no core and a dead peer or an
abort is noticed within ``POLL_S``. The check raises ``Aborted`` when the run is over.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

SPIN_S = 100e-6
"""How long a wait spins (non-blocking tries) before it blocks: a peer that answers within this
time is met without a sleep and a cross-core wake-up; a process that waits longer goes to sleep,
so an idle stage costs no core. Between tries the spinner yields its core (``os.sched_yield``):
with more processes than cores a pure spin would hold the core the peer needs, and every hop would
cost the whole ``SPIN_S``. What the spin saves, measured: experiments/measured-and-not-kept.md."""

_yield_core: Callable[[], None] = getattr(os, "sched_yield", lambda: None)  # not on Windows

POLL_S = 0.05
"""How long one blocking try lasts before the abort check is asked again: the longest time a
waiting process takes to notice an abort or a dead peer."""


class Aborted(Exception):
    """Raised from a wait when the abort check says the run is over."""


def wait(sem: Any, check: Callable[[], None] | None, spin_s: float = SPIN_S, poll_s: float = POLL_S) -> None:
    """Acquire ``sem``, spinning (yielding the core between tries) for up to ``spin_s``, then
    blocking ``poll_s`` at a time.

    After every blocking try that times out, ``check()`` is called; whatever it raises (``Aborted``
    or any error) propagates and ``sem`` is left unacquired. No try blocks longer than ``poll_s``;
    with ``check=None`` the wait lasts until ``sem`` is released.
    """
    if sem.acquire(False):
        return
    if spin_s > 0:
        deadline = time.perf_counter() + spin_s
        while time.perf_counter() < deadline:
            if sem.acquire(False):
                return
            _yield_core()
    while not sem.acquire(True, poll_s):
        if check is not None:
            check()

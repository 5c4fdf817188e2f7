"""The worker processes that run fidelity's runs side by side, which end with the process that made them.

``worker_pool(jobs)`` is a ``ProcessPoolExecutor`` of ``jobs`` processes started by ``spawn``, not
``fork``: a fork taken after this process has run torch, or while a progress bar's thread holds a
lock, can leave a worker waiting for ever. On Linux each worker asks the kernel for SIGTERM when
its parent dies (``prctl(PR_SET_PDEATHSIG)``), so that a sweep killed by a signal, which runs no
clean-up, leaves no worker computing on its own; elsewhere the pool's own shutdown is all there is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor

_PR_SET_PDEATHSIG = 1  # from linux/prctl.h


def worker_pool(jobs: int) -> ProcessPoolExecutor:
    """``jobs`` spawned worker processes, each of which ends when the process that made it does."""
    return ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_end_with, initargs=(os.getpid(),)
    )


def _end_with(parent: int) -> None:
    """In a worker: be sent SIGTERM when ``parent`` ends (Linux), and end now if it has already."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the request above took effect
        os._exit(1)

"""Keep freed memory for reuse in the processes that run stages.

A stage allocates its activations afresh at every tick and frees them a tick later. glibc's
``malloc`` serves a block above its mmap threshold (128 KiB at first, raised as such blocks are
freed, up to a few MB) with an ``mmap`` of its own and gives it back to the kernel when it is
freed, and it trims the top of its heap once more than the trim threshold lies free there. For
activations of a few hundred KB, every tick then maps fresh pages and takes a page fault for each
of them: system time that can match the stage's own computation. ``keep_freed_memory`` fixes
both thresholds high (glibc's ``mallopt``), so that the blocks of one tick are the next one's, as
``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` in the environment would, without
restarting the process.

Blocks larger than ``MMAP_THRESHOLD`` are still mapped and unmapped each time: few streams carry
such samples, and for them a fault per page is small beside the work on the block. What a process
has freed stays in it, up to its peak use (the largest tick's), which is what a pipeline needs again
at its next tick.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 * 2**20
"""Blocks up to this size come from the heap and are reused: 32 MiB, the largest fixed threshold
glibc takes on 64-bit systems."""

TRIM_THRESHOLD = 512 * 2**20
"""How much free memory the top of the heap may keep before glibc gives it back to the kernel."""

_M_TRIM_THRESHOLD = -1  # mallopt's parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3

_applied = False


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds in this process (see the module docstring), once.

    Whether they are fixed: False where the C library is not glibc (musl, macOS, Windows), which
    have no such thresholds or other ways of their own, and nothing is changed there."""
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
        gnu_get_libc_version = libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return False
    del gnu_get_libc_version
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        log.debug("mallopt refused the thresholds: malloc keeps its own")
        return False
    _applied = True
    return True

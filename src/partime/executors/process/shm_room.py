"""Room in ``/dev/shm`` for what the process executor shares, and a clear error where there is none.

The process executor puts every channel's slots (``shared_memory.Channel``) and the weights of
every stage it runs in a worker (``Module.share_memory``) in shared memory, which on Linux is the
tmpfs ``/dev/shm``. Docker gives a container 64 MB of it unless told more (``--shm-size``), and an
activation of a few large samples needs more. ``check_room`` asks ``os.statvfs`` before anything is
allocated and raises a ``SharedMemoryError`` that says what needs how much, what is free, and how
to give more; ``sharing`` turns torch's own failure to allocate (another process took the room in
between) into the same error, and removes the file torch leaves behind in ``/dev/shm`` then.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from ...core.boundary_values import TensorSpec

SHM_DIR = "/dev/shm"
"""Where ``Tensor.share_memory_()`` allocates on Linux (``shm_open``)."""

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
"""The unit tmpfs allocates in: every shared tensor takes whole pages."""

MB = 2**20


class SharedMemoryError(RuntimeError):
    """``/dev/shm`` cannot hold what the process executor shares (see the module docstring)."""


Need = tuple[str, int]
"""What needs shared memory (a channel, a stage's weights) and how many bytes of it."""


def pages(nbytes: int) -> int:
    """``nbytes`` in whole pages, as tmpfs counts them."""
    return math.ceil(nbytes / PAGE) * PAGE


def channel_bytes(specs: Sequence[TensorSpec], capacity: int) -> int:
    """The shared memory of a ``Channel`` of ``capacity`` slots of ``specs``: a header of three
    int64 and a float64 scalar per slot, and a tensor of ``capacity`` slots per spec."""
    return pages(capacity * 3 * 8) + pages(capacity * 8) + sum(pages(capacity * s.nbytes) for s in specs)


def tensors_bytes(tensors: Iterable[Tensor]) -> int:
    """The shared memory that ``share_memory_()`` of ``tensors`` takes: those on the CPU that are
    not shared yet, each its own storage in whole pages."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.device.type != "cpu" or t.is_shared():
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += pages(storage.nbytes())
    return total


def free_bytes() -> int | None:
    """The bytes free in ``/dev/shm`` for this process, or None where there is no ``/dev/shm``."""
    try:
        fs = os.statvfs(SHM_DIR)
    except (AttributeError, OSError):  # not Linux: no tmpfs to ask
        return None
    return fs.f_bavail * fs.f_frsize


def check_room(needs: Sequence[Need]) -> None:
    """A ``SharedMemoryError`` if ``/dev/shm`` has less room free than ``needs`` add up to."""
    free = free_bytes()
    if free is not None and sum(n for _, n in needs) > free:
        raise SharedMemoryError(message(needs, free))


@contextmanager
def sharing(needs: Sequence[Need]) -> Iterator[None]:
    """Within it, torch's failure to allocate shared memory is a ``SharedMemoryError`` (from it),
    and the file torch made for the failed allocation is removed from ``/dev/shm``."""
    try:
        yield
    except RuntimeError as exc:
        if "shared memory" not in str(exc) or isinstance(exc, SharedMemoryError):
            raise
        # torch names the file it could not fill ("... for file </torch_PID_...>"): it stays there
        for name in re.findall(rf"</(torch_{os.getpid()}_[0-9_]+)>", str(exc)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
        raise SharedMemoryError(f"{message(needs, free_bytes())} (torch: {exc})") from exc


def message(needs: Sequence[Need], free: int | None) -> str:
    """What the process executor needs of ``/dev/shm``, the largest first, what is free, and the fixes."""
    total = sum(n for _, n in needs)
    largest = sorted(needs, key=lambda need: -need[1])
    parts = ", ".join(f"{what} {n / MB:.1f} MB" for what, n in largest[:4] if n)
    if len(largest) > 4:
        parts += f", and {len(largest) - 4} more"
    room = "an unknown amount" if free is None else f"{free / MB:.1f} MB"
    suggest = max(256, 2 ** math.ceil(math.log2(2 * total / MB)))  # twice the need: room for a second pipeline
    return (
        f"the process executor needs {total / MB:.1f} MB of shared memory ({SHM_DIR}) for the stages it "
        f"runs in processes ({parts}), but {room} is free there. Give {SHM_DIR} more room (Docker: "
        f"`docker run --shm-size={suggest}m ...`; Kubernetes: an emptyDir of medium Memory mounted at "
        f"{SHM_DIR}), feed smaller samples or cut the model where less crosses a boundary, or use "
        "executor='thread', which shares no memory"
    )


def weights(module: torch.nn.Module) -> Iterator[Tensor]:
    """What ``module.share_memory()`` moves to shared memory: its parameters and buffers."""
    yield from module.parameters()
    yield from module.buffers()

"""A POSIX semaphore shared with spawned processes, whose name is unlinked once they hold it.

A process started by ``spawn`` cannot inherit a semaphore: it opens it by its name, in
``/dev/shm``, while it unpickles its arguments. multiprocessing's own semaphores keep that name
until they are garbage-collected in the process that made them, or until its resource tracker
unlinks them; when the whole process group is killed (``timeout -s KILL``, a job scheduler), the
tracker dies too, and the names stay in ``/dev/shm`` for good. A ``SharedSemaphore`` can be
unlinked as soon as every process that needs it has opened it (``unlink``): the semaphore lives
on in those processes, as an open object without a name, and nothing is left behind whatever
happens to them. Until then, it is unlinked when it is garbage-collected, or at exit, in the
process that made it.

Its name starts with ``/partime-`` (``/dev/shm/sem.partime-…``).
"""

from __future__ import annotations

import _multiprocessing  # type: ignore[import-not-found]
import os
import secrets
import weakref
from multiprocessing import context
from typing import Any

_SEMAPHORE = 1  # multiprocessing.synchronize.SEMAPHORE: a counting semaphore, not a lock
_MAX = _multiprocessing.SemLock.SEM_VALUE_MAX


def _unlink(name: str, owner: int) -> None:
    """Unlink ``name`` if this is the process that made it (not a fork of it) and it still exists."""
    if os.getpid() != owner:
        return
    try:
        _multiprocessing.sem_unlink(name)
    except FileNotFoundError:
        pass


class SharedSemaphore:
    """A counting semaphore for processes started by ``spawn``, starting at ``value``.

    ``acquire(block=True, timeout=None)`` and ``release()`` are those of
    ``multiprocessing.Semaphore``. It crosses into another process only as an argument of a
    process being started (as multiprocessing's own do). ``unlink()`` removes its name: call it
    once every such process has started; the semaphore keeps working in every process that has it.
    """

    def __init__(self, value: int = 0):
        for _ in range(100):
            name = f"/partime-{os.getpid()}-{secrets.token_hex(6)}"
            try:
                self._lock = _multiprocessing.SemLock(_SEMAPHORE, value, _MAX, name, False)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError("cannot find a free name for a semaphore")
        self._name = name
        self._finalizer: weakref.finalize[Any, Any] | None = weakref.finalize(self, _unlink, name, os.getpid())
        self._bind()

    def _bind(self) -> None:
        self.acquire = self._lock.acquire
        self.release = self._lock.release

    def unlink(self) -> None:
        """Remove the name (once, from the process that made it); the semaphore itself lives on."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()

    def __getstate__(self) -> tuple[Any, ...]:
        context.assert_spawning(self)
        lock = self._lock
        return (lock.handle, lock.kind, lock.maxvalue, self._name)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self._lock = _multiprocessing.SemLock._rebuild(*state)
        self._name = state[3]
        self._finalizer = None  # the name belongs to the process that made it
        self._bind()

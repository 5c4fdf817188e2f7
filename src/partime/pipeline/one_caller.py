"""One caller at a time: what holds a pipeline now, and the error another caller gets.

``step``, ``flush`` and a ``stream`` from its first item to its end (or until it is closed or let
go) each hold the pipeline (``claim``), and any of them called meanwhile, from any thread, raises a
RuntimeError that says what holds it and what to do, before it feeds anything.
"""

from __future__ import annotations

import threading


class OneCaller:
    """The hold on one pipeline: taken by one verb at a time, without waiting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: str | None = None  # the verb that holds it, for the message another caller gets

    def claim(self, verb: str) -> None:
        """Hold the pipeline for ``verb`` (``"step()"``, ``"flush()"``, ``"stream()"``) until
        ``release``; a RuntimeError, before anything is fed, if another caller holds it."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(self.busy(verb))
        self._holder = verb

    def release(self) -> None:
        """Let the next caller in."""
        self._holder = None
        self._lock.release()

    def check_free(self, verb: str) -> None:
        """A RuntimeError if another caller holds the pipeline now (see ``claim``)."""
        if self._lock.locked():
            raise RuntimeError(self.busy(verb))

    def busy(self, verb: str) -> str:
        """Why ``verb`` cannot run now, and what to do."""
        if self._holder == "stream()":
            return (
                f"{verb} was called while a stream() of this pipeline has not finished: a pipeline is used "
                "by one caller at a time. Finish that stream first, or close it (.close() on the generator "
                "stream() returned, or let go of it: a `break` out of `for r in pipe.stream(...)` does); "
                "the samples it left in flight come out first from the next call. For two streams at "
                "once, make two pipelines"
            )
        return (
            f"{verb} was called while a {self._holder or 'call'} of this pipeline is running in another "
            "thread: a pipeline is used by one caller at a time. Call it from one thread at a time (one "
            "thread that feeds the pipeline, or a lock of yours around its calls); for two streams at "
            "once, make two pipelines"
        )

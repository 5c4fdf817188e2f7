"""Errors that partime raises (the public names are re-exported by ``partime``)."""

from __future__ import annotations


class PipelineClosedError(RuntimeError):
    """The pipeline was used before it was opened or after it was closed."""


class StageError(RuntimeError):
    """A stage failed while running a sample.

    Carries the stage index, the sample index, the phase (``forward``, ``loss``, ``backward``
    or ``step``) and the original traceback as text (from the worker process where the stage ran,
    if it ran in another process). Where the original exception could be brought back it is the
    ``__cause__`` of this one.
    """

    def __init__(self, stage: int, sample: int | None, phase: str, message: str, traceback: str = ""):
        self.stage = stage
        self.sample = sample
        self.phase = phase
        self.message = message
        self.traceback = traceback
        where = f"stage {stage}" + (f", sample {sample}" if sample is not None else "")
        text = f"{where}, {phase}: {message}"
        if traceback:
            text += "\n\nOriginal traceback (in the stage):\n" + traceback.rstrip()
        super().__init__(text)

    def __reduce__(self) -> tuple[type[StageError], tuple[int, int | None, str, str, str]]:
        return (type(self), (self.stage, self.sample, self.phase, self.message, self.traceback))


class WorkerDiedError(StageError):
    """A stage's worker ended without reporting an error (killed by a signal, or it crashed).

    ``sample`` and ``phase`` are those of the tick the stage had not finished (its forward, or
    the gradient it was to apply, as the caller's count of offered and finished ticks says);
    the sample is None, and the phase ``waiting`` or ``start``, when that tick had no work.
    """


class StageTimeoutError(StageError):
    """The caller waited longer than the pipeline's ``timeout`` for a stage.

    ``stage`` is the stage that was behind (the one with the fewest finished ticks, where the
    executor can tell), ``sample`` and ``phase`` what it had not finished; the message says what
    the caller waited for, and for how long.
    """

"""The warning that a run under ``nonfinite="skip"`` skips most of its samples.

``SkipWatch`` is told every result handed out; it logs one warning once more than ``SKIP_SHARE``
of the last ``SKIP_WINDOW`` results were skipped, and one more only after the share has fallen
to half of that and risen again.
"""

from __future__ import annotations

import logging
from collections import deque

from ..result import Result

# the pipeline's logger: the warning reads as the pipeline's, for those who configure that one
log = logging.getLogger("partime.pipeline.pipeline")

SKIP_WINDOW = 100
"""Under ``nonfinite="skip"``, a warning is logged once more than ``SKIP_SHARE`` of the last
``SKIP_WINDOW`` results were skipped: the run has most likely diverged."""
SKIP_SHARE = 0.5


class SkipWatch:
    """Whether each of the last ``SKIP_WINDOW`` results was skipped, and whether that was warned of."""

    def __init__(self) -> None:
        self._skips: deque[bool] = deque(maxlen=SKIP_WINDOW)  # whether each recent result was skipped
        self._warned = False

    def note(self, result: Result) -> None:
        """Warn once more than ``SKIP_SHARE`` of the last ``SKIP_WINDOW`` results were skipped."""
        self._skips.append(result.skipped)
        skipped = sum(self._skips)
        if len(self._skips) == SKIP_WINDOW and skipped > SKIP_SHARE * SKIP_WINDOW:
            if not self._warned:
                log.warning(
                    "nonfinite='skip': %d of the last %d samples (up to sample %d) were skipped, so the "
                    "pipeline learns from few of them; the run has most likely diverged: lower the "
                    "learning rate, or look at the samples",
                    skipped,
                    SKIP_WINDOW,
                    result.index,
                )
                self._warned = True
        elif skipped <= SKIP_SHARE * SKIP_WINDOW / 2:
            self._warned = False  # recovered: warn again if it happens again

"""Test-then-train scores of a model learning online: whole-stream and rolling accuracy and loss.

In test-then-train (prequential) evaluation every sample is scored by the output the model gave
it *before* learning from it, so the score is an honest estimate on data not yet trained on. A
pipeline's result is exactly that: its output left the last stage before its own gradient was
applied. Feed every result to ``OnlineMetrics.update``: ``update(r.output, r.target, loss=r.loss)``.
A result with no output (a sample dropped under ``when_behind="drop"``, or skipped under
``nonfinite="skip"`` for a non-finite input) is counted and not scored (``unscored``).

>>> import torch
>>> from partime.metrics import OnlineMetrics
>>> metrics = OnlineMetrics(window=2)
>>> metrics.update(torch.tensor([[0.1, 0.9]]), torch.tensor([1]), loss=0.5)
>>> metrics.update(torch.tensor([[0.8, 0.2]]), torch.tensor([1]), loss=1.5)
>>> metrics.update(torch.tensor([[0.3, 0.7]]), torch.tensor([1]), loss=0.25)
>>> metrics.count, round(metrics.accuracy, 3), metrics.rolling_accuracy, metrics.loss, metrics.rolling_loss
(3, 0.667, 0.5, 0.75, 0.875)
>>> metrics.update(None, None)  # a dropped result: counted, not scored
>>> metrics.count, metrics.unscored, round(metrics.accuracy, 3)
(4, 1, 0.667)
"""

from __future__ import annotations

import math
from collections import deque

from torch import Tensor

__all__ = ["OnlineMetrics"]


def _mean(total: float, count: int) -> float:
    return total / count if count else math.nan


class OnlineMetrics:
    """Test-then-train scores over a stream: call ``update()`` with each result's output (computed
    before its own gradient was applied) and its target, and/or its loss.

    Every result can be given as it is: one with no output (dropped or skipped: its sample never
    went forward) counts as a result with nothing to score (``unscored``), and scores nothing.

    Accuracy counts rows: an output of logits ``[batch, classes]`` with targets ``[batch]`` scores
    ``batch`` rows (the predicted class is the argmax over the last dimension); an output
    ``[classes]`` with a 0-d target scores one. Loss is one value per update. The rolling figures
    cover the last ``window`` rows (accuracy) and the last ``window`` updates (loss); every figure
    is nan until something was recorded for it.
    """

    def __init__(self, window: int = 200):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a whole number of at least 1, got {window!r}")
        self.window = window
        self._count = 0
        self._unscored = 0
        self._rows = 0
        self._correct = 0
        self._loss_total = 0.0
        self._loss_count = 0
        self._recent_hits: deque[int] = deque(maxlen=window)
        self._recent_losses: deque[float] = deque(maxlen=window)
        self._history: dict[str, list[float]] = {"rolling_accuracy": [], "rolling_loss": []}

    def update(self, output: Tensor | None, target: Tensor | None = None, loss: float | Tensor | None = None) -> None:
        """Score one result: its ``output`` against ``target`` (if given) and its ``loss`` (if given).

        ``output`` None (a dropped or skipped result, whose sample never went forward) scores no
        accuracy, whatever ``target`` is; with no ``loss`` either, the result is counted as
        ``unscored``. Raises ValueError for an ``output`` with neither a target nor a loss to score
        it by, or if ``target``'s shape is not ``output``'s without its last (class) dimension;
        nothing is recorded then.
        """
        if output is not None and target is None and loss is None:
            raise ValueError(
                "update() needs a target (to score accuracy) or a loss, or both; got an output but neither"
            )
        if output is not None and target is not None:
            if tuple(output.shape[:-1]) != tuple(target.shape):
                raise ValueError(
                    f"target must have the shape of output without its last (class) dimension: "
                    f"output {tuple(output.shape)}, target {tuple(target.shape)} "
                    f"(expected {tuple(output.shape[:-1])})"
                )
            hits = (output.detach().argmax(dim=-1) == target.to(output.device)).flatten().tolist()
            self._rows += len(hits)
            self._correct += sum(hits)
            self._recent_hits.extend(int(hit) for hit in hits)
        if loss is not None:
            value = float(loss.detach()) if isinstance(loss, Tensor) else float(loss)
            self._loss_total += value
            self._loss_count += 1
            self._recent_losses.append(value)
        elif output is None:
            self._unscored += 1
        self._count += 1
        self._history["rolling_accuracy"].append(self.rolling_accuracy)
        self._history["rolling_loss"].append(self.rolling_loss)

    @property
    def count(self) -> int:
        """The number of updates so far: every result given, scored or not."""
        return self._count

    @property
    def unscored(self) -> int:
        """The number of updates with nothing to score: results with no output and no loss
        (dropped, or skipped for a non-finite input)."""
        return self._unscored

    @property
    def rows(self) -> int:
        """The number of rows scored for accuracy so far."""
        return self._rows

    @property
    def accuracy(self) -> float:
        """The fraction of all rows so far whose predicted class was the target; nan if none."""
        return _mean(self._correct, self._rows)

    @property
    def rolling_accuracy(self) -> float:
        """The fraction of the last ``window`` rows whose predicted class was the target; nan if none."""
        return _mean(sum(self._recent_hits), len(self._recent_hits))

    @property
    def loss(self) -> float:
        """The mean of every loss recorded so far; nan if none."""
        return _mean(self._loss_total, self._loss_count)

    @property
    def rolling_loss(self) -> float:
        """The mean of the last ``window`` losses recorded; nan if none."""
        return _mean(sum(self._recent_losses), len(self._recent_losses))

    def history(self) -> dict[str, list[float]]:
        """``rolling_accuracy`` and ``rolling_loss`` as they stood after each update, for plotting."""
        return {name: list(values) for name, values in self._history.items()}

    def __repr__(self) -> str:
        unscored = f", unscored={self.unscored}" if self.unscored else ""
        return (
            f"OnlineMetrics(count={self.count}{unscored}, accuracy={self.accuracy:.4f}, "
            f"rolling_accuracy={self.rolling_accuracy:.4f}, loss={self.loss:.4g}, "
            f"rolling_loss={self.rolling_loss:.4g})"
        )

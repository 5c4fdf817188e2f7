"""Test-then-train scores of a model learning online: whole-stream and rolling accuracy, error and loss.

In test-then-train (prequential) evaluation every sample is scored by the output the model gave
it *before* learning from it, so the score is an honest estimate on data not yet trained on. A
pipeline's result is exactly that: its output left the last stage before its own gradient was
applied. Feed every result to ``OnlineMetrics.update``: ``update(r.output, r.target, loss=r.loss)``.
A result with no output (a sample dropped under ``when_behind="drop"``, or skipped under
``nonfinite="skip"`` for a non-finite input) is counted and not scored (``unscored``). A predicted
result (``Pipeline.predict``: a sample not learnt from) has an output and no loss: pass
``predicted=r.predicted`` too, and it is scored by its target, or, without one, counted unscored.

The target says what is scored: class indices (an integer tensor of the output's shape without its
last dimension) score accuracy; values (a floating tensor of the output's own shape) score the
mean absolute and mean squared error.

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

A regression target has the output's shape; the errors are means over its elements:

>>> regression = OnlineMetrics(window=1)
>>> regression.update(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0]))  # errors 0.5 and 0
>>> regression.update(torch.tensor([0.0, 0.0]), torch.tensor([1.0, -1.0]))  # errors 1 and 1
>>> regression.elements, regression.mae, regression.mse, regression.rolling_mae, regression.rolling_mse
(4, 0.625, 0.5625, 1.0, 1.0)
>>> regression.history()["rolling_mae"]  # after each update, while the history has room
[0.25, 1.0]
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["OnlineMetrics"]


def _mean(total: float, count: int) -> float:
    return total / count if count else math.nan


@dataclass(frozen=True, slots=True)
class _Point:
    """The rolling figures as they stood after update number ``count``."""

    count: int
    rolling_accuracy: float
    rolling_loss: float
    rolling_mae: float
    rolling_mse: float


_POINT_FIELDS = [f.name for f in fields(_Point)]


class _Errors(NamedTuple):
    """One update's regression errors: the sums of absolute and squared errors over its elements."""

    absolute: float
    squared: float
    elements: int


def _is_class_index(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


class OnlineMetrics:
    """Test-then-train scores over a stream: call ``update()`` with each result's output (computed
    before its own gradient was applied) and its target, and/or its loss.

    Every result can be given as it is: one with no output (dropped or skipped: its sample never
    went forward) counts as a result with nothing to score (``unscored``), and scores nothing. A
    predicted result (``Result.predicted``: its sample went forward and was not learnt from) is
    given with ``predicted=True``: its output is scored by its target like any, it has no loss (so
    ``loss`` averages the learnt samples'), and one without a target is counted ``unscored``;
    ``predicted`` counts them. To score held-out samples apart from the learnt ones, give the
    predicted results to an ``OnlineMetrics`` of their own.

    Accuracy counts rows: an output of logits ``[batch, classes]`` with integer targets ``[batch]``
    scores ``batch`` rows (the predicted class is the argmax over the last dimension); an output
    ``[classes]`` with a 0-d target scores one. A floating target of the output's own shape is a
    regression target: the absolute and squared errors of its elements are scored (``mae``,
    ``mse``, means over every element). Loss is one value per update. The rolling figures cover the
    last ``window`` rows (accuracy) and the last ``window`` updates (errors, over their elements;
    loss); every figure is nan until something was recorded for it.

    ``history()`` keeps at most ``history_size`` points however long the stream: while there is
    room it records the rolling figures after every update; when it is full it keeps every other
    point and from then on records every second update (then every fourth, and so on), so its points
    stay evenly spaced over the whole stream. The first update and the latest are always in it.
    """

    def __init__(self, window: int = 200, history_size: int = 1000):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a whole number of at least 1, got {window!r}")
        if isinstance(history_size, bool) or not isinstance(history_size, int) or history_size < 2:
            raise ValueError(
                f"history_size must be a whole number of at least 2 (the first and the latest point), "
                f"got {history_size!r}"
            )
        self.window = window
        self.history_size = history_size
        self._count = 0
        self._unscored = 0
        self._predicted = 0
        self._rows = 0
        self._correct = 0
        self._absolute_total = 0.0
        self._squared_total = 0.0
        self._elements = 0
        self._loss_total = 0.0
        self._loss_count = 0
        self._recent_hits: deque[int] = deque(maxlen=window)
        self._recent_errors: deque[_Errors] = deque(maxlen=window)
        self._recent_losses: deque[float] = deque(maxlen=window)
        # Points recorded at updates 1, 1 + stride, 1 + 2 stride, ...; one place is left for the latest.
        self._points: list[_Point] = []
        self._stride = 1

    def update(
        self,
        output: Tensor | None,
        target: Tensor | tuple[Tensor, ...] | None = None,
        loss: float | Tensor | None = None,
        *,
        predicted: bool = False,
    ) -> None:
        """Score one result: its ``output`` against ``target`` (if given) and its ``loss`` (if given).

        A target of ``output``'s shape without its last (class) dimension and of an integer dtype
        scores accuracy; a target of ``output``'s own shape and a floating dtype scores the absolute
        and squared errors of its elements. ``output`` None (a dropped or skipped result, whose
        sample never went forward) scores neither, whatever ``target`` is; with no ``loss`` either,
        the result is counted as ``unscored``. ``target`` takes a result's ``target`` as it is, so
        ``update(r.output, r.target, loss=r.loss)`` type-checks; a target of several tensors (a
        stream's tuple target) is a TypeError, since it has no one score. ``predicted`` (pass
        ``r.predicted``) says the result is of a sample only predicted, not learnt from: it is
        counted in ``predicted``, and with no target (it has no loss) it is counted ``unscored``.
        Raises ValueError for an ``output`` with neither a target nor a loss to score it by (unless
        ``predicted``), or a ``target`` that is neither kind (naming both shapes and dtypes);
        nothing is recorded then.
        """
        if isinstance(target, tuple):
            raise TypeError(
                f"update() scores one target tensor, got a tuple of {len(target)}: pass the tensor to "
                "score (e.g. r.target[0]), or score the loss alone with update(r.output, loss=r.loss)"
            )
        if output is not None and target is None and loss is None and not predicted:
            raise ValueError(
                "update() needs a target (to score accuracy or errors) or a loss, or both; got an output but "
                "neither (for a predicted result, Result.predicted, pass predicted=r.predicted: it is counted unscored)"
            )
        if output is not None and target is not None:
            if tuple(target.shape) == tuple(output.shape) and target.dtype.is_floating_point:
                self._score_errors(output.detach(), target)
            elif tuple(target.shape) == tuple(output.shape[:-1]) and _is_class_index(target.dtype):
                self._score_classes(output.detach(), target)
            else:
                raise ValueError(
                    f"target fits neither a class target nor a regression target of the output: "
                    f"output {tuple(output.shape)} {_name(output.dtype)}, "
                    f"target {tuple(target.shape)} {_name(target.dtype)}; class indices have the output's "
                    f"shape without its last dimension, {tuple(output.shape[:-1])}, and an integer dtype; "
                    f"regression values have the output's shape, {tuple(output.shape)}, and a floating dtype"
                )
        if loss is not None:
            value = float(loss.detach()) if isinstance(loss, Tensor) else float(loss)
            self._loss_total += value
            self._loss_count += 1
            self._recent_losses.append(value)
        elif output is None or target is None:
            self._unscored += 1
        self._predicted += int(predicted)
        self._count += 1
        self._record()

    def _score_classes(self, output: Tensor, target: Tensor) -> None:
        hits = (output.argmax(dim=-1) == target.to(output.device)).flatten().tolist()
        self._rows += len(hits)
        self._correct += sum(hits)
        self._recent_hits.extend(int(hit) for hit in hits)

    def _score_errors(self, output: Tensor, target: Tensor) -> None:
        # at least float32, so that half-precision outputs do not round the sums
        dtype = torch.promote_types(torch.promote_types(output.dtype, target.dtype), torch.float32)
        difference = output.to(dtype) - target.to(output.device, dtype)
        errors = _Errors(float(difference.abs().sum()), float(difference.square().sum()), difference.numel())
        self._absolute_total += errors.absolute
        self._squared_total += errors.squared
        self._elements += errors.elements
        self._recent_errors.append(errors)

    def _record(self) -> None:
        """Record the point of this update if it falls on the stride, halving the points first
        when there is no room (one place is kept for the latest point)."""
        if (self._count - 1) % self._stride:
            return
        if len(self._points) >= self.history_size - 1:
            del self._points[1::2]  # points 0, 2, 4, ... are those at updates 1, 1 + 2 stride, ...
            self._stride *= 2
            if (self._count - 1) % self._stride:
                return
        self._points.append(self._point())

    def _point(self) -> _Point:
        return _Point(self._count, self.rolling_accuracy, self.rolling_loss, self.rolling_mae, self.rolling_mse)

    @property
    def count(self) -> int:
        """The number of updates so far: every result given, scored or not."""
        return self._count

    @property
    def unscored(self) -> int:
        """The number of updates with nothing to score: results with no output and no loss
        (dropped, or skipped for a non-finite input), and predicted results with no target."""
        return self._unscored

    @property
    def predicted(self) -> int:
        """The number of updates of predicted results (``predicted=True``: samples not learnt from)."""
        return self._predicted

    @property
    def rows(self) -> int:
        """The number of rows scored for accuracy so far."""
        return self._rows

    @property
    def elements(self) -> int:
        """The number of elements scored for regression errors so far."""
        return self._elements

    @property
    def accuracy(self) -> float:
        """The fraction of all rows so far whose predicted class was the target; nan if none."""
        return _mean(self._correct, self._rows)

    @property
    def rolling_accuracy(self) -> float:
        """The fraction of the last ``window`` rows whose predicted class was the target; nan if none."""
        return _mean(sum(self._recent_hits), len(self._recent_hits))

    @property
    def mae(self) -> float:
        """The mean absolute error over every element scored so far; nan if none."""
        return _mean(self._absolute_total, self._elements)

    @property
    def mse(self) -> float:
        """The mean squared error over every element scored so far; nan if none."""
        return _mean(self._squared_total, self._elements)

    @property
    def rolling_mae(self) -> float:
        """The mean absolute error over the elements of the last ``window`` regression updates; nan if none."""
        return _mean(sum(e.absolute for e in self._recent_errors), sum(e.elements for e in self._recent_errors))

    @property
    def rolling_mse(self) -> float:
        """The mean squared error over the elements of the last ``window`` regression updates; nan if none."""
        return _mean(sum(e.squared for e in self._recent_errors), sum(e.elements for e in self._recent_errors))

    @property
    def loss(self) -> float:
        """The mean of every loss recorded so far; nan if none."""
        return _mean(self._loss_total, self._loss_count)

    @property
    def rolling_loss(self) -> float:
        """The mean of the last ``window`` losses recorded; nan if none."""
        return _mean(sum(self._recent_losses), len(self._recent_losses))

    def history(self) -> dict[str, list[float]]:
        """The rolling figures as they stood after some updates, for plotting: ``count`` (the
        update, 1 for the first), ``rolling_accuracy``, ``rolling_loss``, ``rolling_mae`` and
        ``rolling_mse``, one entry per point, every list a new copy.

        At most ``history_size`` points, evenly spaced over the stream (see the class), the first
        and the latest update among them; after every update while there were fewer than
        ``history_size``. A figure not recorded by then is nan."""
        points = list(self._points)
        if self._count and points[-1].count != self._count:
            points.append(self._point())
        return {name: [getattr(p, name) for p in points] for name in _POINT_FIELDS}

    def __repr__(self) -> str:
        unscored = f", unscored={self.unscored}" if self.unscored else ""
        unscored += f", predicted={self.predicted}" if self.predicted else ""
        errors = f", mae={self.mae:.4g}, mse={self.mse:.4g}" if self.elements else ""
        return (
            f"OnlineMetrics(count={self.count}{unscored}, accuracy={self.accuracy:.4f}, "
            f"rolling_accuracy={self.rolling_accuracy:.4f}{errors}, loss={self.loss:.4g}, "
            f"rolling_loss={self.rolling_loss:.4g})"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

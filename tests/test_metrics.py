"""Tests of partime.metrics: test-then-train scores on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from partime.metrics import OnlineMetrics


def logits(*classes: int, num_classes: int = 3) -> torch.Tensor:
    """Logits [len(classes), num_classes] whose argmax in row i is classes[i]."""
    out = torch.zeros(len(classes), num_classes)
    out[torch.arange(len(classes)), torch.tensor(classes)] = 1.0
    return out


def test_empty_scores_are_nan() -> None:
    metrics = OnlineMetrics()
    assert metrics.count == 0 and metrics.rows == 0
    for value in (metrics.accuracy, metrics.rolling_accuracy, metrics.loss, metrics.rolling_loss):
        assert math.isnan(value)
    assert metrics.history() == {"rolling_accuracy": [], "rolling_loss": []}


def test_accuracy_one_row_per_update_window_two() -> None:
    metrics = OnlineMetrics(window=2)
    # predictions 0, 1, 2, 2 against targets 0, 0, 2, 1: hits 1, 0, 1, 0
    for predicted, target in [(0, 0), (1, 0), (2, 2), (2, 1)]:
        metrics.update(logits(predicted), torch.tensor([target]))
    assert metrics.count == 4 and metrics.rows == 4
    assert metrics.accuracy == 0.5
    assert metrics.rolling_accuracy == 0.5
    assert metrics.history()["rolling_accuracy"] == [1.0, 0.5, 0.5, 0.5]
    assert all(math.isnan(v) for v in metrics.history()["rolling_loss"])
    assert math.isnan(metrics.loss)


def test_accuracy_counts_rows_of_a_batch() -> None:
    metrics = OnlineMetrics(window=3)
    metrics.update(logits(1, 2), torch.tensor([1, 2]))  # hits 1 1
    metrics.update(logits(0, 0), torch.tensor([1, 2]))  # hits 0 0
    metrics.update(logits(2, 1, 0), torch.tensor([2, 0, 0]))  # hits 1 0 1
    assert metrics.count == 3 and metrics.rows == 7
    assert metrics.accuracy == pytest.approx(4 / 7)
    # the last three rows are hits 1 0 1; before them: [1 1] -> 1, then [1 0 0] -> 1/3
    assert metrics.history()["rolling_accuracy"] == pytest.approx([1.0, 1 / 3, 2 / 3])


def test_single_sample_output_with_scalar_target() -> None:
    metrics = OnlineMetrics()
    metrics.update(torch.tensor([0.2, 0.5, 0.3]), torch.tensor(1))
    metrics.update(torch.tensor([0.2, 0.5, 0.3]), torch.tensor(2))
    assert (metrics.rows, metrics.accuracy) == (2, 0.5)


def test_loss_means_whole_and_rolling() -> None:
    metrics = OnlineMetrics(window=2)
    for value in (4.0, 2.0, 1.0, torch.tensor(3.0)):
        metrics.update(torch.zeros(1, 2), loss=value)
    assert metrics.loss == 2.5
    assert metrics.rolling_loss == 2.0
    assert metrics.history()["rolling_loss"] == [4.0, 3.0, 1.5, 2.0]
    assert math.isnan(metrics.accuracy) and metrics.rows == 0


def test_target_and_loss_together() -> None:
    metrics = OnlineMetrics(window=1)
    metrics.update(logits(0), torch.tensor([0]), loss=0.25)
    metrics.update(logits(0), torch.tensor([1]), loss=0.75)
    assert (metrics.accuracy, metrics.rolling_accuracy) == (0.5, 0.0)
    assert (metrics.loss, metrics.rolling_loss) == (0.5, 0.75)
    assert metrics.history() == {"rolling_accuracy": [1.0, 0.0], "rolling_loss": [0.25, 0.75]}


def test_output_with_grad_is_scored_without_it() -> None:
    output = logits(1).requires_grad_()
    metrics = OnlineMetrics()
    metrics.update(output * 2, torch.tensor([1]), loss=(output.sum() * 0.5))
    assert (metrics.accuracy, metrics.loss) == (1.0, 0.5)


def test_history_is_a_copy() -> None:
    metrics = OnlineMetrics()
    metrics.update(logits(0), torch.tensor([0]))
    metrics.history()["rolling_accuracy"].append(0.0)
    assert metrics.history()["rolling_accuracy"] == [1.0]


def test_repr_shows_the_scores() -> None:
    metrics = OnlineMetrics()
    metrics.update(logits(0), torch.tensor([0]), loss=0.5)
    assert repr(metrics) == (
        "OnlineMetrics(count=1, accuracy=1.0000, rolling_accuracy=1.0000, loss=0.5, rolling_loss=0.5)"
    )


def test_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match="window must be a whole number of at least 1, got 0"):
        OnlineMetrics(window=0)
    metrics = OnlineMetrics()
    with pytest.raises(ValueError, match="neither"):
        metrics.update(logits(0))
    with pytest.raises(ValueError, match=r"output \(2, 3\), target \(3,\) \(expected \(2,\)\)"):
        metrics.update(logits(0, 1), torch.tensor([0, 1, 2]))
    assert metrics.count == 0


def test_a_result_with_no_output_is_counted_not_scored() -> None:
    import partime
    from partime.sources import FakeClock, at_rate

    metrics = OnlineMetrics(window=2)
    metrics.update(logits(0), torch.tensor([0]), loss=0.5)
    metrics.update(None, None)  # a dropped result: no output, no target
    metrics.update(None, torch.tensor([1]))  # a skipped input: no output, its target
    metrics.update(logits(1), torch.tensor([0]), loss=1.5)
    assert (metrics.count, metrics.unscored, metrics.rows) == (4, 2, 2)
    assert (metrics.accuracy, metrics.loss) == (0.5, 1.0)
    assert metrics.history()["rolling_accuracy"] == [1.0, 1.0, 1.0, 0.5]  # one entry per result
    assert "unscored=2" in repr(metrics)

    # the loop the README and the guides show, over every result of a stream that drops and skips samples
    clock = FakeClock()

    class Slow(torch.nn.Module):  # each forward takes 0.15 s of the fake clock: a 10 fps source is too fast
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            clock.advance(0.15)
            return x

    xs = [torch.randn(1, 3) for _ in range(8)]
    xs[5] = torch.full((1, 3), math.nan)
    ys = [torch.tensor([k % 3]) for k in range(8)]
    model = torch.nn.Sequential(Slow(), torch.nn.Linear(3, 3))
    kw = dict(executor="inline", loss_fn=torch.nn.CrossEntropyLoss(), nonfinite="skip")
    metrics = OnlineMetrics()
    with partime.Pipeline(model, [1, 1], optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **kw) as pipe:
        results = list(pipe.stream(at_rate(list(zip(xs, ys)), 10, clock=clock), when_behind="drop"))
    for r in results:
        metrics.update(r.output, r.target, loss=r.loss)
    unscored = [r for r in results if r.output is None]
    assert any(r.dropped for r in unscored) and any(r.skipped for r in unscored)
    assert (metrics.count, metrics.unscored) == (len(results), len(unscored))
    assert metrics.rows == len(results) - len(unscored)


def test_update_with_an_output_and_nothing_to_score_it_by_still_raises() -> None:
    metrics = OnlineMetrics()
    with pytest.raises(ValueError, match="got an output but neither"):
        metrics.update(logits(0))
    assert metrics.count == 0

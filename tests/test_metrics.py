"""Tests of partime.metrics: test-then-train scores on hand-computed cases."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from partime.metrics import OnlineMetrics

NAMES = ["count", "rolling_accuracy", "rolling_loss", "rolling_mae", "rolling_mse"]


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
    for value in (metrics.mae, metrics.mse, metrics.rolling_mae, metrics.rolling_mse):
        assert math.isnan(value)
    assert metrics.history() == {name: [] for name in NAMES}


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
    history = metrics.history()
    assert (history["count"], history["rolling_accuracy"], history["rolling_loss"]) == (
        [1, 2],
        [1.0, 0.0],
        [0.25, 0.75],
    )
    assert all(math.isnan(v) for v in history["rolling_mae"] + history["rolling_mse"])  # no regression target


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
    with pytest.raises(ValueError, match="history_size must be a whole number of at least 2.*got 1"):
        OnlineMetrics(history_size=1)
    with pytest.raises(ValueError, match=r"output \(2, 3\) float32, target \(3,\) int64; class indices .* \(2,\), "):
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


def test_a_predicted_result_is_scored_by_its_target_or_counted_unscored_and_counted_predicted() -> None:
    metrics = OnlineMetrics(window=4)
    metrics.update(logits(0), torch.tensor([0]), loss=0.5)  # learnt
    metrics.update(logits(1), torch.tensor([0]), predicted=True)  # predicted, with a target: scored, no loss
    metrics.update(logits(1), None, predicted=True)  # predicted, no target: nothing to score
    assert (metrics.count, metrics.predicted, metrics.unscored, metrics.rows) == (3, 2, 1, 2)
    assert (metrics.accuracy, metrics.loss, metrics.rolling_loss) == (0.5, 0.5, 0.5)
    assert metrics.history()["rolling_accuracy"] == [1.0, 0.5, 0.5]
    assert repr(metrics).startswith("OnlineMetrics(count=3, unscored=1, predicted=2, accuracy=0.5000")


def test_update_with_an_output_and_nothing_to_score_it_by_still_raises() -> None:
    metrics = OnlineMetrics()
    with pytest.raises(ValueError, match="got an output but neither"):
        metrics.update(logits(0))
    assert metrics.count == 0


def test_regression_errors_whole_and_rolling() -> None:
    metrics = OnlineMetrics(window=2)
    # absolute errors per update: [1, 0], [2, 2], [0.5, 0.5]; squared: [1, 0], [4, 4], [0.25, 0.25]
    metrics.update(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 2.0]))
    metrics.update(torch.tensor([0.0, 0.0]), torch.tensor([2.0, -2.0]))
    metrics.update(torch.tensor([3.0, 3.5]), torch.tensor([3.5, 3.0]))
    assert (metrics.count, metrics.elements, metrics.rows) == (3, 6, 0)
    assert metrics.mae == 6 / 6 and metrics.mse == 9.5 / 6
    assert metrics.rolling_mae == 5 / 4 and metrics.rolling_mse == 8.5 / 4  # the last two updates
    history = metrics.history()
    assert history["count"] == [1, 2, 3]
    assert history["rolling_mae"] == [0.5, 5 / 4, 5 / 4]
    assert history["rolling_mse"] == [0.5, 9 / 4, 8.5 / 4]
    assert all(math.isnan(v) for v in history["rolling_accuracy"] + history["rolling_loss"])
    assert math.isnan(metrics.accuracy)


def test_regression_over_batches_weighs_elements_with_a_loss() -> None:
    metrics = OnlineMetrics(window=1)
    # a batch [2, 3] with one error of 3 among 6 elements, then a single row [1, 3] with errors 1 1 1
    output = torch.zeros(2, 3)
    target = torch.zeros(2, 3)
    target[1, 2] = -3.0
    metrics.update(output, target, loss=1.5)
    metrics.update(torch.ones(1, 3, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.float64), loss=0.5)
    assert metrics.elements == 9
    assert metrics.mae == pytest.approx(6 / 9) and metrics.mse == pytest.approx(12 / 9)
    assert (metrics.rolling_mae, metrics.rolling_mse) == (1.0, 1.0)
    assert (metrics.loss, metrics.rolling_loss) == (1.0, 0.5)
    assert "mae=0.6667, mse=1.333" in repr(metrics)


def test_regression_of_a_half_precision_output_and_an_output_with_grad() -> None:
    metrics = OnlineMetrics()
    weight = torch.tensor([2.0], requires_grad=True)
    metrics.update(weight * 1.5, torch.tensor([1.0]))
    metrics.update(torch.tensor([0.5], dtype=torch.float16), torch.tensor([0.25]))
    assert (metrics.mae, metrics.mse) == ((2.0 + 0.25) / 2, (4.0 + 0.0625) / 2)


def test_regression_with_dropped_results_mixed_in() -> None:
    metrics = OnlineMetrics(window=2)
    metrics.update(torch.tensor([1.0]), torch.tensor([0.0]), loss=1.0)  # error 1
    metrics.update(None, None)  # dropped
    metrics.update(None, torch.tensor([5.0]))  # skipped, with its target: nothing scored
    metrics.update(torch.tensor([2.0]), torch.tensor([5.0]), loss=9.0)  # error 3
    metrics.update(torch.tensor([0.0]), torch.tensor([-2.0]), loss=4.0)  # error 2
    assert (metrics.count, metrics.unscored, metrics.elements) == (5, 2, 3)
    assert (metrics.mae, metrics.mse) == (2.0, 14 / 3)
    assert (metrics.rolling_mae, metrics.rolling_mse) == (2.5, 6.5)  # the last two regression updates
    history = metrics.history()
    assert history["count"] == [1, 2, 3, 4, 5]
    assert history["rolling_mae"] == [1.0, 1.0, 1.0, 2.0, 2.5]
    assert history["rolling_loss"] == [1.0, 1.0, 1.0, 5.0, 6.5]


def test_a_target_of_neither_kind_is_refused_with_both_shapes_and_dtypes() -> None:
    metrics = OnlineMetrics()
    # an integer target of the output's own shape (one-hot labels): not a regression target
    with pytest.raises(ValueError, match=r"output \(2, 3\) float32, target \(2, 3\) int64"):
        metrics.update(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64))
    # a floating target without the output's last dimension: an output [batch, 1] against values [batch]
    with pytest.raises(
        ValueError,
        match=r"output \(4, 1\) float32, target \(4,\) float32.*regression values "
        r"have the output's shape, \(4, 1\), and a floating dtype",
    ):
        metrics.update(torch.zeros(4, 1), torch.zeros(4))
    with pytest.raises(ValueError, match=r"target \(3,\) float64"):
        metrics.update(torch.zeros(2), torch.zeros(3, dtype=torch.float64))
    assert (metrics.count, metrics.elements, metrics.rows) == (0, 0, 0)
    assert metrics.history()["count"] == []


def test_history_thins_by_two_when_full() -> None:
    metrics = OnlineMetrics(window=1, history_size=4)
    for k in range(1, 11):
        metrics.update(None, loss=float(k))
        counts = metrics.history()["count"]
        assert len(counts) <= 4 and counts[0] == 1 and counts[-1] == k
    # after 10 updates: points at 1, 5, 9 (every fourth) and the latest, 10
    assert metrics.history() == {
        "count": [1, 5, 9, 10],
        "rolling_accuracy": pytest.approx([math.nan] * 4, nan_ok=True),
        "rolling_loss": [1.0, 5.0, 9.0, 10.0],
        "rolling_mae": pytest.approx([math.nan] * 4, nan_ok=True),
        "rolling_mse": pytest.approx([math.nan] * 4, nan_ok=True),
    }
    # the counts as they grow: every update while there is room, then every second, then every fourth
    steps = OnlineMetrics(history_size=4)
    seen = []
    for _ in range(7):
        steps.update(None, loss=0.0)
        seen.append(steps.history()["count"])
    assert seen == [[1], [1, 2], [1, 2, 3], [1, 3, 4], [1, 3, 5], [1, 3, 5, 6], [1, 5, 7]]


def test_history_stays_bounded_over_a_long_stream() -> None:
    metrics = OnlineMetrics(window=3, history_size=100)
    rolling = []  # the rolling loss after every update, as the properties give it
    for k in range(100_000):
        metrics.update(None, loss=float(k % 7))
        rolling.append(metrics.rolling_loss)
    history = metrics.history()
    counts = history["count"]
    assert 50 <= len(counts) <= 100
    assert counts[0] == 1 and counts[-1] == 100_000
    steps = {b - a for a, b in itertools.pairwise(counts[:-1])}  # the last is the latest update
    assert len(steps) == 1 and steps.pop() * len(counts) >= 100_000 / 2  # evenly spaced, over the whole stream
    assert history["rolling_loss"] == [rolling[int(c) - 1] for c in counts]
    assert len(metrics.history()["count"]) == len(counts)  # reading it records nothing


def test_a_tuple_target_is_refused_and_nothing_is_recorded() -> None:
    metrics = OnlineMetrics()
    with pytest.raises(TypeError, match=r"one target tensor, got a tuple of 2: pass the tensor"):
        metrics.update(torch.zeros(1, 3), (torch.tensor([1]), torch.tensor([2])))
    assert metrics.count == 0

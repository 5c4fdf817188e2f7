"""The fidelity benchmark on tiny settings: its rows, summary, table and plot."""

import json

import pytest
from click.testing import CliRunner

from partime.tools import fidelity as fid
from partime.tools.cli import main


def test_even_balance():
    assert fid.even_balance(10, 8) == [2, 2, 1, 1, 1, 1, 1, 1]
    assert fid.even_balance(10, 1) == [10]
    assert fid.even_balance(8, 4) == [2, 2, 2, 2]


def test_configs_cover_sequential_and_every_mode_and_compensation():
    per_depth = {opt: sum(len(fid.compensations(m, opt)) for m in fid.GRAD_MODES) for opt in fid.OPTIMIZERS}
    assert per_depth == {"sgd": 7, "momentum": 10, "adam": 10}
    steps = {("digits", "sgd"): 0.1, ("digits", "adam"): 1e-3}
    configs = fid.configs(["digits"], [2, 8], seeds=2, step_sizes=steps)
    assert len(configs) == 2 * (1 + 2 * 7) + 2 * (1 + 2 * 10)
    for opt in ("sgd", "adam"):  # the default is measured too
        assert fid.default_label(8, opt) in {c.label for c in configs if c.optimizer == opt}
    assert {c.label for c in configs if c.depth == 1} == {"sequential"}
    assert {(c.optimizer, c.lr) for c in configs} == {("sgd", 0.1), ("adam", 1e-3)}
    labels = {c.label for c in configs if c.optimizer == "adam"}
    assert "D=8 stash + optimizer-prediction + long-momentum" in labels
    assert "D=8 weight-stash + optimizer-prediction" not in labels  # the same run as with stash


def test_each_stream_and_optimizer_learns_at_its_best_step_size():
    tuning = fid.tuning_configs(["digits", "camera"], ["sgd", "adam"])
    assert len(tuning) == 2 * (len(fid.LR_GRID["sgd"]) + len(fid.LR_GRID["adam"]))
    assert {c.seed for c in tuning} == {fid.TUNING_SEED} and {c.depth for c in tuning} == {1}
    rows = [
        dict(stream="digits", optimizer="sgd", lr=0.1, accuracy=0.8, loss=1.0, diverged_at=None),
        dict(stream="digits", optimizer="sgd", lr=0.3, accuracy=0.9, loss=None, diverged_at=5),
        dict(stream="digits", optimizer="sgd", lr=0.03, accuracy=0.7, loss=1.2, diverged_at=None),
        dict(stream="camera", optimizer="sgd", lr=0.1, accuracy=None, loss=0.02, diverged_at=None),
        dict(stream="camera", optimizer="sgd", lr=1.0, accuracy=None, loss=0.01, diverged_at=None),
        dict(stream="camera", optimizer="sgd", lr=3.0, accuracy=None, loss=None, diverged_at=9),
    ]
    assert fid.best_step_sizes(rows) == {("digits", "sgd"): 0.1, ("camera", "sgd"): 1.0}


def test_the_shuffled_control_is_cut_as_moving_digits_and_planned_once(monkeypatch):
    planned = []

    def cut(model, depth, how):  # a planned cut is timed: it may differ from one call to the next
        planned.append((model, depth))
        return (len(planned), 10 - len(planned))

    monkeypatch.setattr(fid, "cut", cut)
    configs = fid.configs(["digits", "shuffled", "camera"], [2], seeds=2)
    cuts = {s: {c.balance for c in configs if c.stream == s and c.depth == 2} for s in fid.STREAMS}
    assert planned == [("digits", 2), ("camera", 2)]
    assert cuts["digits"] == cuts["shuffled"] == {(1, 9)} and cuts["camera"] == {(2, 8)}


def test_summary_gaps_are_against_sequential():
    rows = [
        dict(stream="digits", label="sequential", depth=1, accuracy=0.80, loss=1.0),
        dict(stream="digits", label="D=2 stash", depth=2, accuracy=0.75, loss=1.2),
        dict(stream="camera", label="sequential", depth=1, accuracy=None, loss=0.010),
        dict(stream="camera", label="D=2 stash", depth=2, accuracy=None, loss=0.012),
    ]
    lines = {(line["stream"], line["label"]): line for line in fid.summarise(rows)}
    assert lines["digits", "D=2 stash"]["gap"] == pytest.approx(-5.0)
    assert lines["camera", "D=2 stash"]["gap"] == pytest.approx(20.0)
    table = fid.markdown(list(lines.values()))
    assert "| D=2 stash | 75.0% (-5.0) | 0.01200 (+20.0%) |" in table


def test_the_end_of_the_stream_has_its_own_gap():
    rows = [
        dict(stream="digits", label="sequential", depth=1, accuracy=0.80, late_accuracy=0.90),
        dict(stream="digits", label="D=2 stash", depth=2, accuracy=0.75, late_accuracy=0.88),
        dict(stream="camera", label="sequential", depth=1, loss=0.010, late_loss=0.004),
        dict(stream="camera", label="D=2 stash", depth=2, loss=0.012, late_loss=0.005),
    ]
    lines = {(line["stream"], line["label"]): line for line in fid.summarise(rows)}
    assert lines["digits", "D=2 stash"]["late_gap"] == pytest.approx(-2.0)
    assert lines["camera", "D=2 stash"]["late_gap"] == pytest.approx(25.0)
    table = fid.markdown(list(lines.values()))
    assert "| D=2 stash | 75.0% (-5.0; end -2.0) | 0.01200 (+20.0%; end +25.0%) |" in table
    assert "| sequential | 80.0% (+0.0) | 0.01000 (+0.0%) |" in table


@pytest.mark.parametrize("stream", ["digits", "camera"])
def test_the_last_quarter_is_scored_on_its_own(stream):
    # the streams are the same up to any length: the 4th frame's score is what 4 frames add to 3
    config = fid.Config(stream, 2, "stash")
    three, four = fid.run(config, 3), fid.run(config, 4)
    if stream == "digits":
        assert four["late_accuracy"] == pytest.approx(4 * four["accuracy"] - 3 * three["accuracy"])
        assert three["late_accuracy"] is None  # 3 // 4 = 0 frames in the last quarter
    else:  # the loss is a mean over results, one result per frame
        assert four["late_loss"] == pytest.approx(4 * four["loss"] - 3 * three["loss"], rel=1e-5)
        assert three["late_loss"] is None


def test_a_tiny_run_writes_json_markdown_and_png(tmp_path):
    args = [
        "fidelity",
        "--frames",
        "12",
        "--seeds",
        "1",
        "--depths",
        "2",
        "--streams",
        "digits,camera",
        "--optimizer",
        "sgd,adam",
        "--jobs",
        "1",
        "--out",
        str(tmp_path),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "fidelity.json").read_text())
    assert len(data["tuning"]) == 2 * (len(fid.LR_GRID["sgd"]) + len(fid.LR_GRID["adam"]))
    assert len(data["runs"]) == 2 * (1 + 7) + 2 * (1 + 10)
    best = fid.best_step_sizes(data["tuning"])
    for run in data["runs"]:
        assert run["frames"] == 12 and run["loss"] > 0
        assert (run["accuracy"] is None) == (run["stream"] == "camera")
        assert run["lr"] == best[run["stream"], run["optimizer"]]
    assert (tmp_path / "fidelity.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "fidelity.md").read_text()
    assert table.count("| sequential |") == 2
    assert f"### Adam (step size: digits {best['digits', 'adam']:g}, camera {best['camera', 'adam']:g})" in table


def test_sequential_is_the_same_run_whatever_the_seed_of_the_others():
    a = fid.run(fid.Config("digits", 1, seed=1), 20)
    b = fid.run(fid.Config("digits", 1, seed=1), 20)
    assert a["accuracy"] == b["accuracy"] and a["loss"] == b["loss"]


def test_a_diverged_run_is_a_result_not_a_crash():
    row = fid.run(fid.Config("digits", 2, "weight-stash", lr=1e6), 40)
    assert row["diverged_at"] is not None and row["loss"] is None
    assert 0 <= row["accuracy"] < 1
    lines = fid.summarise([fid.run(fid.Config("digits", 1), 5), row])
    assert lines[1]["diverged"] == 1
    assert "1/1 diverged" in fid.markdown(lines)


def test_the_headline_gives_the_best_configuration_and_the_default_at_each_depth():
    default = fid.default_label(4, "adam")
    assert default == "D=4 stash + step-scale + optimizer-prediction + long-momentum"
    rows = []
    for opt in ("sgd", "adam"):
        rows += [
            dict(stream="digits", optimizer=opt, lr=0.1, label="sequential", depth=1, accuracy=0.80),
            dict(stream="digits", optimizer=opt, lr=0.1, label="D=4 stash", depth=4, accuracy=0.70),
            dict(
                stream="digits",
                optimizer=opt,
                lr=0.1,
                label=fid.default_label(4, opt),
                depth=4,
                accuracy=0.75 if opt == "adam" else 0.60,
            ),
        ]
    text = fid.markdown(fid.summarise(rows))
    assert "| SGD | 4 | -10.0 stash | -20.0 |" in text
    assert "| Adam | 4 | -5.0 stash + step-scale + optimizer-prediction + long-momentum | -5.0 |" in text
    assert f"| {default} (default) | 75.0% (-5.0) |" in text

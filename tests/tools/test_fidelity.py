"""The fidelity benchmark on tiny settings: its rows, summary, table and plot."""

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
import torch
from click.testing import CliRunner

from partime.core.stage import config as stage_config
from partime.optim import MuonWithAdamW
from partime_tools.cli import main
from partime_tools.fidelity import runs as fid
from partime_tools.fidelity import tuning as fidelity_tuning

# What graph-stash adds at each depth, where partime has it: the compensations of stash.
GRAPH_STASH = (
    {"sgd": 4, "momentum": 7, "adam": 7, "nadam": 3, "muon": 3}
    if "graph-stash" in fid.GRAD_MODES
    else dict.fromkeys(fid.OPTIMIZERS, 0)
)
# NAdam and Muon: no option that reads the optimizer's state; "auto" (step-scale) is among those measured.
BASE = {"sgd": 7, "momentum": 10, "adam": 10, "nadam": 6, "muon": 6}
PER_DEPTH = {opt: n + GRAPH_STASH[opt] for opt, n in BASE.items()}


def test_even_balance():
    assert fid.even_balance(10, 8) == [2, 2, 1, 1, 1, 1, 1, 1]
    assert fid.even_balance(10, 1) == [10]
    assert fid.even_balance(8, 4) == [2, 2, 2, 2]


def test_configs_cover_sequential_and_every_mode_and_compensation():
    per_depth = {opt: sum(len(fid.compensations(m, opt)) for m in fid.GRAD_MODES) for opt in fid.OPTIMIZERS}
    assert per_depth == PER_DEPTH
    steps = {("digits", "sgd"): 0.1, ("digits", "adam"): 1e-3}
    configs = fid.configs(["digits"], [2, 8], seeds=2, step_sizes=steps)
    assert len(configs) == 2 * (1 + 2 * PER_DEPTH["sgd"]) + 2 * (1 + 2 * PER_DEPTH["adam"])
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
    configs = fid.configs(["digits", "shuffled", "camera"], [2], seeds=2, how="planned")
    cuts = {s: {c.balance for c in configs if c.stream == s and c.depth == 2} for s in fid.STREAMS}
    assert planned == [("digits", 2), ("camera", 2)]
    assert cuts["digits"] == cuts["shuffled"] == {(1, 9)} and cuts["camera"] == {(2, 8)}


def test_the_cuts_are_fixed_by_default_whatever_the_machine_times(monkeypatch):
    def timed(*args, **kwargs):
        raise AssertionError("a fixed cut is not planned")

    monkeypatch.setattr(fid, "plan", timed)
    configs = fid.configs(["digits", "shuffled", "camera"], [2, 4, 8], seeds=1)
    cuts = {(c.stream, c.depth): c.balance for c in configs if c.depth > 1}
    assert cuts == {
        ("digits", 2): (3, 7),
        ("digits", 4): (2, 1, 2, 5),
        ("digits", 8): (1, 1, 1, 1, 1, 1, 1, 3),
        ("shuffled", 2): (3, 7),
        ("shuffled", 4): (2, 1, 2, 5),
        ("shuffled", 8): (1, 1, 1, 1, 1, 1, 1, 3),
        ("camera", 2): (4, 4),
        ("camera", 4): (2, 2, 2, 2),
        ("camera", 8): (1, 1, 1, 1, 1, 1, 1, 1),
    }
    for (model, depth), balance in fid.FIXED_CUTS.items():  # every layer of the model, in D stages
        assert len(balance) == depth and sum(balance) == len(
            fid.camera_model() if model == "camera" else fid.digits_model()
        )
    assert fid.cut("digits", 1) == (10,)


def test_a_depth_without_a_fixed_cut_is_refused_with_the_other_cuts():
    with pytest.raises(
        ValueError,
        match=r"no fixed cut of the camera model at D = 3 \(fixed cuts: D = 2, 4, 8\); "
        r"pass cut 'planned' \(--cut planned\) or 'even'",
    ):
        fid.cut("camera", 3)
    assert fid.cut("camera", 3, "even") == (3, 3, 2)


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
    assert len(data["runs"]) == 2 * (1 + PER_DEPTH["sgd"]) + 2 * (1 + PER_DEPTH["adam"])
    best = fid.best_step_sizes(data["tuning"])
    for run in data["runs"]:
        assert run["frames"] == 12 and run["loss"] > 0
        assert (run["accuracy"] is None) == (run["stream"] == "camera")
        assert run["lr"] == best[run["stream"], run["optimizer"]]
    assert (tmp_path / "fidelity.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "fidelity.md").read_text()
    assert table.count("| sequential |") == 2
    assert f"### Adam (step size: digits {best['digits', 'adam']:g}, camera {best['camera', 'adam']:g})" in table


def test_rows_kept_without_their_history_still_make_the_report(tmp_path):
    rows = [
        fid.run(fid.Config("digits", depth, balance=fid.cut("digits", depth) if depth > 1 else None), 12)
        for depth in (1, 2)
    ]
    kept = [dict(rows[0]), dict(rows[1], history=None)]  # as a sweep keeps its rows, to keep them small
    paths = fid.write(kept, tmp_path)
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert "D=2 partime" in paths["markdown"].read_text()


def test_sequential_is_the_same_run_whatever_the_seed_of_the_others():
    a = fid.run(fid.Config("digits", 1, seed=1), 20)
    b = fid.run(fid.Config("digits", 1, seed=1), 20)
    assert a["accuracy"] == b["accuracy"] and a["loss"] == b["loss"]


def test_nadam_and_muon_are_made_as_the_bench_says():
    params = [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(4))]
    nadam = fid.optimizer_factory("nadam", 3e-3)(params)
    assert isinstance(nadam, torch.optim.NAdam)
    group = nadam.param_groups[0]
    assert (group["lr"], group["betas"], group["decoupled_weight_decay"]) == (3e-3, (0.99, 0.999), True)
    assert group["momentum_decay"] == 0.004  # torch's default, as AsyncPP runs it
    muon = fid.optimizer_factory("muon", 1e-3)(params)
    assert isinstance(muon, MuonWithAdamW) and [g["lr"] for g in muon.param_groups] == [1e-3, 1e-3]
    assert set(fid.LR_GRID) == set(fid.SMALLER_STEP) == set(fid.LARGER_STEP) == set(fid.OPTIMIZERS)
    assert set(fid.OPTIMIZER_NAMES) == set(fid.OPTIMIZERS)
    with pytest.raises(ValueError, match="choose from sgd, momentum, adam, nadam, muon"):
        fid.optimizer_factory("lion", 1e-3)


@pytest.mark.parametrize("optimizer", ["nadam", "muon"])
def test_nadam_and_muon_learn_every_stream_in_the_bench(optimizer):
    for stream in ("digits", "camera"):
        first = fid.run(
            fid.Config(stream, 2, "graph-stash", seed=1, balance=fid.cut(stream, 2), optimizer=optimizer, lr=3e-3), 16
        )
        again = fid.run(
            fid.Config(stream, 2, "graph-stash", seed=1, balance=fid.cut(stream, 2), optimizer=optimizer, lr=3e-3), 16
        )
        assert first["loss"] == again["loss"] and first["diverged_at"] is None
        plain = fid.run(
            fid.Config(stream, 2, "graph-stash", seed=1, balance=fid.cut(stream, 2), optimizer="adam", lr=3e-3), 16
        )
        assert plain["loss"] != first["loss"]  # the optimizer counts


def test_a_diverged_run_is_a_result_not_a_crash():
    row = fid.run(fid.Config("digits", 2, "weight-stash", lr=1e6), 40)
    assert row["diverged_at"] is not None and row["loss"] is None
    assert 0 <= row["accuracy"] < 1
    lines = fid.summarise([fid.run(fid.Config("digits", 1), 5), row])
    assert lines[1]["diverged"] == 1
    assert "1/1 diverged" in fid.markdown(lines)


def test_the_headline_gives_the_best_configuration_and_the_default_at_each_depth():
    default = fid.default_label(4, "adam")
    assert default == f"D=4 {fid.DEFAULT_GRAD_MODE} + step-scale + optimizer-prediction + long-momentum"
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
    assert f"| Adam | 4 | -5.0 {default.removeprefix('D=4 ')} | -5.0 |" in text
    assert f"| {default} (default) | 75.0% (-5.0) |" in text


def test_the_grad_modes_and_the_default_are_the_librarys():
    assert fid.GRAD_MODES is stage_config.GRAD_MODES
    assert fid.DEFAULT_GRAD_MODE == stage_config.StageConfig(1).grad_mode
    assert fid.default_label(2, "sgd") == f"D=2 {fid.DEFAULT_GRAD_MODE} + step-scale + delay-correction"
    for opt in fid.OPTIMIZERS:  # graph-stash is measured as stash is, once the library has it
        assert fid.compensations("graph-stash", opt) == fid.compensations("stash", opt)
        assert fid.automatic(opt) in fid.compensations(fid.DEFAULT_GRAD_MODE, opt)


def test_configs_run_only_what_is_picked():
    picks = {"default", "partime", "stash+delay-correction", "weight-stash"}
    configs = fid.configs(["digits"], [2, 4], 1, "even", {("digits", "momentum"): 0.01}, only=picks)
    for depth in (2, 4):
        assert {c.label for c in configs if c.depth == depth} == {
            f"D={depth} partime",
            f"D={depth} stash + delay-correction",
            f"D={depth} weight-stash",
            fid.default_label(depth, "momentum"),
        }
    assert [c.label for c in configs if c.depth == 1] == ["sequential"]
    assert "stash+optimizer-prediction" in fid.choices(["momentum"])
    assert "stash+optimizer-prediction" not in fid.choices(["sgd"])  # plain SGD has no momentum to predict with
    assert fid.choices(["sgd"])[0] == "default"


def test_each_configuration_is_chosen_its_own_best_step_size():
    def row(label, lr, accuracy=None, loss=None, diverged_at=None, stream="digits", optimizer="sgd"):
        return dict(
            stream=stream,
            optimizer=optimizer,
            label=label,
            lr=lr,
            accuracy=accuracy,
            loss=loss,
            diverged_at=diverged_at,
        )

    rows = [
        row("sequential", 0.1, 0.80, 1.0),
        row("sequential", 0.3, 0.85, 0.9),
        row("sequential", 1.0, 0.60, 1.5),
        row("D=2 stash", 0.01, 0.70, 1.1),
        row("D=2 stash", 0.03, 0.78, 1.0),
        row("D=2 stash", 0.1, 0.95, None, diverged_at=30),  # a diverged run never wins
        row("D=2 stash", 0.3, 0.75, 1.0),
        row("D=2 stash", 0.1, 0.90, 0.8, optimizer="adam"),  # another optimizer: its own choice
        row("D=2 stash", 0.3, 0.70, 0.9, optimizer="adam"),
        row("sequential", 0.1, loss=0.02, stream="camera"),
        row("sequential", 0.3, loss=0.01, stream="camera"),
        row("D=2 stash", 0.1, loss=0.03, stream="camera"),
        row("D=2 stash", 0.3, loss=None, diverged_at=4, stream="camera"),
    ]
    assert fid.own_best_steps(rows) == {
        ("digits", "sgd", "sequential"): 0.3,
        ("digits", "sgd", "D=2 stash"): 0.03,
        ("digits", "adam", "D=2 stash"): 0.1,
        ("camera", "sgd", "sequential"): 0.3,
        ("camera", "sgd", "D=2 stash"): 0.1,
    }


def test_own_steps_are_tuned_on_the_tuning_seed_and_reported_on_the_others():
    assert fid.own_grid("sgd") == (0.01, *fid.LR_GRID["sgd"], 10.0)
    assert all(fid.own_grid(opt)[0] < fid.LR_GRID[opt][0] for opt in fid.OPTIMIZERS)
    assert all(fid.own_grid(opt)[-1] > fid.LR_GRID[opt][-1] for opt in fid.OPTIMIZERS)
    tuning = fid.own_step_tuning(["digits", "camera"], [2], ["sgd", "adam"], "even", {"default", "stash"})
    assert {c.seed for c in tuning} == {fid.TUNING_SEED}
    keys = dict.fromkeys(fidelity_tuning.own_key(c) for c in tuning)
    assert len(keys) == 2 * 2 * 3  # streams × optimizers × (sequential, stash, default)
    for key in keys:
        assert tuple(c.lr for c in tuning if fidelity_tuning.own_key(c) == key) == fid.own_grid(key[1])
    steps = {key: fid.own_grid(key[1])[i % 3] for i, key in enumerate(keys)}
    reported = fid.at_own_steps(tuning, steps, 3)
    assert fid.TUNING_SEED not in fid.reported_seeds(3)
    assert sorted({c.seed for c in reported}) == list(fid.reported_seeds(3)) == [1, 2, 3]
    assert len(reported) == 3 * len(keys)
    assert all(c.lr == steps[fidelity_tuning.own_key(c)] for c in reported)
    assert {c.balance for c in reported if c.depth == 2 and c.stream == "digits"} == {
        c.balance for c in tuning if c.depth == 2 and c.stream == "digits"
    }


def test_the_own_step_table_names_each_ones_step_size():
    default = fid.default_label(2, "sgd")
    rows = [
        dict(stream="digits", optimizer="sgd", lr=0.1, label="sequential", depth=1, accuracy=0.80),
        dict(stream="digits", optimizer="sgd", lr=0.03, label="D=2 stash", depth=2, accuracy=0.82),
        dict(stream="digits", optimizer="sgd", lr=0.3, label=default, depth=2, accuracy=0.78),
        dict(stream="camera", optimizer="sgd", lr=1.0, label="sequential", depth=1, loss=0.010),
        dict(stream="camera", optimizer="sgd", lr=0.3, label="D=2 stash", depth=2, loss=0.012),
        dict(stream="camera", optimizer="sgd", lr=0.1, label=default, depth=2, loss=0.011),
    ]
    lines = fid.summarise(rows)
    text = fid.markdown(lines, own_step=True)
    assert text.startswith("## Each at its own best step")
    comp = default.removeprefix("D=2 ")
    assert (
        f"| SGD | 2 | lr 0.1 | +2.0 stash (lr 0.03) | -2.0 (lr 0.3) | lr 1 | +10.0% {comp} (lr 0.1) | +10.0% (lr 0.1) |"
        in text
    )
    assert "| D=2 stash | 82.0% (+2.0) at lr 0.03 | 0.01200 (+20.0%) at lr 0.3 |" in text
    assert "### SGD (each at its own step size; sequential: digits 0.1, camera 1)" in text
    (digits, camera) = fid.own_step_summary(lines)
    assert digits["sequential_lr"] == 0.1 and digits["best"]["label"] == "D=2 stash" and digits["best"]["lr"] == 0.03
    assert camera["default"]["gap"] == pytest.approx(10.0) and camera["default"]["lr"] == 0.1
    assert "Each at its own" not in fid.markdown(lines)  # without own_step: today's tables


def test_a_tiny_own_step_run_writes_the_own_step_table(tmp_path, monkeypatch):
    monkeypatch.setattr(fidelity_tuning, "LR_GRID", {**fidelity_tuning.LR_GRID, "sgd": (0.1, 0.3)})
    args = "fidelity --frames 12 --seeds 1 --depths 2 --streams digits --optimizer sgd --configs default"
    result = CliRunner().invoke(main, [*args.split(), "--own-step", "--jobs", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "fidelity.json").read_text())
    default = fid.default_label(2, "sgd")
    assert {(r["label"], r["lr"]) for r in data["tuning"]} == {
        (label, lr) for label in ("sequential", default) for lr in (0.01, 0.1, 0.3, 10.0)
    }
    assert {r["seed"] for r in data["tuning"]} == {fid.TUNING_SEED}
    steps = fid.own_best_steps(data["tuning"])
    assert [(r["label"], r["seed"]) for r in data["runs"]] == [("sequential", 1), (default, 1)]
    assert all(r["lr"] == steps[fidelity_tuning.own_key(r)] for r in data["runs"])
    (line,) = data["own_step"]
    assert line["best"]["label"] == line["default"]["label"] == default
    assert line["default"]["lr"] == steps["digits", "sgd", default]
    table = (tmp_path / "fidelity.md").read_text()
    assert "## Each at its own best step" in table
    assert f"| SGD | 2 | lr {steps['digits', 'sgd', 'sequential']:g} |" in table
    assert (tmp_path / "fidelity.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unknown_configuration_is_refused_with_the_choices():
    args = "fidelity --frames 12 --seeds 1 --depths 2 --streams digits --optimizer sgd --configs stash,stsh"
    result = CliRunner().invoke(main, args.split())
    assert result.exit_code == 2
    assert "--configs" in result.output and "'stash,stsh'" in result.output
    assert "default, partime" in result.output and "stash+delay-correction" in result.output


KILLED_SWEEP = """
import time
from partime_tools.fidelity.pool import worker_pool
if __name__ == "__main__":
    with worker_pool(2) as pool:
        futures = [pool.submit(time.sleep, 600) for _ in range(2)]
        print(" ".join(str(p) for p in pool._processes), flush=True)
        time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the workers are sent SIGTERM by Linux's prctl")
def test_a_sweep_killed_by_a_signal_leaves_no_worker_computing():
    parent = subprocess.Popen([sys.executable, "-c", KILLED_SWEEP], stdout=subprocess.PIPE, text=True)
    try:
        workers = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
        assert len(workers) == 2
        os.kill(parent.pid, signal.SIGKILL)  # no clean-up runs in the parent
        parent.wait(timeout=10)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert alive == [], alive
    finally:
        parent.kill()

"""The live view: the drop schedule against literal tables and the library's own drop, a run, the CLI."""

import json

import click
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from partime import Pipeline
from partime.sources import FakeClock, at_rate
from partime_tools.cli import main
from partime_tools.fidelity import live_runs as runs
from partime_tools.fidelity.live import Entry, drop_schedule
from partime_tools.fidelity.live_cli import parse_depths, parse_rates, parse_times
from partime_tools.fidelity.live_clock import check_real, measure
from partime_tools.fidelity.runs import FIXED_CUTS


def table(entries):
    return [(e.index, round(e.arrived, 9), round(e.went_in, 9)) for e in entries]


# 10 samples at 10 per second (sample k arrives at k/10 s); 0.15 s per sample taken.
#
#   free at  arrived, waiting       goes in  dropped
#   0        0                      0        -
#   0.15     1 (0.1)                1        -
#   0.30     2 (0.2), 3 (0.3)       3        2
#   0.45     4 (0.4)                4        -
#   0.60     5 (0.5), 6 (0.6)       6        5
#   0.75     7 (0.7)                7        -
#   0.90     8 (0.8), 9 (0.9)       9        8
BY_HAND = [(0, 0.0, 0.0), (1, 0.1, 0.15), (3, 0.3, 0.3), (4, 0.4, 0.45), (6, 0.6, 0.6), (7, 0.7, 0.75), (9, 0.9, 0.9)]


def test_the_drop_schedule_by_hand():
    assert table(drop_schedule(10, rate=10, seconds_per_sample=0.15)) == BY_HAND


def test_nothing_is_dropped_when_a_sample_takes_no_longer_than_the_gap():
    for seconds in (0.0, 0.05, 0.1):
        assert table(drop_schedule(10, 10, seconds)) == [(k, k / 10, k / 10) for k in range(10)]


def test_a_whole_number_of_gaps_takes_the_sample_arriving_as_it_gets_free():
    # 0.2 s: free at 0.2, 0.4, ... as sample 2, 4, ... arrives; then 9 waits for it from 0.9 to 1.0
    assert table(drop_schedule(10, 10, 0.2)) == [
        (0, 0, 0),
        (2, 0.2, 0.2),
        (4, 0.4, 0.4),
        (6, 0.6, 0.6),
        (8, 0.8, 0.8),
        (9, 0.9, 1.0),
    ]
    assert [e.index for e in drop_schedule(10, 10, 0.3)] == [0, 3, 6, 9]
    assert [e.index for e in drop_schedule(31, 10, 0.7)] == [0, 7, 14, 21, 28, 30]  # 0.7 * 10 is no whole float


def test_an_empty_stream_and_bad_arguments():
    assert drop_schedule(0, 10, 0.1) == []
    assert drop_schedule(1, 10, 5.0) == [Entry(0, 0.0, 0.0)]
    with pytest.raises(ValueError, match="rate must be .* not 0"):
        drop_schedule(5, 0, 0.1)
    with pytest.raises(ValueError, match="seconds_per_sample .* not -1"):
        drop_schedule(5, 10, -1)
    with pytest.raises(ValueError, match="samples must be .* not 2.5"):
        drop_schedule(2.5, 10, 0.1)


@pytest.mark.parametrize("seconds", [1 / 16, 1 / 8, 3 / 16, 1 / 4, 5 / 8])
def test_the_schedule_is_what_a_pipeline_under_drop_keeps(seconds):
    # a one-stage pipeline on a fake clock, its caller busy `seconds` after each result: the samples
    # that went in, and when, are the schedule's (binary fractions: the clock's sums are exact)
    clock = FakeClock()
    kept = []
    with Pipeline(nn.Sequential(nn.Linear(2, 2)), [1], executor="inline") as pipe:
        for r in pipe.stream(at_rate([torch.zeros(2)] * 20, 8, clock=clock), when_behind="drop"):
            if not r.dropped:
                kept.append((r.index, r.offered_at, clock.now()))
                clock.advance(seconds)
    assert table(drop_schedule(20, 8, seconds)) == kept


def config(contender, seconds, stream="digits"):
    balance = (10,) if contender == "plain" else (3, 7)
    if stream == "camera":
        balance = (8,) if contender == "plain" else (4, 4)
    return runs.LiveConfig(stream, contender, "sgd", 0.1, 1.5, 100.0, seconds, balance, seed=1)


@pytest.mark.parametrize("stream", ["digits", "camera"])
def test_a_contender_learns_only_the_samples_it_keeps(stream):
    row = runs.run(config("plain", 0.025, stream), 20, held_out=8)  # 2.5 gaps: 0, 2, 5, 7, 10, ...
    kept = drop_schedule(20, 100.0, 0.025)
    assert [e.index for e in kept] == [0, 2, 5, 7, 10, 12, 15, 17, 19]
    assert row["kept"] == 9 and row["frames"] == 20 and row["seconds"] == pytest.approx(0.2)
    assert [t for t, _ in row["history"]] == [e.arrived for e in kept]
    assert row["held_out"] is not None and row["diverged_at"] is None
    assert (row["metric"] == "loss") == (stream == "camera")
    pipelined = runs.run(config("pipeline", 0.005, stream), 20, held_out=8)
    assert pipelined["kept"] == 20 and pipelined["label"].startswith("D=2 ")


@pytest.mark.parametrize("optimizer", ["nadam", "muon"])
def test_nadam_and_muon_contend_in_the_live_view(optimizer):
    rows = [
        runs.run(runs.LiveConfig("camera", c, optimizer, 3e-3, 1.5, 100.0, s, (4, 4), seed=1), 16, held_out=4)
        for c, s in (("plain", 0.025), ("pipeline", 0.005))
    ]
    assert [r["kept"] for r in rows] == [len(drop_schedule(16, 100.0, 0.025)), 16]
    assert all(r["diverged_at"] is None and r["held_out"] is not None for r in rows)
    plain = runs.pipeline_label("sgd", 2).split(" + ")[0]  # the default grad mode
    assert rows[1]["label"] == runs.pipeline_label(optimizer, 2) == plain + " + step-scale"  # what "auto" chooses
    assert rows[0]["held_out"] != rows[1]["held_out"]


def test_the_pipeline_learns_with_the_library_defaults():
    import inspect

    default = inspect.signature(Pipeline).parameters["grad_mode"].default
    assert runs.pipeline_label("sgd", 2).startswith(f"D=2 {default}")
    assert runs.pipeline_label("adam", 8).startswith(f"D=8 {default}")


def test_a_diverged_run_is_a_result():
    bad = runs.LiveConfig("digits", "pipeline", "sgd", 1e6, 1.5, 100.0, 0.005, (3, 7), seed=1)
    row = runs.run(bad, 40, held_out=4)
    assert row["diverged_at"] is not None and row["held_out"] is None
    assert 0 <= row["score"] < 1  # the kept samples after it count as misses


def test_the_options_are_checked():
    assert parse_rates("1.5, 2") == (1.5, 2.0)
    for bad in ("", "0", "x,2", "inf"):
        with pytest.raises(Exception, match="--rates|above 0"):
            parse_rates(bad)
    rows = parse_times("10,6", ["digits"], ["sgd", "adam"], [2])
    assert [(t["optimizer"], t["plain_ms"], t["pipeline_ms"]) for t in rows] == [("sgd", 10, 6), ("adam", 10, 6)]
    with pytest.raises(Exception, match="plain_ms,pipeline_ms"):
        parse_times("10", ["digits"], ["sgd"], [2])
    assert parse_depths((2, 4, 8)) == (2, 4, 8)
    for bad in ((1, 2), (2, 2)):
        with pytest.raises(click.BadParameter, match="at least 2"):
            parse_depths(bad)


def test_given_times_at_each_depth():
    def got(value, depths):
        return [
            (t["optimizer"], t["depth"], t["plain_ms"], t["pipeline_ms"])
            for t in parse_times(value, ["digits"], ["sgd", "adam"], depths)
        ]

    # one pair: the pipeline's time at every depth
    assert got("10,6", [2, 4, 8]) == [(o, d, 10, 6) for o in ("sgd", "adam") for d in (2, 4, 8)]
    # the plain loop's, then one per depth in the order of --depths
    assert got("10,6,7,9", [8, 2, 4]) == [(o, d, 10, ms) for o in ("sgd", "adam") for d, ms in ((8, 6), (2, 7), (4, 9))]
    for bad in ("10,6,7", "10,6,7,8,9", "10,0,7,8", "10,6,x,8"):
        with pytest.raises(click.BadParameter, match="one pipeline time per depth of --depths 2,4,8"):
            parse_times(bad, ["digits"], ["sgd"], [2, 4, 8])


def test_times_from_an_earlier_live_json_old_and_new(tmp_path):
    old = tmp_path / "old.json"  # before the live view had depths: no depth, read as D = 2
    row = dict(model="digits", optimizer="sgd", plain_ms=1.2, pipeline_ms=1.3, balance=[3, 7], source="measured")
    old.write_text(json.dumps(dict(times=[row])))
    (taken,) = parse_times(str(old), ["digits"], ["sgd"], [2])
    assert (taken["depth"], taken["plain_ms"], taken["pipeline_ms"], taken["balance"]) == (2, 1.2, 1.3, [3, 7])
    assert taken["source"] == f"from {old} (measured)"
    with pytest.raises(click.BadParameter, match=r"no times for digits/sgd at D = 4\b"):
        parse_times(str(old), ["digits"], ["sgd"], [2, 4])
    new = tmp_path / "new.json"
    rows = [dict(row, depth=d, pipeline_ms=ms, balance=list(FIXED_CUTS["digits", d])) for d, ms in ((2, 1.3), (4, 2.5))]
    new.write_text(json.dumps(dict(times=rows)))
    assert [(t["depth"], t["pipeline_ms"]) for t in parse_times(str(new), ["digits"], ["sgd"], [4, 2])] == [
        (4, 2.5),
        (2, 1.3),
    ]
    with pytest.raises(click.BadParameter, match=r"no times for digits/sgd at D = 8, digits/adam at D = 2"):
        parse_times(str(new), ["digits"], ["sgd", "adam"], [2, 8])
    rows[1]["plain_ms"] = 1.4  # the rates are multiples of the one plain loop's time
    new.write_text(json.dumps(dict(times=rows)))
    with pytest.raises(click.BadParameter, match="more than one plain loop's time"):
        parse_times(str(new), ["digits"], ["sgd"], [2, 4])


def test_given_times_need_a_fixed_cut_at_each_depth(tmp_path):
    args = ["fidelity", "--live", "--frames", "20", "--streams", "digits", "--optimizer", "sgd", "--depths", "2,3"]
    result = CliRunner().invoke(main, args + ["--times", "10,6", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "no fixed cut of the digits model at D = 3" in result.output
    assert not (tmp_path / "live.json").exists()


def tiny_live_view(tmp_path, monkeypatch, depths: str, times: str) -> dict:
    """``partime fidelity --live`` on 20 samples of moving digits with SGD at two step sizes, one
    reported seed, the times given; what it wrote to ``live.json``."""
    monkeypatch.setattr(runs, "LR_GRID", {"sgd": (0.03, 0.1)})
    args = ["fidelity", "--live", "--frames", "20", "--seeds", "1", "--streams", "digits", "--optimizer", "sgd"]
    args += ["--depths", depths, "--times", times, "--jobs", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return json.loads((tmp_path / "live.json").read_text())


def test_a_tiny_live_view_writes_its_table_json_and_plot(tmp_path, monkeypatch):
    data = tiny_live_view(tmp_path, monkeypatch, "2", "10,6")
    assert len(data["tuning"]) == 2 * 2 * 2  # rates x contenders x step sizes
    assert len(data["runs"]) == 2 * 2 and {r["seed"] for r in data["runs"]} == {1}
    rates = {1.5: 150.0, 2.0: 200.0}  # 1.5 and 2 times 1 / 10 ms
    for r in data["runs"]:
        assert r["rate"] == pytest.approx(rates[r["multiple"]])
        assert r["kept"] == len(drop_schedule(20, r["rate"], 0.010 if r["contender"] == "plain" else 0.006))
        assert r["held_out_samples"] == 20
    kept = {(r["multiple"], r["contender"]): r["kept"] for r in data["runs"]}
    assert kept == {(1.5, "plain"): 14, (1.5, "pipeline"): 20, (2.0, "plain"): 11, (2.0, "pipeline"): 17}
    assert [t["source"] for t in data["times"]] == ["given"]
    table_text = (tmp_path / "live.md").read_text()
    assert table_text.count("| digits | SGD |") == 2 and "| 1.5× (150/s) | 2 | 70% / 100% |" in table_text
    assert (tmp_path / "live.png").read_bytes()[:4] == b"\x89PNG"
    again = parse_times(str(tmp_path / "live.json"), ["digits"], ["sgd"], [2])  # a re-run takes these times
    assert again[0]["plain_ms"] == 10 and again[0]["balance"] == data["times"][0]["balance"]


def test_a_tiny_live_view_at_two_depths_runs_one_plain_loop(tmp_path, monkeypatch):
    data = tiny_live_view(tmp_path, monkeypatch, "2,4", "10,6,8")
    contenders = [(r["contender"], r["depth"]) for r in data["runs"]]
    # per rate: the plain loop once, then the pipeline at each depth
    assert contenders == [("plain", 1), ("pipeline", 2), ("pipeline", 4)] * 2
    assert len(data["tuning"]) == 2 * 3 * 2  # rates x (plain + 2 depths) x step sizes
    ms = {1: 0.010, 2: 0.006, 4: 0.008}
    for r in data["runs"]:
        assert r["rate"] == pytest.approx(150.0 if r["multiple"] == 1.5 else 200.0)  # the plain loop's 10 ms
        assert r["kept"] == len(drop_schedule(20, r["rate"], ms[r["depth"]]))
        assert r["balance"] == ([10] if r["depth"] == 1 else list(FIXED_CUTS["digits", r["depth"]]))
        assert r["label"] == ("plain loop" if r["depth"] == 1 else runs.pipeline_label("sgd", r["depth"]))
    assert [(t["depth"], t["pipeline_ms"], t["balance"]) for t in data["times"]] == [
        (2, 6, [3, 7]),
        (4, 8, [2, 1, 2, 5]),
    ]
    summary = [(x["multiple"], x["contender"], x["depth"]) for x in data["summary"]]
    assert summary == [(m, c, d) for m in (1.5, 2.0) for c, d in (("plain", 1), ("pipeline", 2), ("pipeline", 4))]
    comparisons = data["comparisons"]
    assert [(c["multiple"], c["depth"]) for c in comparisons] == [(1.5, 2), (1.5, 4), (2.0, 2), (2.0, 4)]
    for c in comparisons:  # each depth against the same plain loop
        assert c["plain"] == next(x for x in data["summary"] if x["multiple"] == c["multiple"] and x["depth"] == 1)
        assert c["pipeline"]["depth"] == c["depth"]
        assert c["held_out_gap"] == pytest.approx(100 * (c["pipeline"]["held_out"] - c["plain"]["held_out"]))
        assert c["better"] == ("pipeline" if c["held_out_gap"] > 0 else "plain" if c["held_out_gap"] < 0 else None)
    table_text = (tmp_path / "live.md").read_text()
    rows = [line for line in table_text.splitlines() if line.startswith("| digits | SGD |")]
    assert len(rows) == 4 and [line.split(" | ")[3] for line in rows] == ["2", "4", "2", "4"]
    assert "| 1.5× (150/s) | 2 | 70% / 100% |" in table_text and "| 2× (200/s) | 4 | 55% / 65% |" in table_text
    assert "| digits | sgd | 4 | 10.00 | 8.00 | [2, 1, 2, 5] | given |" in table_text
    assert "against the pipeline at D = 2, 4 with its defaults" in table_text


def test_a_live_view_from_old_comparisons_reads_them_at_d2():
    from partime_tools.fidelity import live_report

    line = dict(label="D=2 stash + step-scale", rate=150.0, kept=0.7, lr=0.1, score=0.5, held_out=0.6, diverged=0)
    old = dict(stream="digits", optimizer="sgd", multiple=1.5, metric="accuracy", gap=1.0, held_out_gap=2.0)
    old |= dict(plain=dict(line, label="plain loop"), pipeline=line, better="pipeline")
    time = dict(model="digits", optimizer="sgd", plain_ms=1.0, pipeline_ms=2.0, balance=[3, 7], source="measured")
    text = live_report.markdown([old], [time])
    assert "| digits | SGD | 1.5× (150/s) | 2 | 70% / 70% |" in text
    assert "| digits | sgd | 2 | 1.00 | 2.00 | [3, 7] | measured |" in text
    assert "at D = 2 with its defaults (stash + step-scale)" in text


def test_measuring_times_the_plain_loop_once_and_a_pipeline_at_each_depth():
    times, cuts = measure("digits", "sgd", (2, 3), samples=3, warmup=2)
    assert times.plain > 0 and sorted(times.pipeline) == [2, 3] and all(s > 0 for s in times.pipeline.values())
    assert {d: (len(c), sum(c)) for d, c in cuts.items()} == {2: (2, 10), 3: (3, 10)}


def test_the_real_clock_check_runs():
    # the plain loop and the pipeline at the depths of the step sizes (one here: each is a process pipeline)
    check = check_real("digits", "sgd", {1: 0.1, 3: 0.1}, runs.Times(0.002, {2: 0.05, 3: 0.002}), 200.0, 12)
    assert [(got["contender"], got["depth"]) for got in check["contenders"]] == [("plain", 1), ("pipeline", 3)]
    for got in check["contenders"]:
        assert 1 <= got["kept"] <= 12 and got["predicted"] == 12 and not got["diverged"]

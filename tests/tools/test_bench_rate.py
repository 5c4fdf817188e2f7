"""``partime bench --rate``: the search for the highest rate without a drop, on contenders of known
capacity timed on a fake clock (so every figure is exact), the figures of a run, and the command
(what it reports, not how fast)."""

import json
import math
from contextlib import contextmanager

import pytest
from click.testing import CliRunner

from partime.sources import FakeClock
from partime_tools.bench import rate as bench_rate
from partime_tools.bench.rate import FRACTIONS, point, timed
from partime_tools.bench.rate_contenders import Live, LiveContender, StreamTimes, plain_loop
from partime_tools.bench.rate_search import RANGE, Search, sustained_rates
from partime_tools.cli import main

WARMUP, SAMPLES = 20, 100


def costing(seconds, clock):
    """A loop's work on each item: ``seconds`` on ``clock``."""
    return lambda k, item: clock.advance(seconds)


def probe(cost, warmup=WARMUP, samples=SAMPLES):
    """A run at a rate of a loop whose every item costs ``cost`` seconds on a fake clock: its drops."""

    def run(fps):
        clock = FakeClock()
        return sum(
            timed(plain_loop(range(warmup + samples + 5), costing(cost, clock), fps, clock), warmup, samples).dropped
        )

    return run


def test_a_plain_loop_on_a_fake_clock_takes_the_newest_item_and_drops_the_ones_it_replaced():
    clock = FakeClock()
    run = plain_loop(range(6), costing(0.25, clock), 10, clock)  # one every 0.1 s, each taking 0.25 s
    # 0 at t=0, done at .25, when the source begins: k arrives at .25 + k / 10. 1 (done .6); then 2
    # and 3 have arrived: 3 (done .85); then 4 and 5: 5 (done 1.1)
    assert run.fps == 10 and run.dropped == [False, False, True, False, True, False]
    assert run.arrived == pytest.approx([0.0, 0.35, 0.45, 0.55, 0.65, 0.75])
    kept = [h for h in run.handed if not math.isnan(h)]
    assert kept == pytest.approx([0.25, 0.6, 0.85, 1.1]) and sum(math.isnan(h) for h in run.handed) == 2
    recorded = plain_loop(range(3), costing(0.25, clock), None, clock)  # as fast as the loop goes: none dropped
    assert recorded.fps is None and recorded.dropped == [False] * 3
    assert recorded.arrived == pytest.approx([1.1, 1.35, 1.6]) and recorded.handed == pytest.approx([1.35, 1.6, 1.85])


def test_the_search_climbs_then_bisects_to_the_highest_rate_kept_on_its_grid():
    # capacity 100 items/s; from 80 on a grid of 5 %: 80, 84, 88.2, 92.6, 97.2 kept, 102.1 dropped
    (search,) = sustained_rates({"loop": probe(0.01)}, {"loop": 80.0}, grid=1.05).values()
    ks = (0, 4, 12, 8, 6, 5)  # up 4, then 8; bisect (4, 12)
    assert [fps for fps, _ in search.probes] == pytest.approx([80 * 1.05**k for k in ks])
    assert [drops > 0 for _, drops in search.probes] == [False, False, True, True, True, True]
    assert (search.kept, search.dropped) == (4, 5)
    assert search.sustained == pytest.approx(80 * 1.05**4) and search.dropped_at == pytest.approx(80 * 1.05**5)


def test_the_search_descends_from_a_start_above_the_capacity():
    # from 150: 150, 123.4 dropped, 83.5 kept; then 101.5 dropped, 92.1 and 96.7 kept
    (search,) = sustained_rates({"loop": probe(0.01)}, {"loop": 150.0}, grid=1.05).values()
    ks = (0, -4, -12, -8, -10, -9)  # down 4, then 8; bisect (-12, -4)
    assert [fps for fps, _ in search.probes] == pytest.approx([150 * 1.05**k for k in ks])
    assert [drops > 0 for _, drops in search.probes] == [True, True, False, True, False, False]
    assert search.sustained == pytest.approx(150 * 1.05**-9)


def test_a_rate_that_drops_once_is_tried_once_more():
    runs = iter([3, 0, 1, 2, 0, 5, 5])  # k = 0: kept at the second try; 4: dropped twice; 2: kept; 3: dropped twice
    (search,) = sustained_rates({"flaky": lambda fps: next(runs)}, {"flaky": 100.0}).values()
    assert [drops for _, drops in search.probes] == [0, 1, 0, 5]
    assert (search.kept, search.dropped) == (2, 3)  # 0 and 2 kept, 4 and 3 dropped: done


def test_warm_up_drops_do_not_count():
    # 25 % too fast: the loop falls behind one item every 4, from the start; with a warm-up of all
    # but the last item it is behind only within the warm-up
    assert probe(0.0125, warmup=0, samples=40)(100.0) > 0
    clock = FakeClock()
    run = plain_loop(range(40), costing(0.0125, clock), 100.0, clock)
    assert any(run.dropped[:-1]) and not run.dropped[-1]
    assert sum(timed(run, 39, 1).dropped) == 0


def test_several_searches_run_interleaved_each_round_starting_one_later():
    ran = []

    def capacity(name, limit):
        def run(fps):
            ran.append(name)
            return int(fps > limit)

        return run

    found = sustained_rates({"a": capacity("a", 10), "b": capacity("b", 200)}, {"a": 10.5, "b": 100.0})
    assert ran[:5] == ["a", "a", "b", "b", "a"]  # round 0: a (dropped: once more), b; round 1: b, a
    assert found["a"].sustained <= 10 < found["a"].dropped_at and found["a"].dropped_at / found["a"].sustained == 1.02
    assert found["b"].sustained <= 200 < found["b"].dropped_at


def test_a_search_looks_no_further_than_its_range():
    with pytest.raises(RuntimeError, match=f"never: kept up even at .*, {RANGE:g} times its start"):
        sustained_rates({"never": lambda fps: 0}, {"never": 10.0})
    (always,) = sustained_rates({"always": lambda fps: 1}, {"always": 10.0}).values()
    ks = (0, -4, -12, -28, -60, -105)  # down 4, 8, 16, 32, then to the end of the range
    assert [fps for fps, _ in always.probes] == pytest.approx([10 * 1.02**k for k in ks])
    assert 1.02**-105 >= 1 / RANGE > 1.02**-106 and always.sustained == 0.0 and always.done
    with pytest.raises(ValueError, match="above 0"):
        Search(0.0)
    with pytest.raises(RuntimeError, match="not done"):
        Search(10.0).sustained


def test_the_figures_of_runs_at_one_rate_take_their_timed_frames_together():
    nan = math.nan
    one = StreamTimes(10.0, [0.0, 0.1, 0.2, 0.3], [0.05, nan, 0.35, 0.4], [False, True, False, False])
    two = StreamTimes(10.0, [5.0, 5.1, 5.2, 5.3], [5.5, 5.2, nan, 5.4], [False, False, True, False])
    figures = point([one, two], warmup=1, samples=3)  # frames 1, 2, 3 of each: two dropped, latencies .15 .1 .1 .1
    assert figures["offered"] == 6 and figures["dropped"] == 2 and figures["offered_fps"] == 10.0
    assert figures["kept_fps"] == pytest.approx(10.0 * 4 / 6)
    assert figures["latency_p50_ms"] == pytest.approx(100.0) and figures["latency_p99_ms"] == pytest.approx(150.0)
    with pytest.raises(ValueError, match="a run of 4 frames has no 4 timed after a warm-up of 1"):
        timed(one, 1, 4)
    nothing = point([StreamTimes(10.0, [0.0], [nan], [True])], warmup=0, samples=1)
    assert nothing["dropped"] == 1 and nothing["latency_p99_ms"] is None


# Fake contenders for the command: on recorded frames each takes RECORDED[name] s a frame, from a
# live source LIVE times as long, whose capacity lies halfway between two rates of the 2 % grid
# below its start: its highest rate is 4 steps below, 1.02 ** -4 / RECORDED[name].
RECORDED = {"sequential 1 thread": 0.01, "sequential all": 0.008, "fake D=2": 0.005}
LIVE = 1.02**3.5


def fake(name, kind, depth, threads, live=LIVE):
    @contextmanager
    def open_(setting):
        clock = FakeClock()

        def run(fps):
            cost = RECORDED[name] * (1 if fps is None else live)
            return plain_loop(setting.xs, costing(cost, clock), fps, clock)

        yield Live(run)

    return LiveContender(name, kind, depth, threads, open_, None if kind == "sequential" else "fake")


def fakes(depths, cores, executor):
    return [
        fake("sequential 1 thread", "sequential", 0, 1),
        fake("sequential all", "sequential", 0, cores),
        fake("fake D=2", "pipeline", 2, 1),
    ]


def test_rate_max_reports_each_contenders_highest_rate_and_latencies_below_it(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_rate, "contenders", fakes)
    path, plot = tmp_path / "rate.json", tmp_path / "rate.png"
    args = [
        "--size",
        "4",
        "--layers",
        "1",
        "--samples",
        "1000",
        "--rounds",
        "2",
        "--json",
        str(path),
        "--plot",
        str(plot),
    ]
    result = CliRunner().invoke(main, ["bench", "--rate", *args])  # --rate alone: max
    assert result.exit_code == 0, result.output
    assert "highest rate 2.00x that of sequential with one thread (1.60x with every core)" in result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(path.read_text())
    assert [(r["contender"], r["fraction"]) for r in rows] == [(name, f) for name in RECORDED for f in FRACTIONS]
    for row in rows:
        recorded, live = RECORDED[row["contender"]], RECORDED[row["contender"]] * LIVE
        assert row["mode"] == "inference" and row["samples"] == 1000 and row["rounds"] == 2 and row["size"] == 4
        assert row["ms_per_sample"] == pytest.approx(recorded * 1e3)
        assert row["sustained_fps"] == pytest.approx(1.02**-4 / recorded)
        assert row["sustained_fps_per_round"] == pytest.approx([1.02**-4 / recorded] * 2)
        assert row["dropped_at_fps_per_round"] == pytest.approx([1.02**-3 / recorded] * 2)
        assert all(drops == 0 for fps, drops in row["probes"][0] if fps <= row["sustained_fps"] * 1.0001)
        assert row["offered_fps"] == pytest.approx(row["fraction"] * row["sustained_fps"])
        assert row["offered"] == 2000 and row["dropped"] == 0 and row["kept_fps"] == pytest.approx(row["offered_fps"])
        # below its capacity a frame never waits: its latency is the loop's work on it
        assert row["latency_p50_ms"] == pytest.approx(live * 1e3) == pytest.approx(row["latency_p99_ms"])
        assert row["p99_over_seq_ms"] == pytest.approx(live / RECORDED["sequential 1 thread"])
    pipe = rows[-1]
    assert pipe["sustained_vs_seq_1thread"] == pytest.approx(2.0) and pipe[
        "sustained_vs_seq_allcores"
    ] == pytest.approx(1.6)


@pytest.mark.parametrize(("learn", "optimizer"), [(False, None), (True, None), (True, "adam")])
def test_rate_fps_runs_the_plain_model_and_the_pipeline_at_that_rate(tmp_path, learn, optimizer):
    path = tmp_path / "rate.json"
    args = ["bench", "--rate", "150", "--size", "8", "--layers", "2", "--samples", "10", "--rounds", "1"]
    args += ["--learn"] if learn else []
    args += [] if optimizer is None else ["--optimizer", optimizer]
    result = CliRunner().invoke(main, [*args, "--json", str(path)])
    assert result.exit_code == 0, result.output
    rows = json.loads(path.read_text())
    assert [r["kind"] for r in rows][-1] == "pipeline" and rows[0]["contender"] == "sequential 1 thread"
    pipe = rows[-1]
    assert pipe["contender"] == "process D=2" and pipe["executor"] == "process" and len(pipe["balance"]) == 2
    for row in rows:
        assert row["mode"] == ("learning" if learn else "inference")
        assert row["optimizer"] == ((optimizer or "sgd") if learn else None)
        assert row["fraction"] is None and row["sustained_fps"] is None and row["probes"] is None
        assert row["offered_fps"] == 150.0 and row["offered"] == 10 and 0 <= row["dropped"] <= 10
        assert row["kept_fps"] == pytest.approx(150.0 * (10 - row["dropped"]) / 10)
        assert row["ms_per_sample"] > 0 and len(row["ms_per_round"]) == 1
        if row["dropped"] < 10:
            assert 0 < row["latency_p50_ms"] <= row["latency_p99_ms"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "fast"], "frames per second (a number above 0, e.g. 120) or max; got 'fast'"),
        (["--rate", "0"], "got '0'"),
        (["--rate", "inf"], "got 'inf'"),
        (["--rate", "nan"], "got 'nan'"),
        (["--rate", "30", "--sizes", "8"], "--rate benches the bench's own model at one frame size"),
        (["--rate", "30", "--executor", "distributed"], "--rate runs the process and thread executors"),
        (["--rate", "30", "--plot", "x.png"], "draws latency against the rate: give --rate max"),
        (["--rate", "30", "--depths", "5", "--layers", "2"], "depths go up to 3, got 5"),
        (["--learn"], "goes with --rate or --sizes only"),
        (["--infer"], "goes with --sizes only, without --learn"),
        (["--rate", "30", "--infer"], "goes with --sizes only, without --learn"),
        (["--sizes", "8", "--infer", "--learn"], "goes with --sizes only, without --learn"),
        (["--rate", "30", "--optimizer", "adam"], "with --rate, goes with --learn (inference has no optimizer)"),
        (["--rate", "30", "--learn", "--optimizer", "sgd,adam"], "this bench learns with one optimizer"),
        (["--optimizer", "rmsprop"], "one or more distinct names of sgd, adam, comma-separated"),
        (["--sizes", "8", "--optimizer", "adam,adam"], "one or more distinct names of sgd, adam"),
        (["--rounds", "2"], "goes with --sizes only, or with --rate"),
        (["--plot", "x.png"], "goes with --sizes only, or with --rate max"),
        (["--grad-mode", "partime"], "goes with --sizes only, when it learns (not with --infer)"),
        (["--sizes", "8", "--infer", "--grad-mode", "partime"], "goes with --sizes only, when it learns"),
        (["--sizes", "8", "--grad-mode", "fast"], "'fast' is not one of 'partime', 'stash'"),
    ],
)
def test_bench_rate_refuses_what_it_cannot_run(args, message):
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


def test_a_contender_that_keeps_up_with_no_rate_is_reported_so(tmp_path, monkeypatch):
    def stalling(depths, cores, executor):  # from a live source the pipeline is 100 times slower
        return [*fakes(depths, cores, executor)[:2], fake("fake D=2", "pipeline", 2, 1, live=100.0)]

    monkeypatch.setattr(bench_rate, "contenders", stalling)
    path, plot = tmp_path / "rate.json", tmp_path / "rate.png"
    args = ["--rate", "max", "--size", "4", "--layers", "1", "--samples", "200", "--rounds", "1"]
    result = CliRunner().invoke(main, ["bench", *args, "--json", str(path), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert "0: it dropped frames at every rate it was tried at" in result.output
    rows = json.loads(path.read_text())
    seq, pipe = rows[0], rows[-1]
    assert seq["sustained_fps"] == pytest.approx(1.02**-4 / RECORDED["sequential 1 thread"])
    assert pipe["sustained_fps"] == 0.0 and pipe["sustained_vs_seq_1thread"] == 0.0
    assert pipe["dropped_at_fps_per_round"] == pytest.approx([1.02**-105 / RECORDED["fake D=2"]])
    assert pipe["offered"] == 0 and pipe["offered_fps"] is None and pipe["latency_p99_ms"] is None
    assert plot.read_bytes()[:4] == b"\x89PNG"

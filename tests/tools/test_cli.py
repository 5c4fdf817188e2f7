"""The ``partime`` command and the demo, on tiny settings (what they report, not how fast)."""

import itertools
import json
import math

import pytest
import torch
from click.testing import CliRunner

from partime_tools.bench.models import conv_net
from partime_tools.bench.runner import median_ms, run_bench
from partime_tools.cli import main
from partime_tools.demo.learning import DEPTH, LEARNERS, LR, MARKS, digits_convnet
from partime_tools.demo.recorded import blob_video, run_demo
from partime_tools.report import bench_table


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_writes_rows_for_every_mode_and_depth(tmp_path):
    path = tmp_path / "bench.json"
    args = ["bench", "--samples", "20", "--depths", "1,2", "--size", "16", "--layers", "2", "--json", str(path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "hop cost" in result.output
    rows = json.loads(path.read_text())
    keys = {
        "mode",
        "depth",
        "executor",
        "samples",
        "ms_per_sample",
        "speedup_vs_seq_1thread",
        "speedup_vs_seq_allcores",
        "hop_64kb_us",
        "hop_activation_us",
    }
    for row in rows:
        assert keys <= row.keys(), keys - row.keys()
        assert row["samples"] == 20
        for key in (
            "ms_per_sample",
            "speedup_vs_seq_1thread",
            "speedup_vs_seq_allcores",
            "hop_64kb_us",
            "hop_activation_us",
        ):
            assert positive(row[key]), (key, row)
    pipelined = [(r["mode"], r["depth"]) for r in rows if r["depth"] > 0]
    assert pipelined == [("inference", 1), ("inference", 2), ("learning", 1), ("learning", 2)]
    for row in rows:
        if row["depth"] > 0:
            assert row["executor"] == "process"
            assert len(row["balance"]) == row["depth"] and sum(row["balance"]) == 3 + (row["mode"] == "learning")
            assert positive(row["max_stage_ms"]) and row["partition"].startswith(f"{row['depth']} stage")
        else:
            assert row["executor"].startswith("sequential")
    assert [r["threads"] for r in rows if r["depth"] == 0][:1] == [1]
    assert {r["activation_bytes"] for r in rows} == {32 * 16 * 16 * 4}


def test_bench_rejects_a_depth_beyond_the_layers():
    result = CliRunner().invoke(main, ["bench", "--depths", "1,9", "--layers", "2"])
    assert result.exit_code != 0
    assert "depths go up to 3" in result.output


def test_bench_refuses_options_that_do_not_go_together():
    refusals = {
        ("--size", "16", "--sizes", "8"): "give --size (one frame size) or --sizes (a sweep), not both",
        ("--plot", "x.png"): "goes with --sizes only",
        ("--rounds", "2"): "goes with --sizes only",
        ("--sizes", "8", "--executor", "distributed"): "the distributed one benches without --sizes",
        ("--sizes", "8", "--executor", "inline"): "the sweep's pipelines run on process, thread, not inline",
        ("--sizes", "8,0"): "give one or more frame sizes of at least 1",
        ("--sizes", "--depths", "11"): "depths go up to 9",
        ("--sizes", "8", "--compile"): "goes with the plain bench only",
    }
    for args, message in refusals.items():
        result = CliRunner().invoke(main, ["bench", *args])
        assert result.exit_code != 0 and message in " ".join(result.output.split()), (args, result.output)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo on tiny settings, run once for the tests below: its figures and its picture's path."""
    png = tmp_path_factory.mktemp("demo") / "live.png"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the other tests run (tests/conftest.py), which this module-wide fixture precedes
    try:
        return run_demo(samples=30, learn_samples=300, heldout=50, live_frames=40, live_png=png, layers=2), png
    finally:
        torch.set_num_threads(before)


def test_demo_runs_fast_and_reports_its_figures(demo):
    figures, png = demo
    assert figures["outputs_match"] is True
    for key in ("inference_speedup", "wall_s", "inference_ms_pipeline"):
        assert positive(figures[key]), key
    # the live source: played faster than the plain model sustains, which keeps at most every frame
    assert math.isclose(figures["live_fps"], 1.4e3 / figures["live_sustained_ms"])
    for who in ("plain", "pipeline"):
        kept, dropped = figures[f"live_{who}_fps_kept"] * 40 / figures["live_fps"], figures[f"live_{who}_dropped"]
        assert round(kept) + dropped == 40 and kept >= 1, who
        assert 0 < figures[f"live_{who}_p50_ms"] <= figures[f"live_{who}_p99_ms"], who
    assert figures["live_png"] == str(png) and png.read_bytes().startswith(b"\x89PNG")


def test_demo_learns_the_digits_with_every_learner_and_reports_accuracy_against_seconds(demo):
    figures, _ = demo
    assert figures["learn_samples"] == 300 and figures["learning_lr"] == LR
    assert figures["learning_partition"].startswith(f"{DEPTH} stages")
    assert figures["learning_threads"] == 1  # run on one thread (the fixture): "every core" is one here
    assert figures["learning_others_busy"] is None or figures["learning_others_busy"] >= 0
    moments = figures["learning_seconds"]
    assert MARKS <= len(moments) <= MARKS + 2 and moments[0] > 0
    assert all(a < b for a, b in itertools.pairwise(moments)), moments
    ends = sorted(figures[f"learning_{key}_seconds"] for key in LEARNERS)
    assert moments[MARKS - 1] == ends[0] and moments[-1] == ends[-1]  # the fastest one's end, the slowest one's
    for key in LEARNERS:
        done, rolling = figures[f"learning_{key}_samples_at"], figures[f"learning_{key}_accuracy_at"]
        assert len(done) == len(rolling) == len(moments), key
        # each learner learnt every sample by the last moment (the slowest one's end), never fewer later
        assert all(a <= b for a, b in itertools.pairwise(done)) and done[-1] == 300, (key, done)
        for count, accuracy in zip(done, rolling):
            assert math.isnan(accuracy) if count == 0 else 0 <= accuracy <= 1, (key, count, accuracy)
        assert 0 < figures[f"learning_{key}_seconds"] <= moments[-1], key
        assert math.isclose(figures[f"learning_{key}_samples_per_s"], 300 / figures[f"learning_{key}_seconds"])
        assert rolling[-1] == figures[f"learning_{key}_rolling_accuracy"], key
        assert 0 <= figures[f"learning_{key}_stream_accuracy"] <= 1, key
        # learnt digits, not just the last labels: held-out digits well above chance (0.1), and above
        # the untrained model
        assert figures[f"learning_{key}_heldout"] >= 0.2, (key, figures[f"learning_{key}_heldout"])
        assert figures[f"learning_{key}_heldout"] > figures["learning_heldout_before"] + 0.1, key
    for key in ("learning_speedup", "learning_speedup_allcores"):
        assert positive(figures[key]), key


def test_digits_convnet_is_seeded_and_gives_ten_logits_a_digit():
    a, b, c = digits_convnet(seed=1), digits_convnet(seed=1), digits_convnet(seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a[0][0].weight, c[0][0].weight)
    assert len(a) == 6 and a(torch.rand(4, 1, 24, 24)).shape == (4, 10)


def test_conv_net_is_seeded_and_has_the_head_only_for_learning():
    assert len(conv_net(3)) == 4 and len(conv_net(3, classes=10)) == 5
    a, b = conv_net(3, seed=1), conv_net(3, seed=1)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert conv_net(3, classes=10)(torch.randn(1, 3, 8, 8)).shape == (1, 10)


def test_blob_video_moves_smoothly_through_every_quadrant():
    frames, quadrants = blob_video(400)
    assert frames.shape == (400, 1, 3, 32, 32) and quadrants.shape == (400, 1)
    assert set(quadrants.flatten().tolist()) == {0, 1, 2, 3}
    # consecutive frames are alike (the stream is smooth): the label rarely changes
    assert (quadrants[1:] != quadrants[:-1]).sum() < 20


def test_median_ms_is_the_median_block():
    stamps = [0.0, 1.0, 2.0, 3.0, 5.0, 6.0, 16.0]  # warm-up 1, then blocks of 1, 1, 2, 1, 10 s
    assert median_ms(stamps, 1, 5) == 1000.0


def test_bench_compile_adds_the_compiled_model_and_compiled_pipelines():
    rows = run_bench(
        executor="inline", samples=5, warmup=3, depths=(1,), size=8, layers=1, modes=("inference",), compile=True
    )
    runs = [(r["executor"], r["depth"], r["compiled"]) for r in rows]
    plain = [run for run in runs if not run[2]]
    assert [run for run in runs if run[2]] == [
        (name.replace("sequential", "sequential compiled"), depth, True) for name, depth, _ in plain
    ]
    assert plain[0] == ("sequential (1 thr)", 0, False) and plain[-1] == ("inline", 1, False)
    assert all(positive(r["ms_per_sample"]) and positive(r["speedup_vs_seq_1thread"]) for r in rows)
    assert "D=1 inline compile=True" in "".join(
        str(cell) for column in bench_table(rows).columns for cell in column.cells
    )

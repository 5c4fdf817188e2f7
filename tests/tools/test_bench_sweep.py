"""``partime bench --sizes``: latencies on a fake clock, the replicas peer, the order of the rounds, the
bound's pieces of a cut, and tiny sweeps through the CLI (what they report, not how fast)."""

import itertools
import json
import math
import os
import time

import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner
from torch import nn

from partime.planning.partition import Partition
from partime.traced.tracing import layers_of
from partime_tools.bench import contenders as bench_contenders
from partime_tools.bench import latency as bench_latency
from partime_tools.bench.bound import piece_alone, pieces, run_pieces
from partime_tools.bench.contenders import Setting
from partime_tools.bench.latency import Offered, latencies, percentile
from partime_tools.bench.models import conv3_net, resnet
from partime_tools.bench.peers import ReplicaError, Replicas
from partime_tools.bench.runner import CLASSES, OPTIMIZERS, frames
from partime_tools.bench.sweep import groups, round_order, sweep_steps
from partime_tools.cli import main


def finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_latencies_on_a_fake_clock_are_the_nearest_rank_percentiles(monkeypatch):
    clock = itertools.count()  # whole seconds: every latency is exact in milliseconds
    monkeypatch.setattr(bench_latency.time, "perf_counter", lambda: float(next(clock)))
    offered = Offered(range(4))
    handed_at, held = [], []
    # the stream pulls 0 (t=0), 1 (t=1), hands out 0 (t=2), pulls 2 (t=3), 3 (t=4), hands out 1, 2, 3 (t=5, 6, 7)
    held += [next(offered), next(offered)]
    handed_at.append(float(next(clock)))
    held += [next(offered), next(offered)]
    handed_at += [float(next(clock)) for _ in range(3)]
    assert held == [0, 1, 2, 3] and offered.offered_at == [0.0, 1.0, 3.0, 4.0]
    # latencies 2, 4, 3, 3 s: p50 is the 2nd smallest of 4, p99 the largest
    assert latencies(offered.offered_at, handed_at) == {"p50_ms": 3000.0, "p99_ms": 4000.0}


def test_percentiles_of_a_hundred_latencies():
    waits = [float(w) for w in range(100, 0, -1)]  # 100 ... 1 s, offered all at 0
    assert latencies([0.0] * 100, waits) == {"p50_ms": 50_000.0, "p99_ms": 99_000.0}
    assert percentile([5.0], 99) == 5.0 and percentile([1.0, 2.0, 3.0], 50) == 2.0


def test_latencies_refuse_what_cannot_be_latencies():
    with pytest.raises(ValueError, match="2 offered, 1 handed"):
        latencies([0.0, 1.0], [2.0])
    with pytest.raises(ValueError, match="before their samples were offered: samples \\[1\\]"):
        latencies([0.0, 5.0], [1.0, 4.0])


def test_replicas_hand_out_the_models_own_outputs_in_order():
    model = conv3_net(2, 8)
    xs = torch.randn(7, 1, 3, 8, 8, generator=torch.Generator().manual_seed(1))  # not a multiple of the copies
    with torch.no_grad():
        expected = [model(x) for x in xs]
    with Replicas(model, 2, xs[0]) as replicas:
        for _ in range(2):  # a second stream starts where the first left the replicas: empty
            outputs = list(replicas.stream(iter(xs)))
            assert len(outputs) == len(xs)
            for got, want in zip(outputs, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        for i, _ in enumerate(replicas.stream(iter(xs))):
            if i == 1:
                break  # the results in flight are dropped: the next stream is still in order
        torch.testing.assert_close(next(replicas.stream(iter(xs[3:]))), expected[3], rtol=0, atol=0)
    assert mp.active_children() == []  # every worker stopped and joined


def test_a_failing_replica_raises_with_its_sample_and_traceback():
    class FailsOnLargeFrames(nn.Module):
        def forward(self, x):
            if x.abs().max() > 100:
                raise ValueError("this frame is too bright")
            return x * 2

    xs = torch.ones(6, 1, 4)
    xs[3] *= 1000
    with pytest.raises(ReplicaError, match="(?s)replica 1, sample 3 failed.*this frame is too bright"):
        with Replicas(FailsOnLargeFrames(), 2, xs[0]) as replicas:
            list(replicas.stream(iter(xs)))
    assert mp.active_children() == []


def test_a_replica_that_does_not_answer_in_time_is_an_error():
    class SlowOnLargeFrames(nn.Module):
        def forward(self, x):
            if x.abs().max() > 100:
                time.sleep(1.5)
            return x * 2

    xs = torch.ones(3, 1, 4)
    xs[1] *= 1000
    with pytest.raises(ReplicaError, match="replica 0 gave no result for sample 1 within 0.3 s"):
        with Replicas(SlowOnLargeFrames(), 1, xs[0], timeout=0.3) as replicas:
            list(replicas.stream(iter(xs)))
    assert mp.active_children() == []


def test_each_round_starts_one_contender_later():
    assert list(round_order(["a", "b", "c"], 4)) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_learning_runs_once_per_optimizer_and_inference_once():
    assert groups(("inference", "learning"), ("sgd", "adam")) == [
        ("inference", None),
        ("learning", "sgd"),
        ("learning", "adam"),
    ]
    assert groups(("learning",), ("adam",)) == [("learning", "adam")]
    # the hop of 64 KB, then per size its activation's hop, and per group its start and each round
    assert sweep_steps((8, 12), ("inference", "learning"), 3, ("sgd", "adam")) == 1 + 2 * (1 + 3 * (1 + 3))


def test_the_bounds_pieces_are_the_models_own_and_compose_to_it():
    x = torch.randn(1, 3, 12, 12, generator=torch.Generator().manual_seed(2))
    model = conv3_net(4, 8, classes=CLASSES)  # an nn.Sequential of 6 layers: model[a:b] per stage
    for balance in ((3, 3), (1, 5), (2, 2, 2), (6,)):
        partition = Partition(balance)
        chain = pieces(model, partition)
        assert [list(piece) for piece in chain] == [list(model[a:b]) for a, b in partition.bounds]  # not copies
        assert torch.equal(run_pieces(chain, x), model(x)), balance
    traced = resnet(2, 8)  # traced: each stage's fused graph module, cut between the graph's nodes
    n = len(layers_of(traced))
    crossed = []
    with torch.no_grad():
        for cut in range(1, n):
            chain = pieces(traced, Partition((cut, n - cut)))
            crossed.append(chain[0](x))
            assert torch.equal(run_pieces(chain, x), traced(x)), cut
        chain = pieces(traced, Partition((n // 3, n // 3, n - 2 * (n // 3))))
        assert torch.equal(run_pieces(chain, x), traced(x))
    assert any(isinstance(value, tuple) for value in crossed)  # a cut inside a block carries its shortcut too


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_each_piece_alone_learns_on_its_own_copy_of_the_model(optimizer):
    model = resnet(2, 8, classes=CLASSES)  # BatchNorm in train mode, values that cross the cuts as tuples
    before = {k: v.clone() for k, v in model.state_dict().items()}
    xs, ys = frames(8, 12, seed=3)
    setting = Setting(model, xs, ys, 10, OPTIMIZERS[optimizer])
    n = len(setting.layers)
    for balance in ((n // 2, n - n // 2), (5, n - 5)):
        partition = Partition(balance)
        for stage in range(partition.depth):
            contender = piece_alone(f"piece {stage}", partition, stage)
            assert contender.kind == "bound" and contender.threads == 1
            with contender.open(setting) as opened:
                for _ in range(2):
                    timing = opened.run()
                    assert len(timing.handed_at) == 10 and timing.handed_at == sorted(timing.handed_at)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # the model the other contenders copy is untouched


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One tiny sweep through the CLI, with its JSON and its plot."""
    out = tmp_path_factory.mktemp("sweep")
    args = ["bench", "--sizes", "8,12", "--samples", "5", "--rounds", "1", "--json", str(out / "sweep.json")]
    result = CliRunner().invoke(main, [*args, "--plot", str(out / "sweep.png")])
    assert result.exit_code == 0, result.output
    return result.output, json.loads((out / "sweep.json").read_text()), out / "sweep.png"


def test_the_sweep_reports_every_contender_at_every_size(sweep):
    output, rows, _ = sweep
    assert "partime bench, inference" in output and "partime bench, learning" in output
    assert "÷ floor" in output and "python floor: the simplest Python pipeline of the same cut" in output
    cores = os.cpu_count() or 1
    sequential = {"sequential 1 thread"} | ({f"sequential {cores} threads"} if cores > 1 else set())
    for size in (8, 12):
        for mode in ("inference", "learning"):
            found = {r["contender"]: r for r in rows if r["size"] == size and r["mode"] == mode}
            expected = sequential | {"process D=2", "thread D=2", "process auto", "bound D=2", "own tick D=2"}
            expected.add("python floor D=2")
            if mode == "inference":
                expected.add("replicas D=2")  # replicas do not learn
            assert expected <= found.keys() and len(bounds := [r for r in found.values() if r["kind"] == "bound"]) >= 1
            ticks = [r for r in found.values() if r["kind"] == "own tick"]
            assert [r["balance"] for r in ticks] == [r["balance"] for r in bounds]  # both figures of every cut
            floors = [r for r in found.values() if r["kind"] == "python floor"]
            assert [r["balance"] for r in floors] == [r["balance"] for r in bounds if len(r["balance"]) > 1]
            assert found.keys() - expected <= {r["contender"] for r in bounds + ticks + floors}, found.keys()
            for row in found.values():
                for key in (
                    "ms_per_sample",
                    "latency_p50_ms",
                    "latency_p99_ms",
                    "speedup_vs_seq_1thread",
                    "speedup_vs_seq_allcores",
                    "bound_stage_ms",
                    "hop_64kb_us",
                    "hop_activation_us",
                ):
                    assert finite_positive(row[key]), (key, row)
                assert row["latency_p50_ms"] <= row["latency_p99_ms"]
                assert row["samples"] == 5 and row["rounds"] == 1 and len(row["ms_per_round"]) == 1
                assert row["optimizer"] == ("sgd" if mode == "learning" else None)
            assert found["sequential 1 thread"]["speedup_vs_seq_1thread"] == 1.0
            for name in ("process D=2", "thread D=2", "process auto"):
                pipe = found[name]
                if name != "process auto":
                    assert len(pipe["balance"]) == 2 and sum(pipe["balance"]) == 9 + (mode == "learning")
                for kind, key in (("bound", "bound"), ("own tick", "own_tick")):
                    bound = found[pipe[key]]
                    assert bound["kind"] == kind and bound["balance"] == pipe["balance"] and name in bound["pipelines"]
                    assert len(bound["stage_alone_ms"]) == len(pipe["balance"]) == bound["depth"]
                    assert pipe[f"{key}_ms"] == bound["ms_per_sample"] == max(bound["stage_alone_ms"])
                    assert pipe[f"ms_over_{key}"] == pipe["ms_per_sample"] / pipe[f"{key}_ms"]
                if len(pipe["balance"]) > 1:  # a cut of two stages or more has its floor
                    floor = found[pipe["floor"]]
                    assert floor["kind"] == "python floor" and floor["balance"] == pipe["balance"]
                    assert name in floor["pipelines"] and pipe["floor_ms"] == floor["ms_per_sample"]
                    assert pipe["ms_over_floor"] == pipe["ms_per_sample"] / pipe["floor_ms"]
                else:  # "process auto" falling back to the model alone: no pipeline, no floor
                    assert pipe["floor"] is None and pipe["ms_over_floor"] is None
            assert found["sequential 1 thread"]["bound_stage_ms"] == bounds[0]["ms_per_sample"]
            assert {r["floor_left_out"] for r in found.values()} == {None}
            assert {r["activation_bytes"] for r in found.values()} == {24 * size * size * 4}


def test_the_sweep_draws_its_plot(sweep):
    _, _, png = sweep
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_learns_with_each_optimizer_in_turn(tmp_path):
    path = tmp_path / "sweep.json"
    args = ["bench", "--sizes", "8", "--samples", "5", "--rounds", "1", "--learn", "--optimizer", "sgd,adam"]
    result = CliRunner().invoke(main, [*args, "--executor", "thread", "--json", str(path)])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "partime bench, learning with SGD" in output and "partime bench, learning with Adam" in output
    assert "partime bench, inference" not in output  # --learn: learning only
    rows = json.loads(path.read_text())
    assert {r["mode"] for r in rows} == {"learning"} and [r["optimizer"] for r in rows[:1]] == ["sgd"]
    for optimizer in ("sgd", "adam"):
        found = {r["contender"]: r for r in rows if r["optimizer"] == optimizer}
        assert {"sequential 1 thread", "thread D=2", "bound D=2", "own tick D=2"} <= found.keys()
        pipe, seq = found["thread D=2"], found["sequential 1 thread"]
        assert pipe["speedup_vs_seq_1thread"] == seq["ms_per_sample"] / pipe["ms_per_sample"]
        for key in ("speedup_vs_seq_allcores", "bound_ms", "ms_over_bound", "own_tick_ms", "ms_over_own_tick"):
            assert finite_positive(pipe[key]), key
        assert pipe["bound_stage_ms"] == found["bound D=2"]["ms_per_sample"] == pipe["bound_ms"]


def test_a_sweep_learns_in_the_grad_mode_it_is_given(tmp_path, monkeypatch):
    made = []  # (what, its grad mode): every pipeline and every stage of partime's own tick made
    real_pipeline, real_stage = bench_contenders.Pipeline, bench_contenders.Stage

    def pipeline(*args, **kwargs):
        made.append(("pipeline", kwargs.get("grad_mode")))
        return real_pipeline(*args, **kwargs)

    def stage(index, module, config, *args):
        made.append(("own tick", config.grad_mode))
        return real_stage(index, module, config, *args)

    monkeypatch.setattr(bench_contenders, "Pipeline", pipeline)
    monkeypatch.setattr(bench_contenders, "Stage", stage)
    path = tmp_path / "sweep.json"
    args = ["bench", "--sizes", "8", "--samples", "5", "--rounds", "1", "--learn", "--grad-mode", "partime"]
    result = CliRunner().invoke(main, [*args, "--executor", "thread", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "partime bench, learning with SGD, grad_mode='partime'" in " ".join(result.output.split())
    assert {r["grad_mode"] for r in json.loads(path.read_text())} == {"partime"}
    assert sorted(set(made)) == [("own tick", "partime"), ("pipeline", "partime")]


def test_a_sweep_with_infer_times_inference_only(tmp_path):
    path = tmp_path / "sweep.json"
    args = ["bench", "--sizes", "8", "--samples", "5", "--rounds", "1", "--infer", "--executor", "thread"]
    result = CliRunner().invoke(main, [*args, "--json", str(path)])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "partime bench, inference" in output and "partime bench, learning" not in output
    rows = json.loads(path.read_text())
    assert {r["mode"] for r in rows} == {"inference"} and {r["grad_mode"] for r in rows} == {None}
    assert {"sequential 1 thread", "thread D=2", "bound D=2", "own tick D=2"} <= {r["contender"] for r in rows}

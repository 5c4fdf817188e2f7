"""Per-stage statistics (``Pipeline(stats=True)``, ``pipe.stats()``): at D = 1 the lrs and gradient
norms of a plain loop, to the bit; alike under every executor at D = 2; timings that add up; read
whole while they are written; and reading them changes nothing the pipeline computes."""

import math
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from models import mlp
from torch import nn
from torch.optim import lr_scheduler as schedules

import partime
from partime import StageStats
from partime.core.stats_record import StatsRecord

ROOT = Path(__file__).resolve().parents[2]
MSE = nn.MSELoss()
BALANCES = {1: [7], 2: [3, 4]}
N = 12


def two_groups(named):
    """SGD with the weights (2-d) at one lr and the biases at another: a stage has two lrs."""
    named = list(named)
    return torch.optim.SGD(
        [
            {"params": [p for _, p in named if p.dim() > 1], "lr": 0.05},
            {"params": [p for _, p in named if p.dim() <= 1], "lr": 0.02},
        ],
        momentum=0.9,
    )


def step_lr(opt):
    return schedules.StepLR(opt, step_size=3, gamma=0.5)


def stream(n=N, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, generator=gen), torch.randn(n, 2, 3, generator=gen)


XS, YS = stream()


def pipeline(depth=2, executor="inline", **kw):
    kw = dict(loss_fn=MSE, optimizer=two_groups, lr_scheduler=step_lr, stats=True) | kw
    return partime.Pipeline(mlp(), BALANCES[depth], executor=executor, threads=1, **kw)


def scheduled_lrs(steps):
    """The lrs of ``two_groups`` under ``step_lr`` after ``steps`` steps, as a plain loop has them."""
    opt = two_groups([("w", nn.Parameter(torch.zeros(2, 2))), ("b", nn.Parameter(torch.zeros(2)))])
    scheduler = step_lr(opt)
    for _ in range(steps):
        opt.step()
        scheduler.step()
    return tuple(group["lr"] for group in opt.param_groups)


@pytest.mark.parametrize("max_grad_norm", [None, 0.05], ids=["unclipped", "clipped"])
def test_at_depth_one_each_step_s_lrs_and_gradient_norm_are_the_plain_loop_s(max_grad_norm):
    model = mlp()
    opt = two_groups(model.named_parameters())
    scheduler = step_lr(opt)
    with pipeline(1, max_grad_norm=max_grad_norm) as pipe:
        for k, (x, y) in enumerate(zip(XS, YS)):
            loss = MSE(model(x), y)
            opt.zero_grad()
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            by_hand = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
            # what clip_grad_norm_ returns; an infinite bound clips nothing
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
            opt.step()
            scheduler.step()
            result = pipe.step(x, y)
            (stats,) = pipe.stats()
            assert result.loss == loss.item()
            assert stats.steps == k + 1 and stats.ticks == k + 1
            assert stats.grad_norm == float(norm)
            assert stats.grad_norm == pytest.approx(float(by_hand), rel=1e-6)
            assert stats.lrs == tuple(group["lr"] for group in opt.param_groups) == scheduled_lrs(k + 1)
            assert stats.lr == stats.lrs[0]
        assert all(torch.equal(a, b) for a, b in zip(pipe.module.parameters(), model.parameters(), strict=True))


def learnt_stats(executor, **kw):
    with pipeline(2, executor, **kw) as pipe:
        results = list(pipe.stream(XS, YS))
        return pipe.stats(), results


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_at_depth_two_every_executor_reports_inline_s_steps_lrs_and_norms(executor):
    expected, _ = learnt_stats("inline")
    got, _ = learnt_stats(executor)
    assert [(s.stage, s.ticks, s.steps, s.lrs, s.grad_norm) for s in got] == [
        (s.stage, s.ticks, s.steps, s.lrs, s.grad_norm) for s in expected
    ]
    # every stage stepped once per sample, and its schedule with it
    assert [s.steps for s in got] == [N, N]
    assert [s.lrs for s in got] == [scheduled_lrs(N)] * 2
    assert all(s.grad_norm is not None and s.grad_norm > 0 for s in got)


class Sleep(nn.Module):
    """Identity that takes ``seconds`` first: a stage whose tick lasts at least that."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


SLEEP_S = 0.005


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_the_slow_stage_works_and_the_fast_one_waits(executor):
    """Stage 0 sleeps 5 ms per sample; stage 1 does next to nothing: stage 0's ticks take at least
    the sleeps, stage 1 spends its time waiting for them; no stage's time exceeds the run's."""
    model = nn.Sequential(nn.Linear(6, 6), Sleep(SLEEP_S), nn.Linear(6, 3))
    n = 20
    with partime.Pipeline(model, [2, 1], executor=executor, threads=1, stats=True) as pipe:
        started = time.perf_counter()
        results = list(pipe.stream(XS[0].expand(n, 2, 6)))
        wall = time.perf_counter() - started
        slow, fast = pipe.stats()
    assert len(results) == n
    assert slow.ticks >= n and fast.ticks >= n
    assert slow.total_tick_seconds >= n * SLEEP_S
    assert slow.mean_tick_seconds > fast.mean_tick_seconds
    assert fast.total_wait_seconds > fast.total_tick_seconds
    assert fast.total_wait_seconds >= (n - 2) * SLEEP_S / 2
    for s in (slow, fast):
        assert 0 < s.tick_seconds <= s.total_tick_seconds and 0 <= s.wait_seconds <= s.total_wait_seconds
        assert s.total_tick_seconds + s.total_wait_seconds <= wall


def test_a_pipeline_that_infers_reports_its_ticks_and_times_and_no_learning():
    with partime.Pipeline(mlp(), [3, 4], executor="process", threads=1, stats=True) as pipe:
        assert pipe.stats() == []  # no stage has started
        list(pipe.stream(XS))
        stats = pipe.stats()
    assert [s.stage for s in stats] == [0, 1]
    for s in stats:
        assert isinstance(s, StageStats)
        assert (s.steps, s.lrs, s.lr, s.grad_norm) == (0, (), None, None)
        assert s.ticks >= N and s.total_tick_seconds > 0
    assert pipe.stats() == stats  # after close: the last values


def test_a_pipeline_made_without_stats_says_how_to_have_them():
    with pipeline(2, stats=False) as pipe:
        list(pipe.stream(XS, YS))
        with pytest.raises(RuntimeError, match=r"stats=True"):
            pipe.stats()


def test_stats_must_be_a_bool():
    with pytest.raises(TypeError, match=r"stats must be True or False, got 'yes'"):
        pipeline(2, stats="yes")


def run(executor, stats, read):
    """Outputs, losses and weights of a D = 2 pipeline, reading its stats after every result if ``read``."""
    outputs, losses, seen = [], [], []
    with pipeline(2, executor, stats=stats) as pipe:
        for r in pipe.stream(XS, YS):
            outputs.append(r.output)
            losses.append(r.loss)
            if read:
                seen.append(pipe.stats())
        weights = [p.detach().clone() for p in pipe.module.parameters()]
    return outputs, losses, weights, seen


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_reading_the_stats_changes_nothing_the_pipeline_computes(executor):
    outputs, losses, weights, _ = run(executor, stats=False, read=False)
    outputs_read, losses_read, weights_read, seen = run(executor, stats=True, read=True)
    assert losses_read == losses
    assert all(torch.equal(a, b) for a, b in zip(outputs_read, outputs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights_read, weights, strict=True))
    steps = [[s.steps for s in stats] for stats in seen]
    assert steps == sorted(steps) and len(seen) == N  # counts only grow


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_stage_s_norm_reaches_the_record_without_a_wait_and_is_the_cpu_s():
    """Stage 1 on the GPU: its norm is copied into pinned memory as the device gets there; once the
    device has finished, the record holds what the same pipeline on the CPU reports."""
    cpu, _ = learnt_stats("inline")
    with pipeline(2, "inline", devices=["cpu", "cuda"]) as pipe:
        list(pipe.stream(XS, YS))
        torch.cuda.synchronize()  # the last copy has landed
        gpu = pipe.stats()
    assert [(s.steps, s.lrs) for s in gpu] == [(s.steps, s.lrs) for s in cpu]
    assert [s.grad_norm for s in gpu] == pytest.approx([s.grad_norm for s in cpu], rel=1e-4)


def test_a_read_is_never_torn_while_the_record_is_written():
    """A writer process overwrites the shared record tick after tick with the same value in two
    fields; a read in this process, at the same time, must never show them apart (the sequence
    count makes it copy again)."""
    record = StatsRecord(shared=True)
    stage = SimpleNamespace(index=0, steps=0, grad_norm=None, optimizer=None)
    ticks = 300_000

    def write():  # in a forked child: the record's memory is shared
        for k in range(1, ticks + 1):
            record.tick(stage, float(k), float(k))

    writer = multiprocessing.get_context("fork").Process(target=write)
    writer.start()
    reads = []
    while writer.is_alive() or not reads:
        reads.append(record.read(0))
    writer.join()
    assert writer.exitcode == 0
    moving = [s for s in reads if 0 < s.ticks < ticks]
    assert len(moving) > 10  # read while it was written
    torn = [s for s in reads if s.tick_seconds != s.wait_seconds or s.total_tick_seconds != s.total_wait_seconds]
    assert torn == []
    assert all(s.tick_seconds == s.ticks for s in reads)


def test_the_tensorboard_example_writes_each_stage_s_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    samples, every = 60, 10
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tensorboard_stats.py"), str(tmp_path), "--samples", str(samples)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for stage in (0, 1):
        for name in ("lr", "grad_norm", "tick_ms", "wait_ms"):
            assert f"stage{stage}/{name}" in tags
    lrs = events.Scalars("stage0/lr")
    assert [e.step for e in lrs] == list(range(every, samples + 1, every))
    assert all(0 < e.value <= 0.05 for e in lrs) and lrs[-1].value < lrs[0].value  # the schedule lowers it
    assert all(e.value > 0 for e in events.Scalars("stage1/grad_norm"))
    assert len(events.Scalars("loss")) == samples // every

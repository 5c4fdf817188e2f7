"""The caller runs the last stage itself (process and thread executors), and the processes that run
stages keep the memory they free for the next tick instead of taking page faults for it."""

import multiprocessing
import resource

import pytest
import torch
from faulty import TripLoss, TripOptimizer, Tripped, tagged_stream, tripping_model
from torch import nn

import partime
from partime.executors.driver import Driver
from partime.executors.malloc import keep_freed_memory


def stage_processes():
    return sorted(p.name for p in multiprocessing.active_children() if p.name.startswith("partime-stage"))


def test_the_process_executor_starts_a_process_for_every_stage_but_the_last():
    xs, _ = tagged_stream(6, 3)
    with partime.Pipeline(tripping_model(3), [2, 2, 2], threads=1) as pipe:
        list(pipe.stream(xs))
        assert stage_processes() == ["partime-stage-0", "partime-stage-1"]
    assert stage_processes() == []


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_while_it_hosts_the_last_stage_the_caller_has_its_torch_thread_count_and_then_its_own(executor):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        xs, _ = tagged_stream(4, 2)
        with partime.Pipeline(tripping_model(2), [2, 2], executor=executor, threads=2) as pipe:
            pipe.step(xs[0])
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("executor", ["process", "thread"])
@pytest.mark.parametrize("phase", ["forward", "loss"])
def test_a_failure_of_the_hosted_last_stage_is_a_stage_error_and_every_worker_stops(executor, phase):
    xs, ys = tagged_stream(20, 3)
    model = tripping_model(3, stage=2 if phase == "forward" else -1, sample=7)
    loss = TripLoss(sample=7 if phase == "loss" else -1)
    pipe = partime.Pipeline(model, [2, 2, 2], executor=executor, threads=1, loss_fn=loss, optimizer=TripOptimizer())
    with pytest.raises(partime.StageError) as info, pipe:
        list(pipe.stream(xs, ys))
    error = info.value
    assert (error.stage, error.sample, error.phase) == (2, 7, phase), str(error)
    assert isinstance(error.__cause__, Tripped) and "sample 7" in str(error.__cause__)
    assert stage_processes() == []


def minor_faults(pid=None):
    """Minor page faults of this process (or of process ``pid``) so far."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(not keep_freed_memory(), reason="the C library is not glibc: it has no such thresholds")
def test_large_activations_cost_no_page_faults_per_tick_in_the_caller_nor_in_a_stage_process():
    # 24 channels of 96 x 96 floats: 884 KB per activation, above glibc's first mmap threshold
    torch.manual_seed(0)
    convs = [nn.Conv2d(3, 24, 3, padding=1)] + [nn.Conv2d(24, 24, 3, padding=1) for _ in range(3)]
    model = nn.Sequential(*convs)
    xs = torch.randn(40, 1, 3, 96, 96)
    with partime.Pipeline(model, [2, 2], threads=1) as pipe:
        results = pipe.stream(iter(xs))
        for _ in range(10):  # warm-up: the blocks the ticks need are allocated once
            next(results)
        (worker,) = [p.pid for p in multiprocessing.active_children() if p.name == "partime-stage-0"]
        caller_before, worker_before = minor_faults(), minor_faults(worker)
        for _ in range(20):
            next(results)
        caller, stage0 = (minor_faults() - caller_before) / 20, (minor_faults(worker) - worker_before) / 20
        list(results)
    # every tick maps 4 such blocks afresh (216 pages each) when freed memory goes back to the kernel
    assert caller < 50 and stage0 < 50, (caller, stage0)


def test_a_timeout_while_the_hosted_stage_waits_names_the_stage_it_waits_for():
    xs, _ = tagged_stream(20, 2)
    pipe = partime.Pipeline(tripping_model(2, stage=0, sample=5, phase="hang"), [2, 2], threads=1, timeout=2.0)
    with pytest.raises(partime.StageTimeoutError) as info, pipe:
        list(pipe.stream(xs))
    error = info.value
    assert (error.stage, error.sample, error.phase) == (0, 5, "forward"), str(error)
    assert "stage 0's activation for tick 6" in str(error) and "stage 0 (pid" in str(error)
    assert stage_processes() == []


HOSTED_FORWARDS = []
"""The forwards of ``Counted``, a layer of the stage the caller hosts (so: in the caller's process)."""


class Counted(nn.Module):
    """A linear layer that notes its forwards in ``HOSTED_FORWARDS``."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(6, 6)

    def forward(self, x):
        HOSTED_FORWARDS.append(len(HOSTED_FORWARDS))
        return self.layer(x)


def counted_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), Counted())


def played(executor, decoupled, monkeypatch, path):
    """Inference through every way of feeding: a stream, a break out of one, steps, a checkpoint,
    a flush: each result's (index, output), in the order handed out."""
    monkeypatch.setattr(Driver, "decoupled", decoupled)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, 6, generator=gen) for _ in range(24)]
    got = []
    with partime.Pipeline(counted_model(), [2, 2, 1], executor=executor, threads=1) as pipe:
        got += list(pipe.stream(xs[:6]))
        for r in pipe.stream(xs[6:12]):
            got.append(r)
            if r.index == 8:
                break  # samples 9 to 11 are left inside
        got += [r for r in (pipe.step(x) for x in xs[12:16]) if r is not None]
        if executor != "thread":  # the thread executor takes no checkpoints
            pipe.save(path)  # with the result of sample 13 out, not handed out, and 14 and 15 inside
        got += list(pipe.stream(xs[16:20]))
        got += [r for r in (pipe.step(x) for x in xs[20:]) if r is not None] + pipe.flush()
    return [(r.index, r.output) for r in got]


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_decoupled_inference_ticks_give_the_lockstep_outputs_in_the_same_order(executor, monkeypatch, tmp_path):
    decoupled = played(executor, True, monkeypatch, tmp_path / "a.pt")
    lockstep = played(executor, False, monkeypatch, tmp_path / "b.pt")
    inline = played("inline", True, monkeypatch, tmp_path / "c.pt")
    assert [i for i, _ in decoupled] == [i for i, _ in lockstep] == [i for i, _ in inline] == list(range(24))
    for (i, a), (_, b), (_, c) in zip(decoupled, lockstep, inline, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), i
    if executor == "process":  # a checkpoint taken with a tick left behind resumes as one taken in lockstep
        resumed = []
        for name in ("a.pt", "b.pt"):
            with partime.Pipeline(counted_model(), [2, 2, 1], executor="inline") as pipe:
                pipe.load(tmp_path / name)
                resumed.append([(r.index, r.output) for r in pipe.flush()])
        assert [i for i, _ in resumed[0]] == [i for i, _ in resumed[1]] == [13, 14, 15]  # 13: out, not handed
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(*resumed, strict=True))


def hosted_forwards_at_each_result(executor, decoupled, monkeypatch):
    """How many forwards the hosted stage had run as each result of a recorded stream was handed out."""
    monkeypatch.setattr(Driver, "decoupled", decoupled)
    HOSTED_FORWARDS.clear()
    xs = [torch.randn(1, 6) for _ in range(8)]
    with partime.Pipeline(counted_model(), [2, 2, 1], executor=executor, threads=1) as pipe:
        return [(r.index, len(HOSTED_FORWARDS)) for r in pipe.stream(xs)]


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_in_a_recorded_stream_the_caller_runs_its_stage_one_tick_behind_the_workers(executor, monkeypatch):
    """Result k is handed out once sample k + 2 is fed (``READ_AHEAD``): in lockstep the hosted stage
    has run sample k + 1 by then; decoupled, only sample k, and its next tick waits for the next feed."""
    lockstep = hosted_forwards_at_each_result(executor, False, monkeypatch)
    decoupled = hosted_forwards_at_each_result(executor, True, monkeypatch)
    assert [k for k, _ in decoupled] == [k for k, _ in lockstep] == list(range(8))
    # (a forward more for each: the layout is learnt on a copy; the last results come out of the flush)
    assert [n for _, n in lockstep[:5]] == [k + 3 for k in range(5)]
    assert [n for _, n in decoupled[:5]] == [k + 2 for k in range(5)]

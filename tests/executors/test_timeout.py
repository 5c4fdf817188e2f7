"""A stage that stops answering (its process stopped, or its forward blocking) surfaces within the
pipeline's ``timeout`` as a ``StageTimeoutError`` naming it, and ``close`` leaves nothing behind."""

import glob
import multiprocessing
import os
import signal
import threading
import time

import psutil
import pytest
from faulty import TripLoss, TripOptimizer, tagged_stream, tripping_model

import partime

DEPTH = 3
TIMEOUT_S = 2.0


def stage_pid(stage):
    (proc,) = [p for p in multiprocessing.active_children() if p.name == f"partime-stage-{stage}"]
    return proc.pid


def assert_nothing_left():
    assert multiprocessing.active_children() == []
    assert [t.name for t in threading.enumerate() if t.name.startswith("partime")] == []
    assert glob.glob(f"/dev/shm/sem.partime-{os.getpid()}-*") == []


@pytest.mark.parametrize("learning", [False, True], ids=["inference", "learning"])
@pytest.mark.parametrize("stage", [0, DEPTH - 2])  # the last stage runs in the caller
def test_a_stopped_stage_surfaces_within_the_timeout_and_is_killed(stage, learning):
    xs, ys = tagged_stream(60, DEPTH)
    kw = dict(loss_fn=TripLoss(), optimizer=TripOptimizer()) if learning else {}
    with partime.Pipeline(tripping_model(DEPTH), [2] * DEPTH, threads=1, timeout=TIMEOUT_S, **kw) as pipe:
        for i in range(10):
            pipe.step(xs[i], ys[i] if learning else None)
        _ = pipe.module  # every stage has finished tick 9
        victim = psutil.Process(stage_pid(stage))
        victim.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        with pytest.raises(partime.StageTimeoutError) as info:
            for i in range(10, 60):
                pipe.step(xs[i], ys[i] if learning else None)
        elapsed = time.monotonic() - stopped
    error = info.value
    assert error.stage == stage and error.sample == 10 - stage and error.phase == "forward", str(error)
    assert f"waited {TIMEOUT_S:g} s for" in str(error) and f"stage {stage} (pid {victim.pid})" in str(error)
    assert "has finished 10 of the" in str(error) and "timeout=" in str(error)
    assert elapsed < TIMEOUT_S + 1
    assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
    assert_nothing_left()


def test_a_forward_that_blocks_for_good_surfaces_within_the_timeout():
    xs, ys = tagged_stream(20, DEPTH)
    model = tripping_model(DEPTH, stage=1, sample=5, phase="hang")
    pipe = partime.Pipeline(
        model, [2] * DEPTH, threads=1, timeout=TIMEOUT_S, loss_fn=TripLoss(), optimizer=TripOptimizer()
    )
    with pipe, pytest.raises(partime.StageTimeoutError) as info:
        for i in range(20):
            if i == 6:  # stage 1 runs sample 5 in this tick
                fed = time.monotonic()
            pipe.step(xs[i], ys[i])
    elapsed = time.monotonic() - fed
    assert (info.value.stage, info.value.sample, info.value.phase) == (1, 5, "forward")
    assert elapsed < TIMEOUT_S + 1
    assert_nothing_left()  # the exception is still held, with its traceback


@pytest.mark.parametrize("timeout", [0, -1.0, "5", True, float("nan")])
def test_a_timeout_must_be_a_positive_number_of_seconds(timeout):
    with pytest.raises(ValueError, match="timeout must be a number of seconds above 0"):
        partime.Pipeline(tripping_model(2), [2, 2], timeout=timeout)


def test_the_default_timeout_is_generous_and_none_waits_for_ever():
    assert partime.pipeline.pipeline.TIMEOUT_S == 300.0
    with partime.Pipeline(tripping_model(2), [2, 2], executor="inline", timeout=None):
        pass

"""A failure anywhere (a stage's forward, loss, backward or step; a killed worker) reaches the
caller within 5 s as one error naming the stage and the sample, and leaves no process and no
shared memory behind. (Signals to the caller: test_signals.py.)"""

import multiprocessing
import time

import psutil
import pytest
from faulty import (
    TripLoss,
    TripOptimizer,
    shm_names,
    still_there,
    tagged_stream,
    tripping_model,
)

import partime

DEPTH = 3
SAMPLE = 6
BOUND_S = 5.0
CASES = [(stage, "forward") for stage in range(DEPTH)] + [(DEPTH - 1, "loss")]
CASES += [(stage, phase) for phase in ("backward", "step") for stage in range(DEPTH)]


def pipeline(executor, stage=-1, sample=-1, phase="forward", depth=DEPTH):
    trip = phase in ("forward", "backward")
    model = tripping_model(depth, stage, sample, phase) if trip else tripping_model(depth)
    loss = TripLoss(sample if phase == "loss" else -1)
    optimizer = TripOptimizer(stage, sample) if phase == "step" else TripOptimizer()
    # stash: a stage's backward of sample s runs on s's own input, so the trip sees s's tag
    return partime.Pipeline(
        model, [2] * depth, executor=executor, loss_fn=loss, optimizer=optimizer, grad_mode="stash", threads=1
    )


def assert_nothing_left(names):
    assert multiprocessing.active_children() == []
    assert still_there(names) == set()


@pytest.mark.parametrize("executor", ["inline", "process"])
@pytest.mark.parametrize("stage, phase", CASES)
def test_a_failure_names_stage_sample_and_phase(executor, stage, phase):
    xs, ys = tagged_stream(20, DEPTH)
    names = set()
    with pipeline(executor, stage, SAMPLE, phase) as pipe:
        with pytest.raises(partime.StageError) as info:
            for i, (x, y) in enumerate(zip(xs, ys)):
                if i == SAMPLE:
                    fed = time.monotonic()
                    names = shm_names()
                pipe.step(x, y)
            pipe.flush()
        elapsed = time.monotonic() - fed
        with pytest.raises(
            partime.PipelineClosedError, match=f"stopped after an error: stage {stage}, sample {SAMPLE}"
        ):
            pipe.step(xs[0], ys[0])
    error = info.value
    assert (error.stage, error.sample, error.phase) == (stage, SAMPLE, phase)
    assert str(error).startswith(f"stage {stage}, sample {SAMPLE}, {phase}: Tripped: ")
    assert "faulty.py" in error.traceback and "Tripped" in error.traceback
    assert elapsed < BOUND_S
    assert_nothing_left(names)


def worker_pid(stage):
    (proc,) = [p for p in multiprocessing.active_children() if p.name == f"partime-stage-{stage}"]
    return proc.pid


@pytest.mark.parametrize("stage", range(DEPTH - 1))  # the last stage runs in the caller
def test_a_killed_worker_names_its_stage_and_the_sample_it_was_to_run(stage):
    xs, ys = tagged_stream(40, DEPTH)
    model = tripping_model(DEPTH)
    with partime.Pipeline(model, [2] * DEPTH, threads=1, loss_fn=TripLoss(), optimizer=TripOptimizer()) as pipe:
        for i in range(10):
            pipe.step(xs[i], ys[i])
        pipe.module  # every stage has finished tick 9: tick 10 is the next
        names = shm_names()
        victim = psutil.Process(worker_pid(stage))
        victim.kill()
        killed = time.monotonic()
        with pytest.raises(partime.WorkerDiedError) as info:
            for i in range(10, 40):
                pipe.step(xs[i], ys[i])
        elapsed = time.monotonic() - killed
    error = info.value
    assert error.stage == stage and error.sample == 10 - stage and error.phase == "forward"
    assert f"was killed by SIGKILL in tick 10, before finishing the forward of sample {10 - stage}" in str(error)
    assert elapsed < BOUND_S
    assert_nothing_left(names)

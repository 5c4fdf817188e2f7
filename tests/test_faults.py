"""A failure anywhere (a stage's forward, loss, backward or step; a killed worker; a signal to the
caller) reaches the caller within 5 s as one error naming the stage and the sample, and leaves no
process and no shared memory behind."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import partime
from partime.signals import EXIT_STATUS

from faulty import TripLoss, TripOptimizer, shm_names, still_there, tagged_stream, tripping_model

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
    return partime.Pipeline(model, [2] * depth, executor=executor, loss_fn=loss, optimizer=optimizer,
                            grad_mode="stash", threads=1)


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
        with pytest.raises(partime.PipelineClosedError, match=f"stopped after an error: stage {stage}, sample {SAMPLE}"):
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


@pytest.mark.parametrize("learning", [False, True], ids=["inference", "learning"])
@pytest.mark.parametrize("stage", range(DEPTH))
def test_a_killed_worker_names_its_stage_and_the_sample_it_was_to_run(stage, learning):
    xs, ys = tagged_stream(40, DEPTH)
    model = tripping_model(DEPTH)
    kw = dict(loss_fn=TripLoss(), optimizer=TripOptimizer()) if learning else {}
    with partime.Pipeline(model, [2] * DEPTH, threads=1, **kw) as pipe:
        for i in range(10):
            pipe.step(xs[i], ys[i] if learning else None)
        pipe.module  # every stage has finished tick 9: tick 10 is the next
        names = shm_names()
        victim = psutil.Process(worker_pid(stage))
        victim.kill()
        killed = time.monotonic()
        with pytest.raises(partime.WorkerDiedError) as info:
            for i in range(10, 40):
                pipe.step(xs[i], ys[i] if learning else None)
        elapsed = time.monotonic() - killed
    error = info.value
    assert error.stage == stage and error.sample == 10 - stage and error.phase == "forward"
    assert f"was killed by SIGKILL in tick 10, before finishing the forward of sample {10 - stage}" in str(error)
    assert elapsed < BOUND_S
    assert_nothing_left(names)


SCRIPT = """
import itertools, sys, time
import partime
from faulty import TripLoss, TripOptimizer, tagged_stream, tripping_model

def forever(items):
    for i, item in enumerate(itertools.cycle(items)):
        yield item if not isinstance(item, tuple) else (item[0], item[1] * 0 + i)

if __name__ == "__main__":
    xs, ys = tagged_stream(50, 2)
    with partime.Pipeline(tripping_model(2), [2, 2], loss_fn=TripLoss(), optimizer=TripOptimizer(), threads=1) as pipe:
        for r in pipe.stream(forever(xs), forever(ys)):
            if r.index == 20:
                print("running", flush=True)
            time.sleep(0.002)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_to_the_caller_ends_it_with_its_workers_and_shared_memory(signum, tmp_path):
    script = tmp_path / "stream_forever.py"
    script.write_text(textwrap.dedent(SCRIPT))
    tests = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent / "src"), str(tests)]))
    main = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, text=True)
    try:
        assert main.stdout.readline() == "running\n", main.stderr.read()
        family = psutil.Process(main.pid).children(recursive=True)
        assert len([p for p in family if "partime" in " ".join(p.cmdline()) or p.name() == "python"]) >= 2
        names = set().union(*(shm_names(p.pid) for p in [psutil.Process(main.pid), *family]))
        assert any("sem." in name for name in names)  # the run holds named semaphores in /dev/shm
        main.send_signal(signum)
        sent = time.monotonic()
        main.wait(timeout=30)
        elapsed = time.monotonic() - sent
        _, alive = psutil.wait_procs(family, timeout=BOUND_S)
        left = time.monotonic() - sent
    finally:
        if main.poll() is None:
            main.kill()
        main.wait()
    stderr = main.stderr.read()
    assert elapsed < BOUND_S and left < BOUND_S and alive == [], (elapsed, left, alive)
    assert still_there(names) == set()
    if signum == signal.SIGTERM:
        assert main.returncode == EXIT_STATUS, stderr  # closed as for an error, then exited
    elif signum == signal.SIGINT:
        assert "KeyboardInterrupt" in stderr
    else:
        assert main.returncode == -signal.SIGKILL
    if signum != signal.SIGKILL:
        assert "leaked" not in stderr, stderr  # the caller released everything itself


def test_sigterm_is_taken_only_while_a_process_pipeline_is_open_and_never_from_the_program():
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    xs, ys = tagged_stream(3, 2)
    with partime.Pipeline(tripping_model(2), [2, 2], threads=1) as pipe:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        pipe.step(xs[0])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with partime.Pipeline(tripping_model(2), [2, 2], executor="inline"):
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)
    try:
        with partime.Pipeline(tripping_model(2), [2, 2], threads=1):
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

"""A signal to the caller (Ctrl-C, SIGTERM, SIGKILL) ends it promptly, with every worker and
every shared-memory segment; SIGTERM is taken only while a process pipeline is open."""

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from faulty import shm_names, tagged_stream, tripping_model

import partime
from partime.pipeline.sigterm import EXIT_STATUS

BOUND_S = 5.0

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


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


GROUP = "SIGKILL-to-the-process-group"  # as `timeout -s KILL` or a job scheduler does


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL, GROUP], ids=lambda s: s if isinstance(s, str) else s.name
)
def test_a_signal_to_the_caller_ends_it_with_its_workers_and_shared_memory(signum, tmp_path):
    script = tmp_path / "stream_forever.py"
    script.write_text(textwrap.dedent(SCRIPT))
    tests = Path(__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent / "src"), str(tests)]))
    # as from a terminal: a job that a shell started in the background (`make test &`) has SIGINT
    # ignored, and its children inherit that, so Ctrl-C's default is given back to the caller
    main = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        preexec_fn=_default_sigint,
        start_new_session=signum == GROUP,
    )
    try:
        assert main.stdout.readline() == "running\n", main.stderr.read()
        family = psutil.Process(main.pid).children(recursive=True)
        assert len([p for p in family if "partime" in " ".join(p.cmdline()) or p.name() == "python"]) >= 2
        names = set().union(*(shm_names(p.pid) for p in [psutil.Process(main.pid), *family]))
        # while it runs, nothing of it has a name in /dev/shm: not its memory, not its semaphores
        assert names == set() and glob.glob(f"/dev/shm/sem.partime-{main.pid}-*") == []
        if signum == GROUP:
            os.killpg(main.pid, signal.SIGKILL)
        else:
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
    assert glob.glob(f"/dev/shm/sem.partime-{main.pid}-*") == []
    if signum == signal.SIGTERM:
        assert main.returncode == EXIT_STATUS, stderr  # closed as for an error, then exited
    elif signum == signal.SIGINT:
        assert "KeyboardInterrupt" in stderr
    else:
        assert main.returncode == -signal.SIGKILL
    if signum not in (signal.SIGKILL, GROUP):
        assert "leaked" not in stderr, stderr  # the caller released everything itself


def test_sigterm_is_taken_only_while_a_process_pipeline_is_open_and_never_from_the_program():
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    xs, _ys = tagged_stream(3, 2)
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

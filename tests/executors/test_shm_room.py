"""Room in /dev/shm: activations too large for it are refused with what is needed and how to give
it, and nothing is left there (``executors/process/shm_room.py``).

The test runs a pipeline in a process of its own whose /dev/shm is a tmpfs of 8 MB (a mount
namespace of its own, ``unshare --mount``: it needs root, and is skipped where that is refused).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from partime.core.boundary_values import TensorSpec
from partime.executors.process.shm_room import MB, SharedMemoryError, channel_bytes, message, pages

SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys
    import torch
    from torch import nn
    import partime
    from partime.executors.process import executor as process_executor

    def attempt():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1000, 100), nn.ReLU(), nn.Linear(100, 1000))
        try:
            with partime.Pipeline(model, [2, 1], executor="process", timeout=60) as pipe:
                pipe.step(torch.randn(2000, 1000))  # 8 MB a sample: 16 MB the input channel
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return None, None

    report = {"before": sorted(os.listdir("/dev/shm"))}
    report["checked"] = attempt()
    gc.collect()
    report["after_checked"] = sorted(os.listdir("/dev/shm"))
    # where the room went between the check and the allocation: torch's own failure, cleaned up too
    process_executor.check_room = lambda needs: None
    report["failed"] = attempt()
    gc.collect()
    report["after_failed"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(report))
    """
)


def run_in_small_shm(size: str) -> dict:
    if sys.platform != "linux" or shutil.which("unshare") is None:
        pytest.skip("needs Linux and unshare(1) to give a process a /dev/shm of its own")
    mount = f"mount -t tmpfs -o size={size} tmpfs /dev/shm"
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", f'{mount} && exec "$0" -c "$1"', sys.executable, SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 and ("unshare" in done.stderr or "mount" in done.stderr) and "Traceback" not in done.stderr:
        pytest.skip(f"cannot mount a small /dev/shm here (root in a mount namespace): {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_activations_too_large_for_dev_shm_are_refused_with_the_fix_and_leave_nothing_there():
    report = run_in_small_shm("8m")
    assert report["before"] == []
    for attempt in ("checked", "failed"):
        kind, text = report[attempt]
        assert kind == "SharedMemoryError", text
        assert text.startswith("the process executor needs 17.2 MB of shared memory (/dev/shm)"), text
        assert "input 15.3 MB, activation 0->1 1.5 MB, stage 0's weights 0.4 MB" in text
        assert "docker run --shm-size=256m" in text and "executor='thread'" in text
        assert "smaller samples" in text
    assert " is free there" in report["checked"][1] and "8.0 MB is free" in report["checked"][1]
    assert "(torch: unable to allocate shared memory" in report["failed"][1]
    assert report["after_checked"] == [] and report["after_failed"] == []  # no torch_* file, no semaphore


def test_a_channel_counts_its_slots_and_headers_in_whole_pages():
    spec = TensorSpec((2000, 1000), torch.float32)
    assert channel_bytes([spec], 2) == pages(24 * 2) + pages(8 * 2) + pages(2 * 8_000_000)
    assert pages(1) == pages(4096) >= 4096
    text = message([("activation 0->1", 16 * MB), ("input", 8 * MB)], 8 * MB)
    assert "needs 24.0 MB" in text and "8.0 MB is free" in text and "--shm-size=256m" in text
    assert issubclass(SharedMemoryError, RuntimeError)  # what torch raised before: caught alike

"""``benchmarks/torch_pipelining.py`` runs under torchrun and reports a finite figure per schedule (not how fast)."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_pipelining.py"
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed beside this Python or on PATH")
def test_every_schedule_and_microbatch_count_gets_a_finite_figure(tmp_path):
    path = tmp_path / "torch_pipelining.json"
    args = ["--sizes", "8", "--samples", "8", "--warmup", "2", "--microbatches", "2,4", "--rounds", "1"]
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args, "--json", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(path.read_text())
    found = {(r["mode"], r["schedule"], r["microbatches"]): r for r in rows}
    expected = {("inference", "sequential 1 thread", None), ("learning", "sequential 1 thread", None)}
    expected |= {(mode, s, m) for mode in ("inference", "learning") for s in ("GPipe", "1F1B") for m in (2, 4)}
    assert found.keys() == expected
    for row in rows:
        assert math.isfinite(row["ms_per_sample"]) and row["ms_per_sample"] > 0, row
        assert math.isfinite(row["speedup_vs_seq_1thread"]) and row["speedup_vs_seq_1thread"] > 0, row
        assert row["world"] == 2 and len(row["balance"]) == 2 and row["size"] == 8

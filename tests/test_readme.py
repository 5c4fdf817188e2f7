"""The README's example runs as a script, as a user would run it."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_first_example_runs(tmp_path):
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(example)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "0 (1, 32, 32, 32)"
    assert lines[-1] == "99 (1, 32, 32, 32)"
    assert len(lines) == 100


def test_the_spec_shipped_with_the_repository_is_the_contract():
    shared = README.parents[1] / "shared" / "SPEC.md"
    if shared.exists():  # beside a checkout of the project, the contract lives in shared/
        assert (README.parent / "SPEC.md").read_text() == shared.read_text()

"""The README's example runs as a script, as a user would run it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_first_example_runs(tmp_path):
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    script = tmp_path / "example.py"
    script.write_text(example)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "0 (1, 32, 32, 32)"
    assert lines[-1] == "99 (1, 32, 32, 32)"
    assert len(lines) == 100


def test_the_traced_models_section_runs(tmp_path):
    """The python blocks of "Any module: traced models", one after another, as one script."""
    section = README.read_text().split("### Any module: traced models\n", 1)[1]
    section = re.split(r"^##", section, maxsplit=1, flags=re.MULTILINE)[0]
    script = tmp_path / "traced.py"
    script.write_text("\n".join(re.findall(r"```python\n(.*?)```", section, re.DOTALL)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("2 stages: [") and any(line.startswith("  stage 0 -> 1: ") for line in lines)
    assert lines[-4:] == [
        "(('down', 'relu', 'pool'), ('mid', 'relu_1', 'up', 'cat', 'out'))",
        "stage 0 -> 1: 2 tensors, 10240 bytes: relu (1, 8, 16, 16) float32, pool (1, 8, 8, 8) float32",
        "[(1, 8), (1, 8), (1, 8)]",
        "BaseModelOutputWithPastAndCrossAttentions (1, 16, 64)",
    ]


def test_the_live_sources_example_runs(tmp_path):
    section = README.read_text().split("### Live sources: keeping up, and how late\n", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    script = tmp_path / "live.py"
    script.write_text(example)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"200 results, \d+ dropped, p50 latency \d+\.\d ms\n", done.stdout), done.stdout


# Where the users' copy of the contract may differ from shared/SPEC.md, and why: the contract covers
# features before they are built, and the copy grows with the feature that implements it.
SPEC_DIFFERENCES = {
    "Learning: loss and backward": "graph-stash, a fourth grad mode, is the default: one forward per sample "
    "(README, Learning with delay), and as weight-stash in a stage with normalisation layers",
    "Random and stateful layers": "each module keeps its train/eval mode; the caller's draws are its own "
    "while the stages draw in threads of its process",
    "Live sources (`when_behind`)": "a source that raises gets the results of what it gave, then its error",
}
SPEC_PENDING: dict[str, str] = {}


def sections(text):
    parts = re.split(r"^## (.*)$", text, flags=re.MULTILINE)
    return {"": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def test_the_spec_shipped_with_the_repository_is_the_contract():
    shared = README.parents[1] / "shared" / "SPEC.md"
    if not shared.exists():  # the contract lives in shared/ beside a checkout of the project
        pytest.skip("no shared/SPEC.md beside this checkout")
    copy, contract = sections((README.parent / "SPEC.md").read_text()), sections(shared.read_text())
    assert set(contract) - set(copy) <= set(SPEC_PENDING)
    for title, text in copy.items():
        assert title in contract, title
        if title not in SPEC_DIFFERENCES:
            assert text.strip() == contract[title].strip(), title


def test_the_layout_names_every_module():
    layout = README.read_text().split("## Layout\n", 1)[1]
    package = README.parent / "src" / "partime"
    missing = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if path.name != "__init__.py" and f"`{path.name}`" not in layout and path.name != "__main__.py"
    ]
    assert missing == []

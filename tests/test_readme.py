"""The README: every code block runs as a user would run it, and a newcomer finds the essentials
in its first 150 of at most 300 lines."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> dict[str, str]:
    """Each ```python block of the README, by the heading of its section."""
    found = {}
    for part in re.split(r"^## ", README.read_text(), flags=re.MULTILINE)[1:]:
        title, _, body = part.partition("\n")
        for k, code in enumerate(re.findall(r"```python\n(.*?)```", body, re.DOTALL)):
            found[title if k == 0 else f"{title} ({k + 1})"] = code
    return found


def _first_inference(out: str) -> None:
    lines = out.splitlines()
    assert lines[0] == "0 (1, 32, 32, 32)" and lines[-1] == "99 (1, 32, 32, 32)" and len(lines) == 100


def _first_learning(out: str) -> None:
    match = re.fullmatch(r"3000 samples, accuracy over the last 500: (\d\.\d\d)\n", out)
    assert match, out
    assert float(match.group(1)) >= 0.7  # four classes: chance is 0.25


def _live_source(out: str) -> None:
    assert re.fullmatch(r"200 results, \d+ dropped, p50 latency \d+\.\d ms\n", out), out


def _keeping(out: str) -> None:
    assert out == "200 True\n"  # resumed from the checkpoint, the losses are those of the run without a stop


CHECKS = {
    "A first inference": _first_inference,
    "A first online-learning loop": _first_learning,
    "A live source": _live_source,
    "Keeping what it learnt": _keeping,
}


def test_every_code_block_has_its_check() -> None:
    assert set(_blocks()) == set(CHECKS)


@pytest.mark.parametrize("section", sorted(CHECKS))
def test_the_code_block_runs(section: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_blocks()[section])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    CHECKS[section](done.stdout)


def test_a_newcomer_finds_the_essentials_in_the_first_150_of_at_most_300_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300
    heads = [line for line in lines[:150] if line.startswith("## ")]
    for essential in ("## Install", "## A first inference", "## A first online-learning loop", "## A live source"):
        assert essential in heads
    assert any("pipe.save(" in line for line in lines[:150]) and any("torch.save(" in line for line in lines[:150])


def test_every_link_to_a_file_of_the_repository_leads_to_one() -> None:
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert targets
    missing = [target for target in targets if not (README.parent / target).exists()]
    assert missing == []


# Where the users' copy of the contract may differ from shared/SPEC.md, and why: the contract covers
# features before they are built, and the copy grows with the feature that implements it.
SPEC_DIFFERENCES = {
    "Forward (inference and learning)": "autocast=: every stage's forward and the loss under torch.autocast of "
    "that dtype, the same on every executor; compile=: every stage's forward through torch.compile",
    "Learning: loss and backward": "graph-stash, a fourth grad mode, is the default: one forward per sample "
    "(docs/guides/learning.md), and as weight-stash in a stage with normalisation layers; each stage's lr "
    "schedule and gradient clipping (its own norm) act on its own steps; stages before the first that trains take no "
    "gradient; a predicted sample goes forward under no_grad, without a loss, and no stage steps for it",
    "Random and stateful layers": "each module keeps its train/eval mode; the caller's draws are its own "
    "while the stages draw in threads of its process",
    "Live sources (`when_behind`)": "a source that raises gets the results of what it gave, then its error",
    "Results": "a predicted sample's result has no loss, and says it was predicted",
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

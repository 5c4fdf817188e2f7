"""The results pages of the documentation site are what experiments/results_pages.py makes of the
committed JSON, and no file that git tracks under docs/ or experiments/ is over 200 KB."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "results_pages.py"
PAGES = ("speed", "fidelity", "live", "soak")
MAX_BYTES = 200_000


def load_script():
    spec = importlib.util.spec_from_file_location("results_pages", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_pages_are_what_the_script_makes_of_the_json(tmp_path: Path) -> None:
    written = load_script().write_pages(tmp_path)
    assert sorted(path.name for path in written) == sorted(f"{name}.md" for name in PAGES)
    for name in PAGES:
        made = (tmp_path / f"{name}.md").read_text()
        committed = (ROOT / "docs" / "results" / f"{name}.md").read_text()
        assert made == committed, f"docs/results/{name}.md differs from its data: run experiments/results_pages.py"
        assert made.startswith("# ") and "|---|" in made


def test_every_picture_a_page_shows_is_beside_it(tmp_path: Path) -> None:
    load_script().write_pages(tmp_path)
    for name in PAGES:
        page = (ROOT / "docs" / "results" / f"{name}.md").read_text()
        for line in page.splitlines():
            if line.startswith("!["):
                picture = line[line.index("](") + 2 : -1]
                assert (ROOT / "docs" / "results" / picture).is_file(), f"{name}.md shows {picture}, which is missing"


def tracked(*folders: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", *folders], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.stdout.decode().split("\0") if name]


def test_no_tracked_file_under_docs_or_experiments_is_over_200_kb() -> None:
    files = tracked("docs", "experiments")
    assert ROOT / "experiments" / "results_pages.py" in files, "git lists no file under experiments/"
    large = {
        str(path.relative_to(ROOT)): path.stat().st_size
        for path in files
        if path.is_file() and path.stat().st_size > MAX_BYTES
    }
    assert large == {}

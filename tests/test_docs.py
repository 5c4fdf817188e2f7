"""The documentation site: it builds strictly, its API pages name every public name, and the
examples of its pages run as scripts, as a user would run them."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MKDOCS = Path(sys.executable).with_name("mkdocs")

# Each public module and the API page that documents it.
API_PAGES = {
    "partime": "partime",
    "partime.sources": "sources",
    "partime.metrics": "metrics",
    "partime.streams": "streams",
    "partime.internals": "internals",
    "partime.optim": "optim",
}
# A block right after this comment is shown, not run (it needs two hosts, torchrun, a camera, or
# it is a summary of calls); the comment says why.
NOT_RUN = "<!-- not run:"


def runnable_blocks(page):
    """The python blocks of a page that are meant to run, in order."""
    blocks = []
    for match in re.finditer(
        r"(?:^(<!--[^\n]*-->)\n)?^```python[^\n]*\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL
    ):
        comment, code = match.groups()
        if not (comment or "").startswith(NOT_RUN):
            blocks.append(code)
    return blocks


def run_page(page, tmp_path):
    """The page's runnable blocks joined in order, run as one script; its stdout lines."""
    script = tmp_path / f"{page.stem}.py"
    script.write_text("\n".join(runnable_blocks(page)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return out


def test_the_site_builds_strictly(site):
    assert (site / "index.html").exists()
    assert (site / "guides" / "tick" / "index.html").exists()
    assert list((site / "assets" / "stylesheets").glob("main.*.min.css"))  # the theme, not excluded with docs/


def test_the_site_shows_the_installed_version(site):
    from importlib.metadata import version

    assert f"partime {version('partime')}" in (site / "index.html").read_text()


@pytest.mark.parametrize("module", sorted(API_PAGES))
def test_the_api_pages_name_every_public_name(site, module):
    html = (site / "api" / API_PAGES[module] / "index.html").read_text()
    missing = [name for name in importlib.import_module(module).__all__ if f'id="{module}.{name}"' not in html]
    assert missing == []


def test_the_api_pages_show_the_video_functions(site):
    html = (site / "api" / "video" / "index.html").read_text()
    assert 'id="partime.video.video_frames"' in html and 'id="partime.video.write_video"' in html


def test_docstring_examples_are_code_blocks(site):
    html = (site / "api" / "partime" / "index.html").read_text()
    assert '<span class="gp">&gt;&gt;&gt;' in html  # a prompt inside a highlighted block, not a quote
    assert "<blockquote>" not in html


def test_the_first_example_runs(tmp_path):
    lines = run_page(DOCS / "index.md", tmp_path)
    assert lines[0] == "0 (1, 32, 32, 32)" and lines[-1] == "99 (1, 32, 32, 32)" and len(lines) == 100


def test_the_tick_guide_runs(tmp_path):
    assert run_page(DOCS / "guides" / "tick.md", tmp_path) == ["None 0 [1]", "[0, 1]", "2 16 True"]


def test_the_learning_guide_runs(tmp_path):
    expected = ["60 float", "nadam 60", "muon 60", "60 True", "60 True", "48 12 12 True"]
    assert run_page(DOCS / "guides" / "learning.md", tmp_path) == expected


def test_the_mixed_precision_guide_runs(tmp_path):
    assert run_page(DOCS / "guides" / "mixed-precision.md", tmp_path) == [
        "40 torch.bfloat16 torch.float32",
        "RuntimeError 0",
    ]


def test_the_compile_guide_runs(tmp_path):
    assert run_page(DOCS / "guides" / "compile.md", tmp_path) == ["40 True", "TypeError True"]


def test_the_compensation_guide_runs(tmp_path):
    assert run_page(DOCS / "guides" / "compensation.md", tmp_path) == ["auto 20", "('step-scale',) 20", "() 20"]


def test_the_executors_guide_runs(tmp_path):
    assert run_page(DOCS / "guides" / "executors.md", tmp_path) == ["True"]


def test_the_live_sources_guide_runs(tmp_path):
    (line,) = run_page(DOCS / "guides" / "live-sources.md", tmp_path)
    assert re.fullmatch(r"200 results, \d+ dropped, p50 latency \d+\.\d ms", line), line


def test_the_video_guide_runs(tmp_path):
    assert run_page(DOCS / "guides" / "video.md", tmp_path) == ["torch.Size([3, 64, 64])"] * 30


def test_the_checkpoints_guide_runs(tmp_path):
    assert run_page(DOCS / "guides" / "checkpoints.md", tmp_path) == ["True"]


def test_the_monitoring_guide_runs(tmp_path):
    assert run_page(DOCS / "guides" / "monitoring.md", tmp_path) == [
        "0 120 0.00625 True",
        "1 120 0.00625 True",
        "4 True",
        "120",
    ]


def test_the_troubleshooting_guide_runs(tmp_path):
    assert run_page(DOCS / "guides" / "troubleshooting.md", tmp_path) == [
        "ValueError",
        "StageError 1 0 loss",
        "RuntimeError",
    ]


def test_the_traced_models_guide_runs(tmp_path):
    """The python blocks of the traced models guide, one after another, as one script."""
    lines = run_page(DOCS / "guides" / "traced-models.md", tmp_path)
    assert lines[0].startswith("2 stages: [") and any(line.startswith("  stage 0 -> 1: ") for line in lines)
    assert lines[-4:] == [
        "(('down', 'relu', 'pool'), ('mid', 'relu_1', 'up', 'cat', 'out'))",
        "stage 0 -> 1: 2 tensors, 10240 bytes: relu (1, 8, 16, 16) float32, pool (1, 8, 8, 8) float32",
        "[(1, 8), (1, 8), (1, 8)]",
        "BaseModelOutputWithPastAndCrossAttentions (1, 16, 64)",
    ]


TESTED_PAGES = {"index", "tick", "learning", "compensation", "executors", "live-sources", "video", "checkpoints"}
TESTED_PAGES |= {"troubleshooting", "traced-models", "mixed-precision", "compile", "monitoring"}


def test_every_page_with_an_example_is_run():
    pages = [DOCS / "index.md", *sorted((DOCS / "guides").glob("*.md"))]
    assert [page.stem for page in pages if runnable_blocks(page) and page.stem not in TESTED_PAGES] == []


def test_the_package_map_names_every_module():
    layout = (DOCS / "guides" / "package-map.md").read_text()
    missing = [
        str(path.relative_to(ROOT / "src"))
        for package in ("partime", "partime_tools")
        for path in sorted((ROOT / "src" / package).rglob("*.py"))
        if path.name != "__init__.py" and f"`{path.name}`" not in layout
    ]
    assert missing == []

"""The distribution as a user gets it: the wheel ``python -m build`` makes, installed alone in a fresh venv.

``pip install partime`` must give a library that runs with torch, numpy and cloudpickle only, the
``partime`` command that names the tools extra, the type information (``py.typed``) and the
license, at the version pyproject gives. The build, the venv and the install take about a minute;
``-m 'not slow'`` leaves these tests out.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]

RUN_A_PIPELINE = """
import importlib.util
import json

import torch
from torch import nn

import partime

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
xs = [torch.randn(1, 3) for _ in range(3)]
with partime.Pipeline(model, [2, 1], executor="inline") as pipe:
    results = list(pipe.stream(xs))
with torch.no_grad():
    expected = [model(x) for x in xs]
print(json.dumps({
    "version": partime.__version__,
    "indices": [r.index for r in results],
    "outputs_match": all(torch.allclose(r.output, e, rtol=0, atol=1e-6) for r, e in zip(results, expected)),
    "tools_installed": [m for m in ("click", "rich") if importlib.util.find_spec(m) is not None],
    "typed": [importlib.util.find_spec(p).submodule_search_locations[0] for p in ("partime", "partime_tools")],
}))
"""


class Installed(NamedTuple):
    wheel: Path
    sdist: Path
    venv: Path
    tmp: Path
    """Where the commands run: no ``partime`` package of this source tree lies in it."""


def pyproject_version() -> str:
    match = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert match, "pyproject.toml names no version"
    return match.group(1)


def run(*command: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        cwd=cwd,
        env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel and sdist built from this tree, and a fresh venv holding the wheel and its core dependencies."""
    pytest.importorskip("build", reason="the dev extra's `build` makes the distribution")
    tmp = tmp_path_factory.mktemp("wheel")
    # An isolated build, setuptools from the registry as on a user's machine (a few seconds here); build
    # makes the sdist first and the wheel from the sdist, so the wheel also shows the sdist builds.
    built = run(sys.executable, "-m", "build", "--outdir", tmp / "dist", ROOT, cwd=tmp)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("partime-*.whl")
    (sdist,) = (tmp / "dist").glob("partime-*.tar.gz")

    venv = tmp / "venv"
    made = run(sys.executable, "-m", "venv", venv, cwd=tmp)
    assert made.returncode == 0, made.stderr
    # The torch of this environment, exactly (the CPU build on this disk): pip may not fetch another build.
    same_torch = tmp / "same-torch.txt"
    same_torch.write_text(f"torch=={torch.__version__}\n")
    pip = run(
        venv / "bin" / "python",
        "-m",
        "pip",
        "install",
        "-q",
        "-c",
        ROOT / "constraints.txt",
        "-c",
        same_torch,
        wheel,
        cwd=tmp,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    return Installed(wheel, sdist, venv, tmp)


def test_the_wheel_holds_the_library_its_tools_its_types_and_its_license(installed: Installed) -> None:
    dist_info = f"partime-{pyproject_version()}.dist-info"
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(f"{dist_info}/METADATA").decode()
    assert {name.split("/")[0] for name in names} == {"partime", "partime_tools", dist_info}
    assert {"partime/py.typed", "partime_tools/py.typed", f"{dist_info}/licenses/LICENSE"} <= set(names)
    assert {"partime/pipeline/pipeline.py", "partime_tools/cli.py"} <= set(names)
    assert "License-Expression: MIT" in metadata


def test_the_sdist_holds_what_a_build_needs(installed: Installed) -> None:
    top = f"partime-{pyproject_version()}"
    with tarfile.open(installed.sdist) as sdist:
        names = set(sdist.getnames())
    for needed in ("pyproject.toml", "README.md", "LICENSE", "src/partime/__init__.py", "src/partime_tools/cli.py"):
        assert f"{top}/{needed}" in names, needed
    assert not any(name.startswith((f"{top}/docs/", f"{top}/experiments/", f"{top}/benchmarks/")) for name in names)


def test_the_installed_wheel_runs_a_pipeline_without_the_tools(installed: Installed) -> None:
    ran = run(installed.venv / "bin" / "python", "-c", RUN_A_PIPELINE, cwd=installed.tmp, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(ran.stdout)
    assert report["version"] == pyproject_version()
    assert report["indices"] == [0, 1, 2]
    assert report["outputs_match"] is True
    assert report["tools_installed"] == []
    # Installed, not this source tree: the packages live in the venv, each with its py.typed.
    for package in report["typed"]:
        assert Path(package).resolve().is_relative_to(installed.venv.resolve()), package
        assert (Path(package) / "py.typed").is_file(), package


def test_the_installed_command_without_the_tools_names_the_extra(installed: Installed) -> None:
    ran = run(installed.venv / "bin" / "partime", "--help", cwd=installed.tmp, timeout=60)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "pip install partime[tools]" in ran.stderr
    assert "Traceback" not in ran.stderr

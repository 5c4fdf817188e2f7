"""The core is light: it needs only torch, numpy and cloudpickle, and loads none of the tools' packages."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys

TOOLS_MODULES = ("matplotlib", "sklearn", "rich", "click", "PIL", "psutil", "tensorboard")

CORE = """
import sys

import torch
from torch import nn

import partime
import partime.metrics
import partime.streams

model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
sgd = lambda params: torch.optim.SGD(params, lr=0.1)
with partime.Pipeline(model, 2, executor="inline", loss_fn=nn.MSELoss(), optimizer=sgd) as pipe:
    results = [pipe.step(torch.randn(1, 3), torch.randn(1, 2)) for _ in range(3)]
    results += pipe.flush()
assert [r.index for r in results if r is not None] == [0, 1, 2], results
print(" ".join(sorted(m for m in {modules!r} if m in sys.modules)))
"""


def test_importing_and_running_the_core_loads_none_of_the_tools_packages() -> None:
    code = CORE.format(modules=TOOLS_MODULES)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", f"the core loaded {run.stdout.strip()}"


def test_the_installed_distribution_requires_only_torch_numpy_and_cloudpickle() -> None:
    requires = importlib.metadata.requires("partime") or []
    # A requirement is its name, then a version, extras or a marker: "torch>=2.6", "rich>=13.0; extra == 'tools'".
    core = {re.split(r"[^A-Za-z0-9_.-]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r}
    assert core == {"torch", "numpy", "cloudpickle"}, requires


def test_the_command_without_the_tools_extra_says_how_to_install_it() -> None:
    # `import click` fails as if click were not installed; the shim must say so, not print a traceback.
    code = "import sys; sys.modules['click'] = None; from partime.__main__ import main; main()"
    run = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, check=False, timeout=60
    )
    assert run.returncode == 1
    assert "pip install partime[tools]" in run.stderr and "click" in run.stderr
    assert "Traceback" not in run.stderr

"""A user's type checker reads partime's public API: the string options are ``Literal`` types, and a
script written against the API passes ``mypy --strict``; a misspelt option fails it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, get_args

import pytest

import partime
from partime.core.stage import config
from partime.executors import EXECUTORS, ExecutorName
from partime.learning import compensation
from partime.pipeline import arrivals

pytest.importorskip("mypy")


@pytest.mark.parametrize(
    ("alias", "values"),
    [
        (ExecutorName, EXECUTORS),
        (config.GradMode, config.GRAD_MODES),
        (config.NonfinitePolicy, config.NONFINITE),
        (arrivals.WhenBehind, arrivals.WHEN_BEHIND),
        (compensation.Compensation, compensation.COMPENSATIONS),
    ],
    ids=["executor", "grad_mode", "nonfinite", "when_behind", "compensation"],
)
def test_each_literal_holds_the_values_the_library_checks(alias: Any, values: tuple[str, ...]) -> None:
    assert get_args(alias) == values


def test_the_package_exports_the_option_types() -> None:
    assert partime.ExecutorName is ExecutorName
    assert partime.GradMode is config.GradMode
    assert {"ExecutorName", "GradMode"} <= set(partime.__all__)


USER_SCRIPT = """
from pathlib import Path

import torch
from torch import nn

from partime import EXECUTORS, GRAD_MODES, ExecutorName, GradMode, Pipeline, Result
from partime.metrics import OnlineMetrics
from partime.sources import at_rate


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def infer(executor: ExecutorName, samples: list[torch.Tensor]) -> list[Result]:
    with Pipeline(model(), [2, 1], executor=executor, nonfinite="skip") as pipe:
        first = pipe.step(samples[0])
        rest = list(pipe.stream(at_rate(samples[1:], 100.0), when_behind="drop"))
        return ([] if first is None else [first]) + rest + pipe.flush()


def learn(grad_mode: GradMode, path: Path) -> nn.Module:
    metrics = OnlineMetrics(window=10)
    pipe = Pipeline(
        model(),
        2,
        executor="thread",
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5),
        max_grad_norm=1.0,
        grad_mode=grad_mode,
        compensation=("step-scale", "delay-correction"),
        sample=torch.zeros(4),
        timeout=None,
    )
    with pipe:
        xs = [torch.randn(4) for _ in range(8)]
        ys = [torch.tensor(i % 2) for i in range(8)]
        for r in pipe.stream(xs, ys):
            metrics.update(r.output, r.target, loss=r.loss)
            index: int = r.index
            loss: float | None = r.loss
            late: float = r.latency
            if r.skipped or r.dropped:
                print(index, loss, late)
        pipe.save(path)
        pipe.load(path)
        print(metrics.accuracy, metrics.rolling_loss, pipe.fed, pipe.partition, pipe.learning)
        return pipe.module


for executor in EXECUTORS:
    infer(executor, [torch.randn(4) for _ in range(5)])
for grad_mode in GRAD_MODES:
    learn(grad_mode, Path("pipe.pt"))
Pipeline(model(), "auto", compensation="auto", sample=torch.zeros(4))
"""

WRONG_OPTION = """
from torch import nn

from partime import Pipeline

Pipeline(nn.Sequential(nn.Linear(4, 2)), [1], executor="proces")
"""


def _mypy(script: Path) -> subprocess.CompletedProcess[str]:
    """``mypy --strict`` on ``script`` as a user runs it: from its own folder, with no project config."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-error-summary",
            "--cache-dir",
            str(script.parent / ".mypy"),
            script.name,
        ],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_script_on_the_public_api_passes_mypy_strict_and_a_misspelt_option_fails(tmp_path: Path) -> None:
    good = tmp_path / "good.py"
    good.write_text(textwrap.dedent(USER_SCRIPT))
    done = _mypy(good)
    assert (done.returncode, done.stdout) == (0, "")

    wrong = tmp_path / "wrong.py"
    wrong.write_text(WRONG_OPTION)
    done = _mypy(wrong)  # the cache the first run left makes this one quick
    assert done.returncode == 1
    assert 'Argument "executor" to "Pipeline" has incompatible type "Literal[\'proces\']"' in done.stdout
    assert "Literal['inline', 'process', 'thread', 'distributed']" in done.stdout

"""How fidelity chooses step sizes: sequential's best for every configuration, or each its own.

Either way the choice is made on ``TUNING_SEED`` from the runs at every step size of a grid and
a run's ``score`` (the highest accuracy, the lowest loss on the camera; a diverged run never wins).

- Sequential's step for all: ``tuning_configs`` are sequential learning of each stream with each
  optimizer at every step size of ``LR_GRID``; ``best_step_sizes`` the step size of each (stream,
  optimizer) that every configuration then learns with, a pipeline held to a well-tuned baseline.
- Each at its own step (the user's view: whoever runs a pipeline tunes its step size for it):
  ``at_every_own_step`` runs each configuration, sequential included, at every step size of
  ``own_grid``, which is ``LR_GRID`` with one step more on each side (``SMALLER_STEP``: the
  largest stable step shrinks with the delay; ``LARGER_STEP``: a configuration's best step
  should not be the grid's edge); ``own_best_steps`` chooses each configuration's;
  ``at_own_steps`` runs each at it on ``reported_seeds``, which never hold the tuning seed.

Pure data: nothing here trains or times.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .configs import Config

LR_GRID = {
    "sgd": (0.03, 0.1, 0.3, 1.0, 3.0),
    "momentum": (0.003, 0.01, 0.03, 0.1, 0.3),
    "adam": (3e-4, 1e-3, 3e-3, 1e-2),
    "nadam": (1e-3, 3e-3),
    "muon": (1e-3, 3e-3),
}
"""The step sizes tried for sequential learning; each stream and optimizer learns with its best."""
SMALLER_STEP = {"sgd": 0.01, "momentum": 0.001, "adam": 1e-4, "nadam": 3e-4, "muon": 3e-4}
"""The step below each optimizer's ``LR_GRID`` that ``own_grid`` tries as well."""
LARGER_STEP = {"sgd": 10.0, "momentum": 1.0, "adam": 3e-2, "nadam": 1e-2, "muon": 1e-2}
"""The step above each optimizer's ``LR_GRID`` that ``own_grid`` tries as well."""
TUNING_SEED = 0
"""The seed whose runs choose the step size; never a seed that is reported."""

StepSizes = dict[tuple[str, str], float]
"""The step size of each (stream, optimizer)."""
OwnSteps = dict[tuple[str, str, str], float]
"""The step size of each (stream, optimizer, configuration label)."""


def score(row: dict[str, Any]) -> float:
    """How well a run learnt, higher is better: its accuracy, or minus its loss on the camera;
    minus infinity for a diverged run."""
    if row["stream"] == "camera":
        return -row["loss"] if row["loss"] is not None else -math.inf
    return row["accuracy"] if row["diverged_at"] is None else -math.inf


def tuning_configs(stream_names: Sequence[str], optimizers: Sequence[str]) -> list[Config]:
    """Sequential learning of each stream with each optimizer at every step size of its grid."""
    return [
        Config(stream, 1, seed=TUNING_SEED, optimizer=opt, lr=lr)
        for stream in stream_names
        for opt in optimizers
        for lr in LR_GRID[opt]
    ]


def best_step_sizes(rows: Sequence[dict[str, Any]]) -> StepSizes:
    """For each (stream, optimizer) among ``rows``, the step size whose run scored best (a
    diverged run never wins): the highest accuracy, or the lowest loss on the camera."""
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for row in rows:
        key = (row["stream"], row["optimizer"])
        if key not in best or score(row) > best[key][0]:
            best[key] = (score(row), row["lr"])
    return {key: lr for key, (_, lr) in best.items()}


def own_grid(optimizer: str) -> tuple[float, ...]:
    """The step sizes each configuration tries with ``optimizer``: ``LR_GRID``'s, one smaller and one larger."""
    return (SMALLER_STEP[optimizer], *LR_GRID[optimizer], LARGER_STEP[optimizer])


def own_key(config: Config | dict[str, Any]) -> tuple[str, str, str]:
    """Which configuration a run (a ``Config`` or its row) is, whatever its seed and step size."""
    if isinstance(config, Config):
        return config.stream, config.optimizer, config.label
    return config["stream"], config["optimizer"], config["label"]


def at_every_own_step(cfgs: Sequence[Config]) -> list[Config]:
    """Each configuration of ``cfgs`` (one of each, whatever its seed and step size), on
    ``TUNING_SEED``, at every step size of its optimizer's ``own_grid``."""
    unique = {own_key(c): c for c in cfgs}.values()
    return [replace(c, seed=TUNING_SEED, lr=lr) for c in unique for lr in own_grid(c.optimizer)]


def own_best_steps(rows: Sequence[dict[str, Any]]) -> OwnSteps:
    """For each configuration among ``rows`` (``own_key``), the step size whose run scored best,
    by ``best_step_sizes``' rule: the highest accuracy, or the lowest loss on the camera; a
    diverged run never wins."""
    best: dict[tuple[str, str, str], tuple[float, float]] = {}
    for row in rows:
        key = own_key(row)
        if key not in best or score(row) > best[key][0]:
            best[key] = (score(row), row["lr"])
    return {key: lr for key, (_, lr) in best.items()}


def reported_seeds(seeds: int) -> range:
    """The ``seeds`` seeds reported after a tuning run: the next ones after ``TUNING_SEED``."""
    return range(TUNING_SEED + 1, TUNING_SEED + 1 + seeds)


def at_own_steps(tuning: Sequence[Config], steps: OwnSteps, seeds: int) -> list[Config]:
    """Each configuration of ``tuning`` at its step size of ``steps``, on each of
    ``reported_seeds(seeds)``: for each stream and optimizer, seed by seed."""
    unique = {own_key(c): c for c in tuning}.values()
    out = []
    for _, group in itertools.groupby(unique, key=lambda c: (c.stream, c.optimizer)):
        mine = list(group)
        out += [replace(c, seed=seed, lr=steps[own_key(c)]) for seed in reported_seeds(seeds) for c in mine]
    return out

"""The Python floor as a contender of ``partime bench --sizes``: ``benchmarks/python_floor.py``, loaded by path.

The floor is the simplest Python pipeline that does the work of partime's default on a cut (a
process per stage but the last, shared-memory rings with semaphores, one torch thread per stage;
learning, each sample's graph kept for its late gradient, no compensation): a speed partime's
pipelines should beat. The sweep runs it on each cut its pipelines chose, interleaved with them.

The file belongs to the repository, not to the package (``benchmarks/`` beside ``src/``): where it
is absent (an installed wheel), or where the model is not an ``nn.Sequential`` that the floor can cut
(a traced model), ``left_out`` says why, and the sweep runs without it.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import Tensor, nn

from partime import Partition
from partime.internals import torch_threads

from .contenders import Contender, Opened, Setting, time_stream
from .latency import Offered

FLOOR_FILE = Path(__file__).resolve().parents[3] / "benchmarks" / "python_floor.py"
"""Where the floor is: the repository's ``benchmarks/`` folder, beside ``src/``."""

MODULE = "python_floor"
"""The name the floor's module is loaded under (its workers import it by that name)."""

KIND = "python floor"
"""The kind of the floor's contenders and rows, and the start of their names."""


def left_out(model: nn.Module) -> str | None:
    """Why the sweep runs without the floor on ``model`` (one line for the report), or None where it runs."""
    path = FLOOR_FILE
    if not path.is_file():
        return f"{KIND}: left out, {path} is not here (an installed package has no benchmarks/ folder)"
    if not isinstance(model, nn.Sequential):
        return f"{KIND}: left out, it cuts an nn.Sequential and this model ({type(model).__name__}) is traced"
    return None


def load_floor(path: Path = FLOOR_FILE) -> ModuleType:
    """The floor's module, loaded from ``path`` once and kept in ``sys.modules`` under ``MODULE``:
    its workers' function is pickled by reference, by that name."""
    loaded = sys.modules.get(MODULE)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE]
        raise
    return module


def python_floor(name: str, partition: Partition) -> Contender:
    """The floor on the cut ``partition`` (of at least 2 stages) of a copy of the setting's model,
    learning with the setting's optimizer when the setting learns."""

    @contextmanager
    def open_(setting: Setting) -> Iterator[Opened]:
        floor: Any = load_floor().PythonFloor
        optimizer = setting.optimizer if setting.learning else None
        with torch_threads(1), floor(setting.layers, partition.balance, setting.xs[0], optimizer) as pipe:
            targets = setting.ys

            def stream(offered: Offered[Tensor]) -> Iterator[Tensor]:
                return pipe.stream(offered, None if targets is None else iter(targets))

            yield Opened(lambda: time_stream(setting, stream))

    return Contender(name, KIND, partition.depth, 1, open_)

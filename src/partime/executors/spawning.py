"""How a worker process gets its stage without running the caller's script again.

``ByValue`` carries an object (a stage's module) into a process started by ``spawn`` as the bytes
of cloudpickle, so that classes and functions of ``__main__`` (a notebook, ``python -c``, a script
read from stdin) travel by value, with torch's reductions for multiprocessing, so that tensors in
shared memory travel as file descriptors; the worker rebuilds it in its own code (``load``), where
a failure is the stage's, reported with its traceback. ``main_not_rerun`` keeps ``spawn`` from
importing the caller's main script in the worker, which would run an unguarded script again.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import sys
from collections import ChainMap
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any, ClassVar

import cloudpickle
from torch import nn
from torch.nn.utils import parametrize


class SharingPickler(cloudpickle.Pickler):
    """cloudpickle, with torch's reductions for multiprocessing: tensors in shared memory travel
    as file descriptors (so the caller keeps reading the stages' weights in place)."""

    dispatch_table: ClassVar[ChainMap[Any, Any]] = ChainMap(
        ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
        cloudpickle.Pickler.dispatch_table,
    )


class ByValue:
    """An object that crosses into a spawned process as bytes and is rebuilt only by ``load()``, in
    the worker's own code: a failure to rebuild it (a class that cannot be imported there) is then
    reported like any failure of the stage, not a crash of the process's start-up."""

    def __init__(self, value: Any):
        _check_picklable(value)
        self._value = value
        self._data: bytes | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # while the process starts: the descriptors go with it
        buffer = io.BytesIO()
        SharingPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(self._value)
        return _from_bytes, (buffer.getvalue(),)

    def load(self) -> Any:
        return self._value if self._data is None else pickle.loads(self._data)


def _check_picklable(value: Any) -> None:
    """A TypeError, before any process starts, if ``value`` holds a module that torch refuses to
    pickle: one with a parametrization (``torch.nn.utils.parametrize``, as
    ``torch.nn.utils.parametrizations.weight_norm`` makes), whose class torch makes on the fly."""
    if not isinstance(value, nn.Module):
        return
    held = [name or "the stage itself" for name, module in value.named_modules() if parametrize.is_parametrized(module)]
    if held:
        raise TypeError(
            f"a stage to run in a worker process holds parametrized modules ({', '.join(held)}: "
            "torch.nn.utils.parametrize, as parametrizations.weight_norm or spectral_norm make), which torch "
            "cannot pickle, so the stage cannot travel to its process. Use executor='thread' (or 'inline'), or "
            "remove the parametrization first: torch.nn.utils.parametrize.remove_parametrizations(module, "
            "'weight', leave_parametrized=True) keeps the weight it computes"
        )


def _from_bytes(data: bytes) -> ByValue:
    packed = ByValue(None)
    packed._data = data
    return packed


@contextlib.contextmanager
def main_not_rerun() -> Iterator[None]:
    """While workers start: ``spawn`` would have each one import the caller's main script again (so
    that objects of ``__main__`` can be unpickled), which runs an unguarded script's pipeline again,
    in the worker. Everything a worker is given travels by cloudpickle, ``__main__``'s classes and
    functions by value, so it needs no main script: hide it from ``spawn`` meanwhile."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved: dict[str, Any] = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)

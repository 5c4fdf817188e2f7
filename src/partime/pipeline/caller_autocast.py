"""The check that the caller feeds a pipeline outside its own ``torch.autocast``.

A pipeline runs each stage's forward where the executor puts it: in this thread, in a worker
thread, or in a stage process. An autocast the caller opens around ``step`` or ``stream`` would
reach some of them and not others, so a pipeline refuses it and computes in lower precision only
as ``Pipeline(autocast=...)`` says, the same on every executor.
"""

from __future__ import annotations

import torch

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
"""The device types whose autocast flag is looked at (CUDA's where torch has CUDA)."""


def check_caller_autocast(verb: str) -> None:
    """A RuntimeError, naming ``autocast=`` as the fix, if ``verb`` was called under an enabled
    ``torch.autocast`` of the CPU or (where available) of CUDA; nothing was fed then."""
    for kind in AUTOCAST_DEVICE_TYPES:
        if kind == "cuda" and not torch.cuda.is_available():
            continue
        if torch.is_autocast_enabled(kind):
            raise RuntimeError(
                f"{verb} was called under torch.autocast (torch.is_autocast_enabled({kind!r}) is True); nothing "
                "was fed. An autocast around the caller's loop would reach some stages and not others, as the "
                "executor runs them: leave it out, and give the pipeline its dtype instead, e.g. "
                "Pipeline(..., autocast=torch.bfloat16), which runs every stage's forward and the loss under it"
            )

"""Models, losses and optimizers that fail on purpose, and checks for what a failure leaves behind.

Every sample is a pair ``(x, tag)``: ``tag`` (an int64 of shape (1,)) is the sample's index and
travels unchanged through every layer, so a ``Trip`` can fail exactly at one stage and sample.
Stage j's linear layer has ``4 + j`` inputs, which is how an optimizer factory knows its stage.
(Importable by stage processes, like ``models``.)
"""

import os
import time
from pathlib import Path

import torch
from torch import nn


class Tripped(RuntimeError):
    """The failure these helpers raise."""


class Tagged(nn.Module):
    """Applies ``module`` to ``x`` and passes the tag on."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, pair):
        x, tag = pair
        return self.module(x), tag


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sample):
        ctx.sample = sample
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Tripped(f"backward of sample {ctx.sample}")


class Trip(nn.Module):
    """Fails in the forward (or the backward) of sample ``sample`` when it is stage ``stage``; with
    ``phase="hang"`` its forward of that sample blocks for an hour."""

    def __init__(self, position, stage, sample, phase):
        super().__init__()
        self.position, self.stage, self.sample, self.phase = position, stage, sample, phase

    def forward(self, pair):
        x, tag = pair
        if self.position == self.stage and int(tag) == self.sample:
            if self.phase == "forward":
                raise Tripped(f"forward of sample {self.sample}")
            if self.phase == "hang":  # a forward that never returns (and asks nobody whether to stop)
                time.sleep(3600)
            if self.phase == "backward" and torch.is_grad_enabled():
                x = _FailBackward.apply(x, self.sample)
        return x, tag


def tripping_model(depth, stage=-1, sample=-1, phase="forward"):
    """``depth`` stages of two layers each: a linear layer (tagged) and a ``Trip``."""
    torch.manual_seed(0)
    layers = []
    for j in range(depth):
        layers += [Tagged(nn.Sequential(nn.Linear(4 + j, 5 + j), nn.Tanh())), Trip(j, stage, sample, phase)]
    return nn.Sequential(*layers)


class TripLoss:
    """A mean squared error that fails for sample ``sample`` (if given)."""

    def __init__(self, sample=-1):
        self.sample = sample

    def __call__(self, output, target):
        x, tag = output
        if int(tag) == self.sample:
            raise Tripped(f"loss of sample {self.sample}")
        return ((x - target) ** 2).mean()


class TripSGD(torch.optim.SGD):
    """SGD whose step fails at its ``fail_at``-th call (counting from 0): stage i steps once per sample."""

    def __init__(self, params, fail_at=None):
        super().__init__(params, lr=0.01)
        self.fail_at, self.steps = fail_at, 0

    def step(self, closure=None):
        if self.steps == self.fail_at:
            raise Tripped(f"step {self.steps}")
        self.steps += 1
        return super().step(closure)


class TripOptimizer:
    """An optimizer factory: stage ``stage``'s optimizer fails at the step of sample ``sample``."""

    def __init__(self, stage=-1, sample=-1):
        self.stage, self.sample = stage, sample

    def __call__(self, named):
        params = [p for _, p in named]
        position = params[0].shape[1] - 4  # stage j's linear layer has 4 + j inputs
        return TripSGD(params, self.sample if position == self.stage else None)


def tagged_stream(n, depth, seed=0):
    """``n`` samples ``(x, tag)`` and their targets for ``tripping_model(depth)``."""
    gen = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(2, 4, generator=gen), torch.tensor([s])) for s in range(n)]
    ys = [torch.randn(2, 4 + depth, generator=gen) for _ in range(n)]
    return xs, ys


def shm_names(pid="self"):
    """The /dev/shm files a process has mapped or open and that still have a name there."""
    names = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
            if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                names.add(path)
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return names
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("/dev/shm/") and not target.endswith("(deleted)"):
            names.add(target)
    return names


def still_there(names):
    """Which of ``names`` (paths under /dev/shm) still exist."""
    return {name for name in names if os.path.exists(name)}

"""Does a long stream leave memory behind? A soak test of the process executor (a benchmark).

``run_soak`` streams ``samples`` batches through a ``process`` pipeline of a small MLP, for
inference or for online learning, and records the resident memory (RSS) of the caller (which
runs the last stage) and of every stage process every ``every`` samples::

    samples: 0 ... warm-up ... | ............ the rest of the stream ............ |
    RSS:     grows while buffers, caches and       must stay flat: a leak of one
             allocator arenas fill                 activation per tick would show
                                                   as (activation size x samples)

Each process's summary gives its RSS at the end of the warm-up (``start_mb``), at the end
(``end_mb``), and the largest growth above the warm-up figure seen after it (``growth_mb``).
It returns data; printing and plotting are the CLI's job (``partime soak``).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import torch
from torch import nn

from partime import Pipeline

log = logging.getLogger(__name__)

MODES = ("inference", "learning")
MB = 2**20


def soak_model(width: int = 256, layers: int = 4, seed: int = 0) -> nn.Sequential:
    """``layers`` linear layers of ``width`` with ReLUs between them (the weights depend on ``seed`` only)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks.append(nn.Linear(width, width))
            if i < layers - 1:
                blocks.append(nn.ReLU())
        return nn.Sequential(*blocks)


def _samples(n: int, batch: int, width: int, learning: bool, seed: int) -> Iterator[tuple[torch.Tensor, Any]]:
    """``n`` fresh batches (and regression targets when learning), made as they are needed."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(batch, width, generator=gen)
        yield x, (torch.randn(batch, width, generator=gen) if learning else None)


def _rss(pids: dict[str, int]) -> dict[str, float]:
    """The resident memory of each named process, in MB (a process already gone is left out)."""
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss / MB
        except psutil.NoSuchProcess:
            pass
    return out


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-4)


def run_soak(
    mode: str,
    samples: int,
    *,
    depth: int = 2,
    width: int = 256,
    batch: int = 64,
    every: int | None = None,
    warmup: float = 0.2,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Stream ``samples`` batches of ``batch`` x ``width`` through a ``depth``-stage process pipeline.

    ``mode`` is ``"inference"`` or ``"learning"`` (mean squared error, SGD). Every ``every``
    samples (default: 200 records over the stream) the RSS of the caller and of each stage
    process is recorded. Returns ``mode``, ``samples``, ``depth``, ``sample_bytes``, ``warmup``
    (samples), ``records`` (``{"sample": k, "rss_mb": {process: MB}}``) and ``summary``
    (per process: ``start_mb`` after the warm-up, ``end_mb``, ``growth_mb``: the largest RSS
    seen after the warm-up minus ``start_mb``). ``progress`` is called with the samples done.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if samples < 10:
        raise ValueError(f"a soak needs at least 10 samples, got {samples}")
    learning = mode == "learning"
    every = every or max(1, samples // 200)
    warm = max(1, int(samples * warmup))
    kw: dict[str, Any] = dict(loss_fn=nn.MSELoss(), optimizer=_sgd) if learning else {}
    model = soak_model(width, layers=max(depth, 4), seed=seed)
    records: list[dict[str, Any]] = []
    pids = {"caller": os.getpid()}
    with Pipeline(model, depth, executor="process", threads=1, sample=torch.zeros(batch, width), **kw) as pipe:
        pairs = _samples(samples, batch, width, learning, seed)
        xs, ys = (x for x, _ in pairs), None
        if learning:  # the pipeline takes each target right after its sample: tee holds one pair
            pairs, pairs_too = itertools.tee(pairs)
            xs, ys = (x for x, _ in pairs), (y for _, y in pairs_too)
        for k, _ in enumerate(pipe.stream(xs, ys)):
            if k == 0:
                for proc in multiprocessing.active_children():
                    if proc.name.startswith("partime-stage-") and proc.pid is not None:  # started: it has one
                        pids[proc.name.removeprefix("partime-").replace("-", " ")] = proc.pid
            if k % every == 0 or k == samples - 1:
                records.append({"sample": k + 1, "rss_mb": _rss(pids)})
                if progress is not None:
                    progress(k + 1)
    return {
        "mode": mode,
        "samples": samples,
        "depth": depth,
        "sample_bytes": batch * width * 4,
        "warmup": warm,
        "records": records,
        "summary": summarise(records, warm),
    }


def summarise(records: list[dict[str, Any]], warmup: int) -> dict[str, dict[str, float]]:
    """Per process: RSS at the first record at or after ``warmup`` samples, at the end, and the most it grew."""
    summary = {}
    for name in records[0]["rss_mb"]:
        after = [r["rss_mb"][name] for r in records if r["sample"] >= warmup and name in r["rss_mb"]]
        if not after:
            continue
        summary[name] = {"start_mb": after[0], "end_mb": after[-1], "growth_mb": max(after) - after[0]}
    return summary


def plot(runs: list[dict[str, Any]], path: Any) -> None:
    """RSS per process over the stream, one panel per run, saved to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        for name in run["summary"]:
            points = [(r["sample"], r["rss_mb"][name]) for r in run["records"] if name in r["rss_mb"]]
            ax.plot([p[0] for p in points], [p[1] for p in points], label=name)
        ax.axvline(run["warmup"], color="grey", linestyle=":", label="end of warm-up")
        ax.set_title(f"{run['mode']}: {run['samples']:,} samples, D = {run['depth']}")
        ax.set_xlabel("samples streamed")
        ax.set_ylabel("resident memory (MB)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

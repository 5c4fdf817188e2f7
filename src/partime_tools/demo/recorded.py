"""The main job end to end: a generated video through a two-stage pipeline (``partime demo``).

1. Streaming inference: ``conv_net()`` cut in two, one process per stage, on a video of a bright
   blob moving smoothly; every output equals the plain model's, and it comes out faster.
2. Online learning on moving digits (``streams.moving_digits``: scikit-learn's handwritten
   digits drifting, turning and scaling smoothly), accuracy against seconds: the same samples
   learnt by the plain loop on one thread, by the plain loop on every core, and by a pipeline of
   two stage processes with the library's defaults, one thread each, all with the same SGD step
   (``partime_tools.demo.learning``): samples learnt and rolling accuracy (test-then-train) at a
   few moments, samples per second, the pipeline's speed-up, and each trained model's accuracy on
   held-out digits.
3. A live source: the blob video written to an H.264 file (``partime.sources.write_video``), then
   played by ``at_rate(video_frames(path), fps)`` faster than the plain model can keep up with,
   for the plain model and for the two-stage pipeline, each leaving out the frames it cannot take
   (``when_behind="drop"``): frames kept per second, frames dropped, latency; a picture of a few
   frames and the pipeline's outputs is saved.

Everything is generated here (nothing is downloaded) and runs in under two minutes on two cores
when nothing else runs on them. ``run_demo`` returns its figures; it shows its progress and
results on ``console``.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from torch import Tensor

from partime import Pipeline

from ..bench.models import conv_net
from ..bench.runner import cpu_clocks, median_ms, others_busy
from .learning import learning_table, race
from .live import LIVE_PACE, play_live

DEPTH = 2
WARMUP = 20  # results left out of the timing


def blob_video(n: int, size: int = 32, *, seed: int = 0, smooth: bool = True) -> tuple[Tensor, Tensor]:
    """``n`` frames (each ``1 x 3 x size x size``) of a bright orange blob on a noisy dark field,
    and for each the quadrant its centre is in (``1``-element int64: 0 top-left, 1 top-right,
    2 bottom-left, 3 bottom-right).

    With ``smooth`` the blob glides along a Lissajous curve that visits every quadrant (a few
    hundred frames per lap); otherwise each frame puts it anywhere, independently.
    """
    gen = torch.Generator().manual_seed(seed)
    reach = size / 2 - 5
    if smooth:
        t = torch.arange(n, dtype=torch.float32)
        cx = size / 2 + reach * torch.sin(2 * math.pi * t / 157)
        cy = size / 2 + reach * torch.sin(2 * math.pi * t / 233 + 1.0)
    else:
        cx = size / 2 + reach * (2 * torch.rand(n, generator=gen) - 1)
        cy = size / 2 + reach * (2 * torch.rand(n, generator=gen) - 1)
    grid = torch.arange(size, dtype=torch.float32) + 0.5
    dist2 = (grid.view(1, 1, size) - cx.view(n, 1, 1)) ** 2 + (grid.view(1, size, 1) - cy.view(n, 1, 1)) ** 2
    blob = torch.exp(-dist2 / (2 * 3.0**2)).unsqueeze(1) * torch.tensor([1.0, 0.6, 0.2]).view(1, 3, 1, 1)
    frames = blob + 0.05 * torch.randn(n, 3, size, size, generator=gen)
    quadrant = (cx >= size / 2).long() + 2 * (cy >= size / 2).long()
    return frames.unsqueeze(1), quadrant.view(n, 1)


def run_demo(
    console: Console | None = None,
    *,
    samples: int = 300,
    learn_samples: int = 4000,
    heldout: int = 200,
    live_frames: int = 600,
    live_png: str | Path = "partime-demo-live.png",
    layers: int = 12,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the three parts; return their figures (the inference's speed-up and ``outputs_match``,
    the online learning's ``learning_*`` figures (``learning.race``), the live runs' ``live_*``
    figures, ``wall_s``).

    ``samples`` frames are inferred; ``learn_samples`` samples of moving digits are learnt from
    online by each learner, which is then scored on ``heldout`` samples of held-out digits;
    ``live_frames`` frames are played as a live source, and the picture is written to ``live_png``.
    Torch uses one thread in this process meanwhile, as each stage process does, except the plain
    loop that learns on every core (the threads torch had when ``run_demo`` was called).
    """
    console = console or Console(quiet=True)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # A slow refresh: the display shares the two cores with the stages it reports on.
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            refresh_per_second=2,
        ) as bar:
            # other processes on the machine skew the timings: the figures say how much ran
            clocks = cpu_clocks()
            figures = _inference(bar, samples, layers, seed)
            figures["inference_others_busy"] = others_busy(clocks)
            clocks = cpu_clocks()
            figures |= race(bar, learn_samples, heldout, seed, threads)
            figures["learning_others_busy"] = others_busy(clocks)
            clocks = cpu_clocks()
            frames, _ = blob_video(live_frames, seed=seed)
            figures |= play_live(bar, frames, conv_net(layers, seed=seed), Path(live_png))
            figures["live_others_busy"] = others_busy(clocks)
    finally:
        torch.set_num_threads(threads)
    figures["wall_s"] = time.perf_counter() - start
    console.print(learning_table(figures))
    console.print(_summary(figures))
    return figures


def _inference(bar: Progress, n: int, layers: int, seed: int) -> dict[str, Any]:
    model = conv_net(layers, seed=seed)
    xs, _ = blob_video(n + WARMUP, seed=seed)
    task = bar.add_task("inference, sequential", total=len(xs))
    expected, stamps = [], []
    with torch.no_grad():
        for x in xs:
            expected.append(model(x))
            stamps.append(time.perf_counter())
            bar.advance(task)
    sequential = median_ms(stamps, WARMUP, 5)

    task = bar.add_task(f"inference, pipeline D={DEPTH}", total=len(xs))
    match, stamps = True, []
    with Pipeline(copy.deepcopy(model), DEPTH, executor="process", sample=xs[0], threads=1) as pipe:
        for result in pipe.stream(iter(xs)):
            stamps.append(time.perf_counter())
            output = cast(Tensor, result.output)  # never skipped (nonfinite="raise"): the model's output
            match = match and torch.equal(output, expected[result.index])
            bar.advance(task)
    pipelined = median_ms(stamps[: -DEPTH - 1], WARMUP, 5)  # the last results come out of a flush
    return dict(
        outputs_match=match,
        inference_samples=n,
        inference_partition=str(pipe.partition),
        inference_ms_sequential=sequential,
        inference_ms_pipeline=pipelined,
        inference_speedup=sequential / pipelined,
    )


def _summary(f: dict[str, Any]) -> Table:
    table = Table(
        title=f"partime demo: a generated video through {DEPTH} stages ({f['wall_s']:.0f} s)", show_header=False
    )
    table.add_column(style="bold")
    table.add_column()
    table.add_row("inference", f"{f['inference_samples']} frames, {f['inference_partition']}")
    table.add_row("  outputs equal the plain model's", "yes" if f["outputs_match"] else "NO")
    table.add_row(
        "  ms per frame",
        f"{f['inference_ms_sequential']:.2f} sequential, "
        f"{f['inference_ms_pipeline']:.2f} pipelined: {f['inference_speedup']:.2f}x"
        + _skewed(f["inference_others_busy"]),
    )
    table.add_row(
        "online learning",
        f"{f['learn_samples']} samples of moving digits: the pipeline learnt {f['learning_speedup']:.2f}x as "
        f"many a second as the plain loop on 1 thread, {f['learning_speedup_allcores']:.2f}x as many as on "
        f"{f['learning_threads']}; held-out accuracy {f['learning_pipeline_heldout']:.2f} "
        f"(plain loop: {f['learning_plain_1thread_heldout']:.2f})" + _skewed(f["learning_others_busy"]),
    )
    table.add_row(
        "live source",
        f"the blob video, {f['live_frames']} frames in H.264, played at {f['live_fps']:.0f} fps: "
        f"{LIVE_PACE:g}x the {1e3 / f['live_sustained_ms']:.0f} fps the plain model sustains on it "
        f"({f['live_sustained_ms']:.2f} ms per frame, decoding included), more than it can keep up with"
        + _skewed(f["live_others_busy"]),
    )
    for name, key in (("  plain model", "live_plain"), (f"  pipeline D={DEPTH}", "live_pipeline")):
        table.add_row(
            name,
            f"{f[key + '_fps_kept']:.0f} fps kept, {f[key + '_dropped']} frames dropped; latency "
            f"p50 {f[key + '_p50_ms']:.1f} ms, p99 {f[key + '_p99_ms']:.1f} ms",
        )
    table.add_row("  frames and outputs", f"written to {f['live_png']}")
    return table


def _skewed(busy: float | None) -> str:
    if busy is None or busy <= 0.1:
        return ""
    return f" [yellow](skewed: other processes kept {busy:.0%} of the CPUs busy meanwhile)"

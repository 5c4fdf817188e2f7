"""The demo's live source (``partime demo``, its third part): a video played faster than the plain
model can keep up with.

The frames are written to an H.264 file (``partime.sources.write_video``), then played by
``at_rate(video_frames(path), fps)`` at ``LIVE_PACE`` times the rate the plain model sustains on
them (decoding included), for the plain model (``partime.internals.newest``) and for the pipeline of
``DEPTH`` stages (``when_behind="drop"``), each leaving out the frames it cannot take: frames kept
per second, frames dropped, latency; a picture of a few frames and the pipeline's outputs is saved.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from rich.progress import Progress
from torch import Tensor, nn

from partime import Pipeline
from partime.internals import newest
from partime.sources import at_rate, video_frames, write_video

from ..bench.latency import PERCENTILES, percentile
from ..bench.runner import median_ms

DEPTH = 2
WARMUP = 20  # frames left out of the timing, and the pipeline's warm-up
LIVE_PACE = 1.4  # the live source's rate, in multiples of the rate the plain model sustains
PACE_FRAMES = 60  # frames the plain model is timed on to choose that rate (WARMUP left out)
STRIP = 5  # frames in the picture of the live run


def play_live(bar: Progress, frames: Tensor, model: nn.Module, png: Path) -> dict[str, Any]:
    """Write ``frames`` (``n x 1 x 3 x H x W``) to an H.264 file, play it as a live source for the
    plain ``model`` and for the pipeline of ``DEPTH`` stages (see the module docstring), and save
    the picture to ``png``; the figures, each named ``live_...``."""
    n = len(frames)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "blob.mp4"
        write_video(path, frames)
        sustained_ms = _sustained_ms(model, path)
        fps = LIVE_PACE * 1e3 / sustained_ms  # more than the plain model can take, not twice as much
        plain = _play_plain(bar, model, path, fps, n)
        piped, outputs = _play_pipeline(bar, model, path, fps, n)
        shown = {k: frame for k, frame in enumerate(video_frames(path)) if k in outputs}
    _save_strip(png, shown, outputs)
    return dict(
        live_frames=n,
        live_fps=fps,
        live_sustained_ms=sustained_ms,
        live_png=str(png.resolve()),
        **{f"live_plain_{key}": value for key, value in plain.items()},
        **{f"live_pipeline_{key}": value for key, value in piped.items()},
    )


def _decoded(path: Path, limit: int | None = None) -> Iterator[Tensor]:
    """The video's frames as the model takes them (a batch of one), the first ``limit`` of them."""
    for k, frame in enumerate(video_frames(path)):
        if k == limit:
            return
        yield frame.unsqueeze(0)


def _sustained_ms(model: nn.Module, path: Path) -> float:
    """Milliseconds per frame of a plain loop over the video, decoding included (as in a live run)."""
    stamps = []
    with torch.no_grad():
        for x in _decoded(path, WARMUP + PACE_FRAMES + 1):
            model(x)
            stamps.append(time.perf_counter())
    return median_ms(stamps, min(WARMUP, len(stamps) // 2), 5)


def _play_plain(bar: Progress, model: nn.Module, path: Path, fps: float, n: int) -> dict[str, float]:
    """The plain model on the video played at ``fps``: each time the newest frame that arrived, the
    others dropped (``partime.internals.newest``, as ``when_behind="drop"`` reads it)."""
    task = bar.add_task("live source, plain model", total=n)
    source = at_rate(_decoded(path), fps)
    latencies, dropped = [], 0
    with torch.no_grad():
        for x, arrived, replaced in newest(source):
            model(x)
            latencies.append(source.clock.now() - arrived)
            dropped += replaced
            bar.advance(task, 1 + replaced)
    return _kept(latencies, dropped, n / fps)


def _play_pipeline(
    bar: Progress, model: nn.Module, path: Path, fps: float, n: int
) -> tuple[dict[str, float], dict[int, tuple[Tensor, float]]]:
    """The pipeline on the video played at ``fps`` (``when_behind="drop"``); with the outputs and
    latencies of ``STRIP`` frames spread over the video, by their position in it."""
    task = bar.add_task(f"live source, pipeline D={DEPTH}", total=n)
    wanted = [n * (2 * k + 1) // (2 * STRIP) for k in range(STRIP)]
    latencies, dropped = [], 0
    outputs: dict[int, tuple[Tensor, float]] = {}
    warmup = list(_decoded(path, WARMUP))
    with Pipeline(copy.deepcopy(model), DEPTH, executor="process", sample=warmup[0], threads=1) as pipe:
        for _ in pipe.stream(warmup):  # the workers start at the first sample: before the source does
            pass
        offset, source = pipe.fed, at_rate(_decoded(path), fps)
        for result in pipe.stream(source, when_behind="drop"):
            bar.advance(task)
            if result.dropped:
                dropped += 1
                continue
            latencies.append(result.latency)
            position = result.index - offset
            if len(outputs) < STRIP and position >= wanted[len(outputs)]:
                outputs[position] = cast(Tensor, result.output), result.latency
    return _kept(latencies, dropped, n / fps), outputs


def _kept(latencies: list[float], dropped: int, span: float) -> dict[str, float]:
    """Frames kept per second of ``span`` (the video's playing time), frames dropped, and the
    median and 99th percentile (nearest rank) of the kept frames' latencies, in ms."""
    return dict(
        fps_kept=len(latencies) / span,
        dropped=dropped,
        **{f"p{p}_ms": percentile(latencies, p) * 1e3 for p in PERCENTILES},
    )


def _save_strip(png: Path, frames: dict[int, Tensor], outputs: dict[int, tuple[Tensor, float]]) -> None:
    """A picture: the frames above, the pipeline's output for each below (its channels' mean) with
    its latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(outputs), figsize=(2 * len(outputs), 4.8), squeeze=False)
    for column, (k, (output, latency)) in enumerate(sorted(outputs.items())):
        top, bottom = axes[0][column], axes[1][column]
        top.imshow(frames[k].permute(1, 2, 0).clamp(0, 1).numpy())
        top.set_title(f"frame {k}", fontsize=9)
        bottom.imshow(output[0].mean(0).numpy(), cmap="magma")
        bottom.set_title(f"output, {latency * 1e3:.0f} ms later", fontsize=9)
        for ax in (top, bottom):
            ax.set_axis_off()
    fig.suptitle(f"the live run through {DEPTH} stages: frames and outputs (mean of the channels)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)

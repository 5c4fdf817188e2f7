"""The ``partime`` command: ``bench``, ``fidelity``, ``soak`` and ``demo`` (the only place that prints)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import click
from rich.progress import TaskID
from rich.table import Table

from .bench_cli import bench, whole_numbers
from .report import progress_bar, wide_console


@click.group()
def main() -> None:
    """partime: a deep network that keeps up with a stream, D stages working at once."""


main.add_command(bench)


def _names(value: str, choices: tuple[str, ...], option: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in choices]
    if unknown or not names:
        raise click.BadParameter(f"choose from {', '.join(choices)}; got {value!r}", param_hint=option)
    return names


@main.command()
@click.option(
    "--frames",
    type=click.IntRange(min=10),
    default=3000,
    show_default=True,
    help="Samples per run (each a batch of 4 frames).",
)
@click.option("--seeds", type=click.IntRange(min=1), default=2, show_default=True, help="Seeds per configuration.")
@click.option(
    "--depths", default="2,4,8", show_default=True, callback=whole_numbers("depths", "2,4,8"), help="Pipeline depths D."
)
@click.option(
    "--streams",
    "stream_names",
    default="digits,shuffled,camera",
    show_default=True,
    help="Streams, comma-separated: digits, shuffled, camera.",
)
@click.option(
    "--optimizer",
    "optimizer_names",
    default="sgd,momentum,adam",
    show_default=True,
    help="Optimizers, comma-separated: sgd, momentum (0.9), adam. Each learns at the step size of its "
    "grid that suits sequential learning of each stream best (seed 0).",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=os.cpu_count() or 1,
    show_default=True,
    help="Runs at once (each on one core).",
)
@click.option(
    "--cut",
    "how",
    type=click.Choice(["planned", "even"]),
    default="planned",
    show_default=True,
    help="planned: as a learning Pipeline(balance=D) cuts the model; even: as many layers in each stage.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("fidelity"),
    show_default=True,
    help="Where to write fidelity.json, fidelity.md and fidelity.png.",
)
def fidelity(
    frames: int,
    seeds: int,
    depths: tuple[int, ...],
    stream_names: str,
    optimizer_names: str,
    jobs: int,
    how: str,
    out_dir: Path,
) -> None:
    """Measure what learning with delay costs: sequential against D-stage pipelines, test-then-train."""
    from . import fidelity as fid

    names = _names(stream_names, fid.STREAMS, "--streams")
    optimizers = _names(optimizer_names, fid.OPTIMIZERS, "--optimizer")
    console = wide_console()
    with progress_bar(console) as bar:

        def report(task: TaskID) -> Callable[[dict], None]:
            return lambda row: bar.update(
                task,
                advance=1,
                description=(f"{row['optimizer']} lr {row['lr']:g}: {row['stream']} {row['label']} seed {row['seed']}"),
            )

        tuning = fid.tuning_configs(names, optimizers)
        tuned = fid.run_all(tuning, frames, jobs=jobs, progress=report(bar.add_task("step sizes", total=len(tuning))))
        configs = fid.configs(names, depths, seeds, how, fid.best_step_sizes(tuned))
        rows = fid.run_all(configs, frames, jobs=jobs, progress=report(bar.add_task("learning", total=len(configs))))
    paths = fid.write(rows, out_dir, tuning=tuned)
    console.print(paths["markdown"].read_text())
    console.print(
        f"{len(tuned)} + {len(rows)} runs of {frames} samples; written: " + ", ".join(str(p) for p in paths.values())
    )


@main.command()
@click.option(
    "--inference-samples",
    type=click.IntRange(min=10),
    default=100_000,
    show_default=True,
    help="Samples streamed for inference.",
)
@click.option(
    "--learning-samples",
    type=click.IntRange(min=10),
    default=20_000,
    show_default=True,
    help="Samples streamed for online learning.",
)
@click.option("--depth", type=click.IntRange(min=1, max=4), default=2, show_default=True, help="Pipeline depth D.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("soak"),
    show_default=True,
    help="Where to write soak.json and soak.png.",
)
def soak(inference_samples: int, learning_samples: int, depth: int, out_dir: Path) -> None:
    """Stream a long stream and record every process's resident memory: it must stay flat."""
    from .soak import plot, run_soak

    console = wide_console()
    runs = []
    with progress_bar(console) as bar:

        def report(task: TaskID) -> Callable[[int], None]:
            return lambda done: bar.update(task, completed=done)

        for mode, samples in (("inference", inference_samples), ("learning", learning_samples)):
            runs.append(run_soak(mode, samples, depth=depth, progress=report(bar.add_task(mode, total=samples))))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps(runs, indent=1) + "\n")
    plot(runs, out_dir / "soak.png")
    table = Table(title=f"partime soak: resident memory after the warm-up (D = {depth}, process executor)")
    for name in ("mode", "samples", "process", "start MB", "end MB", "max growth MB"):
        table.add_column(name, justify="left" if name in ("mode", "process") else "right")
    for run in runs:
        for process, row in run["summary"].items():
            table.add_row(
                run["mode"],
                f"{run['samples']:,}",
                process,
                f"{row['start_mb']:.1f}",
                f"{row['end_mb']:.1f}",
                f"{row['growth_mb']:.1f}",
            )
    console.print(table)
    console.print(
        f"samples of {runs[0]['sample_bytes'] // 1024} KB; warm-up: the first 20% of each stream; "
        f"written: {out_dir / 'soak.json'}, {out_dir / 'soak.png'}"
    )


@main.command()
def demo() -> None:
    """Stream a generated video through a 2-stage pipeline: inference, online learning, and the video
    played as a live source faster than the plain model keeps up with."""
    from .demo import run_demo

    run_demo(wide_console())


if __name__ == "__main__":
    main()

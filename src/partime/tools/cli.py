"""The ``partime`` command: ``bench``, ``fidelity``, ``soak`` and ``demo`` (the only place that prints)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from ..executors import EXECUTORS

DISTRIBUTED_LAYERS = 16
"""The distributed bench's default number of blocks: at D = 2, stages of about 4.4 ms on the README's 2-core VM
(the distributed executor's sends between ranks pay off for stages of 4 ms or more)."""


def _depths(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        depths = tuple(int(d) for d in value.split(",") if d.strip())
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of whole numbers, e.g. 1,2,3,4; got {value!r}") from None
    if not depths or min(depths) < 1:
        raise click.BadParameter(f"give one or more depths of at least 1, got {value!r}")
    return depths


def _console() -> Console:
    """The console to print on; wide enough for the tables when the output is not a terminal."""
    console = Console()
    return console if console.is_terminal else Console(width=170)


def progress_bar(console: Console) -> Progress:
    """The progress display every command shows while it runs."""
    # A slow refresh: the display shares the cores with the stages it reports on.
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        refresh_per_second=2,
    )


@click.group()
def main() -> None:
    """partime: a deep network that keeps up with a stream, D stages working at once."""


@main.command()
@click.option(
    "--executor",
    type=click.Choice(EXECUTORS),
    default="process",
    show_default=True,
    help="How the pipeline's stages run.",
)
@click.option(
    "--samples",
    type=click.IntRange(min=5),
    default=300,
    show_default=True,
    help="Samples timed per configuration (after a warm-up of 20).",
)
@click.option(
    "--depths",
    default="1,2,3,4",
    show_default=True,
    callback=_depths,
    help="Pipeline depths D to time, comma-separated.",
)
@click.option("--size", type=click.IntRange(min=1), default=32, show_default=True, help="Frame height and width.")
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=None,
    help="Convolution blocks after the stem.  [default: 12; 16 with the distributed executor, for "
    "stages of about 4 ms at D = 2, the size at which its sends between ranks pay off]",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the rows to this JSON file.",
)
def bench(
    executor: str, samples: int, depths: tuple[int, ...], size: int, layers: int | None, json_path: Path | None
) -> None:
    """Time streaming inference and online learning, sequential against pipelined."""
    from .bench import MODES, run_bench

    if layers is None:
        layers = DISTRIBUTED_LAYERS if executor == "distributed" else 12

    if max(depths) > layers + 1:
        raise click.BadParameter(
            f"the model has {layers + 1} layers: depths go up to {layers + 1}, got {max(depths)}", param_hint="--depths"
        )
    if executor == "distributed":
        return _bench_distributed(samples, size, layers, json_path)
    console = _console()
    with progress_bar(console) as bar:
        baselines = len({1, os.cpu_count() or 1})  # sequential with one thread and with every core
        task = bar.add_task("starting", total=1 + len(MODES) * (baselines + len(depths)))
        started = [False]

        def report(label: str) -> None:
            if started[0]:
                bar.advance(task)
            started[0] = True
            bar.update(task, description=label)

        rows = run_bench(executor=executor, samples=samples, depths=depths, size=size, layers=layers, progress=report)
    _print_bench(_console(), rows, size, layers, samples, json_path)


def _bench_distributed(samples: int, size: int, layers: int, json_path: Path | None) -> None:
    """``partime bench --executor distributed``, run by every rank under torchrun (D = world size)."""
    from .bench_distributed import bench_distributed

    rows = bench_distributed(samples, size, layers)
    if rows is not None:  # rank 0; the other ranks served their stages
        _print_bench(_console(), rows, size, layers, samples, json_path)


def _print_bench(
    console: Console, rows: list[dict], size: int, layers: int, samples: int, json_path: Path | None
) -> None:
    console.print(bench_table(rows))
    first = rows[0]
    console.print(
        f"hop cost (median, one put + get between processes): 64 KB {first['hop_64kb_us']:.1f} µs, "
        f"one activation ({first['activation_bytes'] // 1024} KB) {first['hop_activation_us']:.1f} µs"
        + (
            ""
            if first.get("hop_64kb_raw_us") is None
            else f"; 64 KB by a bare gloo send/recv {first['hop_64kb_raw_us']:.1f} µs"
        )
        + ("" if first.get("hop_others_busy") is None else f" (others {first['hop_others_busy']:.0%})")
    )
    console.print(
        f"{os.cpu_count()} cores; batch-1 frames 3x{size}x{size}; a stem and {layers} blocks of 5x5 conv "
        f"(32 channels) + ReLU; median over 5 blocks of {samples} samples"
    )
    busy = max([first.get("hop_others_busy") or 0.0] + [row["others_busy"] or 0.0 for row in rows])
    if busy > 0.1:
        console.print(
            f"[yellow]other processes kept up to {busy:.0%} of the CPUs busy (column 'others'): "
            "the rows where they did are skewed; run the bench again on a quiet machine"
        )
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")
        console.print(f"rows written to {json_path}")


def bench_table(rows: list[dict]) -> Table:
    """The rows of ``run_bench`` as a table."""
    table = Table(title="partime bench: median time per sample")
    for name in ("mode", "run", "ms/sample", "× seq 1 thr", "× seq all cores", "max stage ms", "others", "partition"):
        table.add_column(
            name, justify="left" if name in ("mode", "run", "partition") else "right", no_wrap=name != "partition"
        )
    for row in rows:
        run = row["executor"] if row["depth"] == 0 else f"D={row['depth']} {row['executor']}"
        stage = f"{row['max_stage_ms']:.2f}" if row.get("max_stage_ms") is not None else ""
        others = "?" if row["others_busy"] is None else f"{row['others_busy']:.0%}"
        table.add_row(
            row["mode"],
            run,
            f"{row['ms_per_sample']:.2f}",
            f"{row['speedup_vs_seq_1thread']:.2f}",
            f"{row['speedup_vs_seq_allcores']:.2f}",
            stage,
            others,
            row.get("partition", ""),
        )
    return table


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
@click.option("--depths", default="2,4,8", show_default=True, callback=_depths, help="Pipeline depths D.")
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
    console = _console()
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

    console = _console()
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
    """Stream a generated video through a 2-stage pipeline: inference, then online learning."""
    from .demo import run_demo

    run_demo(_console())


if __name__ == "__main__":
    main()

"""The ``partime`` command: ``bench``, ``fidelity``, ``soak`` and ``demo`` (the only place that prints)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import click
from rich.progress import TaskID
from rich.table import Table

from .bench.cli import bench, whole_numbers
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
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Seeds reported per configuration (with --own-step: seeds 1 to N; seed 0 chooses the step sizes).",
)
@click.option(
    "--depths",
    default="2,4,8",
    show_default=True,
    callback=whole_numbers("depths", "2,4,8"),
    help="Pipeline depths D (with --live: a pipeline contends at each, beside the one plain loop).",
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
    help="Optimizers, comma-separated: sgd, momentum (0.9), adam, nadam (NAdam with β1 = 0.99 and decoupled "
    "weight decay), muon (Muon for the matrices, AdamW for the rest: partime.optim.MuonWithAdamW). Each learns "
    "at the step size of its grid that suits sequential learning of each stream best (seed 0).",
)
@click.option(
    "--configs",
    "config_names",
    default=None,
    help="Configurations run beside sequential, comma-separated (default: all): a grad mode (stash), a grad "
    "mode and its compensation joined by + (stash+delay-correction), or default (what a Pipeline learns with "
    "when nothing is chosen).",
)
@click.option(
    "--own-step",
    is_flag=True,
    help="Each configuration, and sequential, learns at its own best step size of its optimizer's grid "
    "(one step smaller and one larger added), chosen on seed 0; the gaps are to sequential at its own best step.",
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
    type=click.Choice(["fixed", "planned", "even"]),
    default="fixed",
    show_default=True,
    help="fixed: the cuts a learning Pipeline(balance=D) chose on the development machine, for D = 2, 4 "
    "and 8, so that the figures do not depend on this machine's timings; planned: as a learning "
    "Pipeline(balance=D) cuts the model here; even: as many layers in each stage.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("fidelity"),
    show_default=True,
    help="Where to write fidelity.json, fidelity.md and fidelity.png.",
)
@click.option(
    "--live",
    is_flag=True,
    help="The live view instead: a stream arriving faster than the plain loop learns, the plain loop (which "
    "drops more) against a pipeline with its defaults (which learns with delay) at each of --depths, each at its "
    "own best step size (seed 0); writes live.json, live.md and live.png. --cut does not apply: a pipeline is cut "
    "as the measured one planned, or with --times at fidelity's fixed cuts (D = 2, 4, 8).",
)
@click.option(
    "--rates",
    default="1.5,2",
    show_default=True,
    help="With --live: the stream's rates, comma-separated multiples of the plain loop's learning rate.",
)
@click.option(
    "--times",
    default=None,
    help="With --live: milliseconds per learning sample for every stream and optimizer, as plain_ms,pipeline_ms "
    "(the pipeline's at every depth) or plain_ms,pipeline_ms_D1,pipeline_ms_D2,... (one per depth, in the order of "
    "--depths); or an earlier live.json to take its times and cuts from (a time row without a depth reads as "
    "D = 2) (default: measured first, on this machine: the plain loop once, a process pipeline at each depth).",
)
@click.option(
    "--check-real",
    "real",
    is_flag=True,
    help="With --live: then play the first stream, optimizer and rate on the real clock to the plain loop and "
    "the pipeline at each depth, and count what each kept beside the schedule's prediction.",
)
def fidelity(
    frames: int,
    seeds: int,
    depths: tuple[int, ...],
    stream_names: str,
    optimizer_names: str,
    config_names: str | None,
    own_step: bool,
    jobs: int,
    how: str,
    out_dir: Path,
    live: bool,
    rates: str,
    times: str | None,
    real: bool,
) -> None:
    """Measure what learning with delay costs: sequential against D-stage pipelines, test-then-train."""
    from .fidelity import runs as fid

    names = _names(stream_names, fid.STREAMS, "--streams")
    optimizers = _names(optimizer_names, fid.OPTIMIZERS, "--optimizer")
    if live:
        from .fidelity.live_cli import live_view

        live_view(
            frames=frames,
            seeds=seeds,
            stream_names=names,
            optimizers=optimizers,
            depths=depths,
            rates=rates,
            times=times,
            real=real,
            jobs=jobs,
            out_dir=out_dir,
        )
        return
    only = None if config_names is None else _names(config_names, fid.choices(optimizers), "--configs")
    console = wide_console()
    with progress_bar(console) as bar:

        def report(task: TaskID) -> Callable[[dict], None]:
            return lambda row: bar.update(
                task,
                advance=1,
                description=(f"{row['optimizer']} lr {row['lr']:g}: {row['stream']} {row['label']} seed {row['seed']}"),
            )

        if own_step:
            tuning = fid.own_step_tuning(names, depths, optimizers, how, only)
        else:
            tuning = fid.tuning_configs(names, optimizers)
        tuned = fid.run_all(tuning, frames, jobs=jobs, progress=report(bar.add_task("step sizes", total=len(tuning))))
        if own_step:
            configs = fid.at_own_steps(tuning, fid.own_best_steps(tuned), seeds)
        else:
            configs = fid.configs(names, depths, seeds, how, fid.best_step_sizes(tuned), only)
        rows = fid.run_all(configs, frames, jobs=jobs, progress=report(bar.add_task("learning", total=len(configs))))
    paths = fid.write(rows, out_dir, tuning=tuned, own_step=own_step)
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
    """Stream a generated video through a 2-stage pipeline, learn moving digits online, and play the
    video as a live source faster than the plain model keeps up with.

    The online learning gives accuracy against seconds: the same digits learnt by the plain loop
    (on one thread and on every core) and by a 2-stage pipeline with its defaults, one thread a
    stage, all with the same SGD step; samples per second, the pipeline's speed-up, and each
    trained model's accuracy on held-out digits."""
    from .demo.recorded import run_demo

    run_demo(wide_console())


if __name__ == "__main__":
    main()

"""The ``partime bench`` command (a part of the CLI, which prints): one frame size, or a sweep of sizes.

Without ``--sizes`` it runs ``bench.run_bench`` (or, with the distributed executor under torchrun,
``bench_distributed``); with ``--sizes``, ``bench_sweep.run_sweep``; with ``--rate``,
``bench_rate.run_rate``. The last two draw their figure with ``--plot``. Each learns with the
optimizer ``--optimizer`` names (the sweep: with each it names, in turn).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import click
from rich.progress import Progress, TaskID

from partime import EXECUTORS, GRAD_MODES
from partime.internals import DEFAULT_GRAD_MODE

from ..report import print_bench, print_rate, print_sweep, progress_bar, wide_console
from .models import MODELS
from .runner import OPTIMIZERS
from .sweep import SIZES as SWEEP_SIZES

DISTRIBUTED_LAYERS = 16
"""The distributed bench's default number of blocks: stages at D = 2 long enough for the distributed
executor's sends between ranks to pay off (measured: experiments/measured-and-not-kept.md)."""


def whole_numbers(
    what: str, example: str
) -> Callable[[click.Context, click.Parameter, str | None], tuple[int, ...] | None]:
    """An option's callback: a comma-separated list of ``what`` (whole numbers of at least 1), or None."""

    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        try:
            numbers = tuple(int(n) for n in value.split(",") if n.strip())
        except ValueError:
            raise click.BadParameter(
                f"a comma-separated list of whole numbers, e.g. {example}; got {value!r}"
            ) from None
        if not numbers or min(numbers) < 1:
            raise click.BadParameter(f"give one or more {what} of at least 1, got {value!r}")
        return numbers

    return parse


def optimizer_names(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    """The ``--optimizer`` callback: a comma-separated list of distinct names of ``bench.OPTIMIZERS``, or None."""
    if value is None:
        return None
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown or not names or len(set(names)) < len(names):
        raise click.BadParameter(
            f"one or more distinct names of {', '.join(OPTIMIZERS)}, comma-separated (sgd,adam); got {value!r}"
        )
    return names


RATE_SEARCH = "max"
"""The ``--rate`` that searches each contender's highest rate without a drop (``--rate`` alone gives it)."""


def frame_rate(ctx: click.Context, param: click.Parameter, value: str | None) -> float | str | None:
    """The ``--rate`` callback: a number of frames per second above 0, ``RATE_SEARCH``, or None."""
    if value is None or value.strip().lower() == RATE_SEARCH:
        return None if value is None else RATE_SEARCH
    try:
        fps = float(value)
    except ValueError:
        fps = math.nan
    if not (math.isfinite(fps) and fps > 0):
        raise click.BadParameter(f"frames per second (a number above 0, e.g. 120) or {RATE_SEARCH}; got {value!r}")
    return fps


def _advancing(bar: Progress, task: TaskID) -> Callable[[str], None]:
    """A progress callback that moves ``task`` on by one as each new label begins."""
    started = [False]

    def report(label: str) -> None:
        if started[0]:
            bar.advance(task)
        started[0] = True
        bar.update(task, description=label)

    return report


@click.command()
@click.option(
    "--executor",
    type=click.Choice(EXECUTORS),
    default=None,
    help="How the pipeline's stages run.  [default: process; with --sizes, process and thread]",
)
@click.option(
    "--samples",
    type=click.IntRange(min=5),
    default=300,
    show_default=True,
    help="Samples timed per configuration (after a warm-up of 20); with --rate, frames timed per run.",
)
@click.option(
    "--depths",
    default=None,
    callback=whole_numbers("depths", "1,2,3,4"),
    help="Pipeline depths D to time, comma-separated.  [default: 1,2,3,4; 2 with --sizes or --rate]",
)
@click.option("--size", type=click.IntRange(min=1), default=None, help="Frame height and width.  [default: 32]")
@click.option(
    "--sizes",
    is_flag=False,
    flag_value=",".join(str(s) for s in SWEEP_SIZES),
    default=None,
    callback=whole_numbers("frame sizes", "12,24,48,72,96"),
    help="Sweep these frame sizes (comma-separated) on a stem and 8 blocks (--layers) of 3x3 convolution (24 channels) + "
    "ReLU: sequential with 1 thread and every core, D replicas, each pipeline executor, its cut's bound (the "
    "slowest of the model's own pieces of the cut, alone with plain torch: one forward per sample) and partime's "
    "own tick (the slowest stage alone as partime's Stage runs it), interleaved in rounds, with latencies. "
    "--sizes alone sweeps "
    f"{','.join(str(s) for s in SWEEP_SIZES)}: stages of about 0.2 to 5 ms at D = 2 on a 2-core VM.",
)
@click.option(
    "--rate",
    is_flag=False,
    flag_value=RATE_SEARCH,
    default=None,
    callback=frame_rate,
    help="Feed the frames as a live source (partime.sources.at_rate), read with when_behind='drop', to the plain "
    "model (one thread and every core) and the pipeline (--depths, default 2): at --rate FPS frames per second, "
    f"the frames each keeps, drops and their p50/p99 latency; --rate {RATE_SEARCH} (or --rate alone): each one's "
    "highest rate at which a run of --samples frames drops none, in one of two tries (a bisection on a 2 % grid from "
    "its speed on recorded frames, in each round), then the latencies at 50, 80 and 95 % of it.",
)
@click.option(
    "--learn",
    is_flag=True,
    default=False,
    help="With --rate: learn from every frame taken (the bench's learning: a head, cross-entropy on random labels, "
    "--optimizer) instead of inferring; with --sizes: time learning only.",
)
@click.option(
    "--infer",
    is_flag=True,
    default=False,
    help="With --sizes: time inference only.",
)
@click.option(
    "--optimizer",
    "optimizers",
    default=None,
    callback=optimizer_names,
    help="What learning steps with, in the plain loops and the pipelines alike: sgd (plain SGD) or adam (Adam), "
    "both at a step size of 1e-3; with --sizes, a comma-separated list (sgd,adam) times learning with each in "
    "turn, every contender of one optimizer interleaved in its rounds.  [default: sgd]",
)
@click.option(
    "--grad-mode",
    type=click.Choice(GRAD_MODES),
    default=None,
    help="With --sizes: the grad mode the pipelines and partime's own tick learn with (the bound learns with "
    f"plain torch whatever it is).  [default: {DEFAULT_GRAD_MODE}, the library's default]",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=None,
    help="Rounds of the --sizes sweep or of --rate, each running every contender in turn.  [default: 5]",
)
@click.option(
    "--model",
    type=click.Choice(list(MODELS)),
    default=None,
    help="With --sizes: the model swept. conv: the stem and blocks of 3x3 convolution; resnet: a ResNet-style "
    "network (a stem and --layers BasicBlocks with BatchNorm and shortcuts, one of them strided), which partime "
    "traces and cuts between the nodes of its graph.  [default: conv]",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=None,
    help="Convolution blocks after the stem.  [default: 12; 8 with --sizes; 16 with the distributed executor, "
    "for stages of about 4 ms at D = 2, the size at which its sends between ranks pay off]",
)
@click.option(
    "--compile",
    "compile_",
    is_flag=True,
    default=False,
    help="Also time the model compiled: torch.compile of the whole model in the plain loop, and each depth's "
    "pipeline with compile=True (each stage's forward compiled in its worker); the compiling falls in the warm-up. "
    "Without --sizes and --rate.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the rows to this JSON file.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="With --sizes: draw each contender's speed-up against the stage time in this PNG file; with --rate "
    f"{RATE_SEARCH}: each one's latency against the offered rate, its highest rate marked.",
)
def bench(
    executor: str | None,
    samples: int,
    depths: tuple[int, ...] | None,
    size: int | None,
    sizes: tuple[int, ...] | None,
    rate: float | str | None,
    learn: bool,
    infer: bool,
    optimizers: tuple[str, ...] | None,
    grad_mode: str | None,
    rounds: int | None,
    model: str | None,
    layers: int | None,
    compile_: bool,
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """Time streaming inference and online learning, sequential against pipelined (and, with --sizes,
    against replicas, the bound and partime's own tick, over a sweep of frame sizes); with --rate,
    how fast a live source each keeps up with."""
    from .runner import MODES, run_bench

    if optimizers is not None and len(optimizers) > 1 and sizes is None:
        raise click.BadParameter(
            "this bench learns with one optimizer; the sweep (--sizes) learns with each of a list in turn",
            param_hint="--optimizer",
        )
    optimizer = (optimizers or ("sgd",))[0]
    if infer and (sizes is None or learn):
        raise click.BadParameter(
            "goes with --sizes only, without --learn (the plain bench times both modes)", param_hint="--infer"
        )
    if grad_mode is not None and (sizes is None or infer):
        raise click.BadParameter("goes with --sizes only, when it learns (not with --infer)", param_hint="--grad-mode")
    if compile_ and (sizes is not None or rate is not None or executor == "distributed"):
        raise click.BadParameter(
            "goes with the plain bench only (not --sizes, --rate or the distributed executor)", param_hint="--compile"
        )
    if rate is not None:
        if optimizers is not None and not learn:
            raise click.BadParameter(
                "with --rate, goes with --learn (inference has no optimizer)", param_hint="--optimizer"
            )
        return _bench_rate(
            rate, depths, executor, samples, size, layers, learn, optimizer, rounds, model, sizes, json_path, plot_path
        )
    if learn and sizes is None:
        raise click.BadParameter(
            "goes with --rate or --sizes only (the plain bench times both modes)", param_hint="--learn"
        )
    if sizes is None:
        also = {"--rounds": ", or with --rate", "--plot": f", or with --rate {RATE_SEARCH}", "--model": ""}
        for value, option in ((rounds, "--rounds"), (model, "--model"), (plot_path, "--plot")):
            if value is not None:
                raise click.BadParameter(f"goes with --sizes only{also[option]}", param_hint=option)
    elif size is not None:
        raise click.BadParameter("give --size (one frame size) or --sizes (a sweep), not both", param_hint="--sizes")
    elif executor == "distributed":
        raise click.BadParameter(
            "the sweep runs the process and thread executors; the distributed one benches without --sizes",
            param_hint="--executor",
        )
    if layers is None:
        layers = 8 if sizes is not None else DISTRIBUTED_LAYERS if executor == "distributed" else 12
    depths = depths or ((2,) if sizes is not None else (1, 2, 3, 4))
    if max(depths) > layers + 1:
        raise click.BadParameter(
            f"the model has {layers + 1} layers: depths go up to {layers + 1}, got {max(depths)}", param_hint="--depths"
        )
    if sizes is not None:
        modes = ("learning",) if learn else ("inference",) if infer else MODES
        return _bench_sweep(
            sizes,
            depths,
            executor,
            samples,
            rounds or 5,
            model or "conv",
            layers,
            modes,
            optimizers or ("sgd",),
            grad_mode or DEFAULT_GRAD_MODE,
            json_path,
            plot_path,
        )
    size, executor = size or 32, executor or "process"
    if executor == "distributed":
        return _bench_distributed(samples, size, layers, optimizer, json_path)
    console = wide_console()
    with progress_bar(console) as bar:
        baselines = len({1, os.cpu_count() or 1})  # sequential with one thread and with every core
        configurations = len(MODES) * (baselines + len(depths)) * (2 if compile_ else 1)
        task = bar.add_task("starting", total=1 + configurations)
        report = _advancing(bar, task)
        rows = run_bench(
            executor=executor,
            samples=samples,
            depths=depths,
            size=size,
            layers=layers,
            optimizer=optimizer,
            progress=report,
            compile=compile_,
        )
    print_bench(wide_console(), rows, size, layers, samples, json_path)


def _bench_sweep(
    sizes: tuple[int, ...],
    depths: tuple[int, ...],
    executor: str | None,
    samples: int,
    rounds: int,
    model: str,
    layers: int,
    modes: tuple[str, ...],
    optimizers: tuple[str, ...],
    grad_mode: str,
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """``partime bench --sizes``: every contender at every size, interleaved; a table per mode and optimizer."""
    from .plot import plot_sweep
    from .sweep import PIPELINES, run_sweep, sweep_steps

    pipelines = [kind for kind in PIPELINES if executor in (None, kind.executor)]
    if not pipelines:
        choices = ", ".join(dict.fromkeys(kind.executor for kind in PIPELINES))
        raise click.BadParameter(f"the sweep's pipelines run on {choices}, not {executor}", param_hint="--executor")
    console = wide_console()
    with progress_bar(console) as bar:
        report = _advancing(bar, bar.add_task("starting", total=sweep_steps(sizes, modes, rounds, optimizers)))
        rows = run_sweep(
            model=model,
            sizes=sizes,
            depths=depths,
            pipelines=pipelines,
            layers=layers,
            modes=modes,
            optimizers=optimizers,
            grad_mode=grad_mode,
            samples=samples,
            rounds=rounds,
            progress=report,
        )
    print_sweep(console, rows, json_path)
    if model != "conv":
        console.print(
            f"model: {model} ({MODELS[model].__name__}): each of the {layers} blocks is a BasicBlock (two 3x3 "
            "convolutions with BatchNorm and ReLU, and a shortcut), traced by torch.fx and cut between its nodes"
        )
    if plot_path is not None:
        plot_sweep(rows, plot_path)
        console.print(f"plot written to {plot_path}")


def _bench_rate(
    rate: float | str,
    depths: tuple[int, ...] | None,
    executor: str | None,
    samples: int,
    size: int | None,
    layers: int | None,
    learn: bool,
    optimizer: str,
    rounds: int | None,
    model: str | None,
    sizes: tuple[int, ...] | None,
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """``partime bench --rate``: the plain model and the pipeline reading a live source; see ``bench_rate``."""
    from .plot import plot_rate
    from .rate import run_rate

    for value, option in ((sizes, "--sizes"), (model, "--model")):
        if value is not None:
            raise click.BadParameter(
                "--rate benches the bench's own model at one frame size (--size)", param_hint=option
            )
    if executor == "distributed":
        raise click.BadParameter("--rate runs the process and thread executors", param_hint="--executor")
    if plot_path is not None and rate != RATE_SEARCH:
        raise click.BadParameter(f"draws latency against the rate: give --rate {RATE_SEARCH}", param_hint="--plot")
    layers, depths = layers or 12, depths or (2,)
    if max(depths) > layers + 1:
        raise click.BadParameter(
            f"the model has {layers + 1} layers: depths go up to {layers + 1}, got {max(depths)}", param_hint="--depths"
        )
    console = wide_console()
    with progress_bar(console) as bar:
        report = _advancing(bar, bar.add_task("starting", total=None))  # the searches take as many runs as they need
        rows = run_rate(
            rate=None if rate == RATE_SEARCH else float(rate),
            depths=depths,
            executor=executor or "process",
            learning=learn,
            optimizer=optimizer,
            size=size or 32,
            layers=layers,
            samples=samples,
            rounds=rounds or 5,
            progress=report,
        )
    print_rate(console, rows, json_path)
    if plot_path is not None:
        plot_rate(rows, plot_path)
        console.print(f"plot written to {plot_path}")


def _bench_distributed(samples: int, size: int, layers: int, optimizer: str, json_path: Path | None) -> None:
    """``partime bench --executor distributed``, run by every rank under torchrun (D = world size)."""
    from .distributed import bench_distributed

    rows = bench_distributed(samples, size, layers, optimizer=optimizer)
    if rows is not None:  # rank 0; the other ranks served their stages
        print_bench(wide_console(), rows, size, layers, samples, json_path)

"""``partime fidelity --live`` (a part of the CLI, which prints): the plain loop against a
pipeline at each of ``--depths`` on a live stream that arrives faster than the plain loop learns.

``live_view`` measures each contender's time per learning sample (``fidelity_live_clock``: the
plain loop once, the pipeline at each depth; or takes them from ``--times``), sets the stream's
rates to multiples of the plain loop's learning rate, chooses each contender's step size on the
tuning seed, runs the reported seeds
(``fidelity_live_runs``), optionally plays one stream on the real clock (``--check-real``), and
writes and prints the report (``fidelity_live_report``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
from rich.progress import Progress, TaskID

from ..report import progress_bar, wide_console
from . import live_report as report
from . import live_runs as runs
from . import runs as fid
from .live_clock import check_real, measure
from .models import model_of


def parse_rates(value: str) -> tuple[float, ...]:
    """``--rates``: comma-separated multiples of the plain loop's learning rate, each above 0."""
    try:
        rates = tuple(float(n) for n in value.split(",") if n.strip())
    except ValueError:
        rates = ()
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise click.BadParameter(f"comma-separated numbers above 0, e.g. 1.5,2; got {value!r}", param_hint="--rates")
    return rates


def parse_depths(depths: Sequence[int]) -> tuple[int, ...]:
    """``--depths`` for the live view: distinct depths of at least 2 (the plain loop is D = 1)."""
    if any(d < 2 for d in depths) or len(set(depths)) != len(depths):
        raise click.BadParameter(
            f"with --live, distinct depths of at least 2 (the plain loop is the D = 1 contender); got "
            f"{','.join(map(str, depths))}",
            param_hint="--depths",
        )
    return tuple(depths)


def parse_times(
    value: str, models: Sequence[str], optimizers: Sequence[str], depths: Sequence[int]
) -> list[dict[str, Any]]:
    """``--times``: ``plain_ms,pipeline_ms`` (the one pipeline time at every depth), or
    ``plain_ms`` and a pipeline time per depth of ``depths`` in their order, for every model and
    optimizer; or the path of an earlier run's ``live.json``, whose times (and the pipeline's
    cuts) are taken again, a row without a depth (from before the live view had depths) read as
    D = 2. One row per model, optimizer and depth, as a measurement makes them."""
    path = Path(value)
    if path.is_file():
        try:
            given = {
                (t["model"], t["optimizer"], int(t.get("depth", report.LEGACY_DEPTH))): t
                for t in json.loads(path.read_text())["times"]
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise click.BadParameter(f"{path} holds no live view's times ({exc})", param_hint="--times") from exc
        keys = list(itertools.product(models, optimizers, depths))
        missing = [f"{m}/{o} at D = {d}" for m, o, d in keys if (m, o, d) not in given]
        if missing:
            raise click.BadParameter(
                f"{path} has no times for {', '.join(missing)}; measure them (leave --times out) or choose "
                "--depths it holds",
                param_hint="--times",
            )
        rows = [dict(given[m, o, d], depth=d, source=_taken(given[m, o, d], path)) for m, o, d in keys]
        for m, o in itertools.product(models, optimizers):
            plains = {d: given[m, o, d]["plain_ms"] for d in depths}
            if len(set(plains.values())) > 1:
                got = ", ".join(f"{ms:g} at D = {d}" for d, ms in plains.items())
                raise click.BadParameter(
                    f"{path} gives {m}/{o} more than one plain loop's time ({got} ms): the rates are multiples of one",
                    param_hint="--times",
                )
        return rows
    try:
        numbers = [float(n) for n in value.split(",")]
    except ValueError:
        numbers = []
    if len(numbers) == 2:
        numbers += numbers[1:] * (len(depths) - 1)
    if len(numbers) != 1 + len(depths) or not all(n > 0 and math.isfinite(n) for n in numbers):
        raise click.BadParameter(
            f"plain_ms,pipeline_ms (numbers above 0, e.g. 10,6: the pipeline's at every depth), or plain_ms "
            f"and one pipeline time per depth of --depths {','.join(map(str, depths))} (e.g. 10,"
            f"{','.join(str(5 + k) for k in range(len(depths)))}), or an earlier live.json; got {value!r}",
            param_hint="--times",
        )
    plain_ms, *pipeline_ms = numbers
    return [
        dict(model=m, optimizer=o, depth=d, plain_ms=plain_ms, pipeline_ms=ms, balance=None, source="given")
        for m in models
        for o in optimizers
        for d, ms in zip(depths, pipeline_ms)
    ]


def live_view(
    *,
    frames: int,
    seeds: int,
    stream_names: Sequence[str],
    optimizers: Sequence[str],
    depths: Sequence[int],
    rates: str,
    times: str | None,
    real: bool,
    jobs: int,
    out_dir: Path,
) -> None:
    """Run the live view and write ``live.json``, ``live.md`` and ``live.png`` in ``out_dir``."""
    multiples = parse_rates(rates)
    depths = parse_depths(depths)
    models = list(dict.fromkeys(model_of(s) for s in stream_names))
    time_rows = None if times is None else parse_times(times, models, optimizers, depths)
    if time_rows is not None:
        fixed_cuts(models, depths)  # a depth with no fixed cut fails here, before any run
    held_out = min(runs.HELD_OUT, frames)
    console = wide_console()
    with progress_bar(console) as bar:
        if time_rows is None:
            task = bar.add_task("timing", total=len(models) * len(optimizers))
            time_rows = []
            for model in models:
                for optimizer in optimizers:
                    at = ", ".join(map(str, depths))
                    bar.update(task, description=f"timing {model}, {optimizer}: the plain loop and D = {at}")
                    measured, balances = measure(model, optimizer, depths)
                    time_rows += _time_rows(model, optimizer, measured, balances)
                    bar.advance(task)
        # given times bring no cut: then fidelity's fixed cut at that depth
        fixed = fixed_cuts([t["model"] for t in time_rows if not t["balance"]], depths)
        for t in time_rows:
            t["balance"] = list(t["balance"] or fixed[t["model"], t["depth"]])
        table = times_table(time_rows)
        cuts = {(t["model"], t["optimizer"], t["depth"]): tuple(t["balance"]) for t in time_rows}
        tuning = runs.tuning_configs(stream_names, optimizers, multiples, depths, table, cuts)
        tuned = runs.run_all(
            tuning, frames, held_out, jobs, _advancing(bar, bar.add_task("step sizes", total=len(tuning)))
        )
        steps = runs.best_step_sizes(tuned)
        seeds_run = fid.reported_seeds(seeds)
        cfgs = runs.configs(stream_names, optimizers, multiples, depths, table, cuts, seeds_run, steps)
        rows = runs.run_all(cfgs, frames, held_out, jobs, _advancing(bar, bar.add_task("learning", total=len(cfgs))))
    check = None
    if real:
        stream, optimizer, multiple = stream_names[0], optimizers[0], multiples[0]
        measured = table[model_of(stream), optimizer]
        lrs = {1: steps[stream, optimizer, multiple, "plain", 1]}
        lrs |= {d: steps[stream, optimizer, multiple, "pipeline", d] for d in depths}
        console.print(
            f"playing {frames} samples of {stream} on the real clock to the plain loop and the pipeline at "
            f"D = {', '.join(map(str, depths))} ({optimizer})"
        )
        check = check_real(stream, optimizer, lrs, measured, multiple / measured.plain, frames, seed=cfgs[0].seed)
    paths = report.write(rows, out_dir, tuning=tuned, times=time_rows, check=check)
    console.print(paths["markdown"].read_text())
    console.print(
        f"{len(tuned)} + {len(rows)} runs of {frames} live samples (held out: {held_out}); written: "
        + ", ".join(str(p) for p in paths.values())
    )


def fixed_cuts(models: Sequence[str], depths: Sequence[int]) -> dict[tuple[str, int], tuple[int, ...]]:
    """``partime fidelity``'s fixed cut of each of ``models`` at each of ``depths``: the cut of a
    pipeline whose times were given; a depth it holds no cut of is a bad ``--depths``."""
    try:
        return {(m, d): fid.cut(m, d) for m in dict.fromkeys(models) for d in depths}
    except ValueError as exc:
        raise click.BadParameter(
            f"{exc}; with --times, the live view cuts a pipeline at fidelity's fixed cuts: choose among those "
            "depths, or leave --times out to measure the times and plan the cut here",
            param_hint="--depths",
        ) from exc


def times_table(time_rows: Sequence[dict[str, Any]]) -> runs.TimesTable:
    """The ``Times`` of each (model, optimizer) from ``time_rows`` (milliseconds, a row per depth)."""
    table: runs.TimesTable = {}
    for t in time_rows:
        key = (t["model"], t["optimizer"])
        pipeline = dict(table[key].pipeline) if key in table else {}
        table[key] = runs.Times(t["plain_ms"] / 1e3, pipeline | {t["depth"]: t["pipeline_ms"] / 1e3})
    return table


def _time_rows(
    model: str, optimizer: str, measured: runs.Times, balances: dict[int, tuple[int, ...]]
) -> list[dict[str, Any]]:
    return [
        dict(
            model=model,
            optimizer=optimizer,
            depth=depth,
            plain_ms=measured.plain * 1e3,
            pipeline_ms=seconds * 1e3,
            balance=list(balances[depth]) or None,
            source=f"measured on {os.cpu_count()} cores",
        )
        for depth, seconds in measured.pipeline.items()
    ]


def _taken(row: dict[str, Any], path: Path) -> str:
    """Where a time row taken from ``path`` came from: the first file it was taken from, and how it was got."""
    source = str(row.get("source", ""))
    if source.startswith("from "):
        return source
    return f"from {path}" + (f" ({source})" if source else "")


def _advancing(bar: Progress, task: TaskID) -> Callable[[dict[str, Any]], None]:
    return lambda row: bar.update(
        task,
        advance=1,
        description=f"{row['optimizer']} lr {row['lr']:g}: {row['stream']} at {row['multiple']:g}×, "
        f"{row['label']}, seed {row['seed']}",
    )

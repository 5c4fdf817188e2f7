"""``partime fidelity --live`` (a part of the CLI, which prints): the plain loop against a D = 2
pipeline on a live stream that arrives faster than the plain loop learns.

``live_view`` measures each contender's time per learning sample (``fidelity_live_clock``; or
takes them from ``--times``), sets the stream's rates to multiples of the plain loop's learning
rate, chooses each contender's step size on the tuning seed, runs the reported seeds
(``fidelity_live_runs``), optionally plays one stream on the real clock (``--check-real``), and
writes and prints the report (``fidelity_live_report``).
"""

from __future__ import annotations

import json
import math
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


def parse_times(value: str, models: Sequence[str], optimizers: Sequence[str]) -> list[dict[str, Any]]:
    """``--times``: ``plain_ms,pipeline_ms`` for every model and optimizer, or the path of an
    earlier run's ``live.json``, whose times (and the pipeline's cuts) are taken again; one row
    per model and optimizer, as ``time_rows`` makes them."""
    path = Path(value)
    if path.is_file():
        try:
            given = {(t["model"], t["optimizer"]): t for t in json.loads(path.read_text())["times"]}
        except (ValueError, KeyError, TypeError) as exc:
            raise click.BadParameter(f"{path} holds no live view's times ({exc})", param_hint="--times") from exc
        missing = [f"{m}/{o}" for m in models for o in optimizers if (m, o) not in given]
        if missing:
            raise click.BadParameter(f"{path} has no times for {', '.join(missing)}", param_hint="--times")
        return [dict(given[m, o], source=f"from {path}") for m in models for o in optimizers]
    try:
        plain_ms, pipeline_ms = (float(n) for n in value.split(","))
    except ValueError:
        plain_ms = pipeline_ms = math.nan
    if not (plain_ms > 0 and pipeline_ms > 0 and math.isfinite(plain_ms + pipeline_ms)):
        raise click.BadParameter(
            f"plain_ms,pipeline_ms (two numbers above 0, e.g. 10,6) or an earlier live.json; got {value!r}",
            param_hint="--times",
        )
    return [
        dict(model=m, optimizer=o, plain_ms=plain_ms, pipeline_ms=pipeline_ms, balance=None, source="given")
        for m in models
        for o in optimizers
    ]


def live_view(
    *,
    frames: int,
    seeds: int,
    stream_names: Sequence[str],
    optimizers: Sequence[str],
    rates: str,
    times: str | None,
    real: bool,
    jobs: int,
    out_dir: Path,
) -> None:
    """Run the live view and write ``live.json``, ``live.md`` and ``live.png`` in ``out_dir``."""
    multiples = parse_rates(rates)
    models = list(dict.fromkeys(model_of(s) for s in stream_names))
    time_rows = None if times is None else parse_times(times, models, optimizers)
    held_out = min(runs.HELD_OUT, frames)
    console = wide_console()
    with progress_bar(console) as bar:
        if time_rows is None:
            task = bar.add_task("timing", total=len(models) * len(optimizers))
            time_rows = []
            for model in models:
                for optimizer in optimizers:
                    bar.update(task, description=f"timing {model}, {optimizer}: the plain loop and the pipeline")
                    measured, balance = measure(model, optimizer)
                    time_rows.append(_time_row(model, optimizer, measured, balance))
                    bar.advance(task)
        # given times bring no cut: then the one a learning Pipeline(balance=DEPTH) plans, once per model
        planned = {m: fid.cut(m, runs.DEPTH) for m in dict.fromkeys(t["model"] for t in time_rows if not t["balance"])}
        for t in time_rows:
            t["balance"] = list(t["balance"] or planned[t["model"]])
        table = {
            (t["model"], t["optimizer"]): runs.Times(t["plain_ms"] / 1e3, t["pipeline_ms"] / 1e3) for t in time_rows
        }
        balances = {(t["model"], t["optimizer"]): tuple(t["balance"]) for t in time_rows}
        tuning = runs.tuning_configs(stream_names, optimizers, multiples, table, balances)
        tuned = runs.run_all(
            tuning, frames, held_out, jobs, _advancing(bar, bar.add_task("step sizes", total=len(tuning)))
        )
        steps = runs.best_step_sizes(tuned)
        cfgs = runs.configs(stream_names, optimizers, multiples, table, balances, fid.reported_seeds(seeds), steps)
        rows = runs.run_all(cfgs, frames, held_out, jobs, _advancing(bar, bar.add_task("learning", total=len(cfgs))))
    check = None
    if real:
        stream, optimizer, multiple = stream_names[0], optimizers[0], multiples[0]
        measured = table[model_of(stream), optimizer]
        lrs = {c: steps[stream, optimizer, multiple, c] for c in runs.CONTENDERS}
        console.print(f"playing {frames} samples of {stream} on the real clock to both contenders ({optimizer})")
        check = check_real(stream, optimizer, lrs, measured, multiple / measured.plain, frames, seed=cfgs[0].seed)
    paths = report.write(rows, out_dir, tuning=tuned, times=time_rows, check=check)
    console.print(paths["markdown"].read_text())
    console.print(
        f"{len(tuned)} + {len(rows)} runs of {frames} live samples (held out: {held_out}); written: "
        + ", ".join(str(p) for p in paths.values())
    )


def _time_row(model: str, optimizer: str, measured: runs.Times, balance: tuple[int, ...]) -> dict[str, Any]:
    return dict(
        model=model,
        optimizer=optimizer,
        plain_ms=measured.plain * 1e3,
        pipeline_ms=measured.pipeline * 1e3,
        balance=list(balance) or None,
        source="measured",
    )


def _advancing(bar: Progress, task: TaskID) -> Callable[[dict[str, Any]], None]:
    return lambda row: bar.update(
        task,
        advance=1,
        description=f"{row['optimizer']} lr {row['lr']:g}: {row['stream']} at {row['multiple']:g}×, "
        f"{row['label']}, seed {row['seed']}",
    )

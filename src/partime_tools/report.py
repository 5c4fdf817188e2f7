"""What the ``partime`` commands show: the console, the progress display and the bench's report.

Only the CLI calls these; they print, the library never does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from partime.internals import DEFAULT_GRAD_MODE

OPTIMIZER_NAMES = {"sgd": "SGD", "adam": "Adam"}
"""How the reports name the bench's optimizers (``bench.OPTIMIZERS``)."""


def wide_console() -> Console:
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


def print_bench(
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
    if any(row.get("compiled") for row in rows):
        console.print(
            "sequential compiled: torch.compile(model, dynamic=False) in the plain loop; compile=True: each stage's "
            "forward compiled in its worker; compiling falls in the warm-up; speed-ups are over the uncompiled model"
        )
    busy = max([first.get("hop_others_busy") or 0.0] + [row["others_busy"] or 0.0 for row in rows])
    _close(console, rows, json_path, busy, "up to", " (column 'others'): the rows where they did are skewed")


def bench_table(rows: list[dict]) -> Table:
    """The rows of ``run_bench`` as a table."""
    table = Table(title="partime bench: median time per sample")
    for name in ("mode", "run", "ms/sample", "× seq 1 thr", "× seq all cores", "max stage ms", "others", "partition"):
        table.add_column(
            name, justify="left" if name in ("mode", "run", "partition") else "right", no_wrap=name != "partition"
        )
    for row in rows:
        run = row["executor"] if row["depth"] == 0 else f"D={row['depth']} {row['executor']}"
        if row["depth"] and row.get("compiled"):
            run += " compile=True"
        stage = f"{row['max_stage_ms']:.2f}" if row.get("max_stage_ms") is not None else ""
        others = "?" if row["others_busy"] is None else f"{row['others_busy']:.0%}"
        table.add_row(
            mode_of(row),
            run,
            f"{row['ms_per_sample']:.2f}",
            f"{row['speedup_vs_seq_1thread']:.2f}",
            f"{row['speedup_vs_seq_allcores']:.2f}",
            stage,
            others,
            row.get("partition", ""),
        )
    return table


def mode_of(row: dict) -> str:
    """A row's mode, with its optimizer when it learns: ``inference``, ``learning (sgd)``."""
    return row["mode"] if row.get("optimizer") is None else f"{row['mode']} ({row['optimizer']})"


def print_sweep(console: Console, rows: list[dict], json_path: Path | None) -> None:
    """The rows of ``bench_sweep.run_sweep``: a table per mode (and optimizer), what was measured, and the JSON."""
    for mode in dict.fromkeys(mode_of(row) for row in rows):
        console.print(sweep_table([row for row in rows if mode_of(row) == mode]))
    first = rows[0]
    hops = {row["size"]: row for row in rows}.values()
    console.print(
        f"{first['cores']} cores; batch-1 frames 3 x size x size; a stem and {first['layers']} blocks of 3x3 conv "
        f"({first['channels']} channels) + ReLU, and a head, cross-entropy and the optimizer when learning; "
        f"per run {first['samples']} samples timed "
        f"after {first['warmup']}, median of {first['blocks']} blocks; median over {first['rounds']} rounds that "
        "alternate the contenders"
    )
    console.print(
        f"hop cost (median, one put + get between processes): 64 KB {first['hop_64kb_us']:.1f} µs; one activation: "
        + ", ".join(
            f"{row['size']}x{row['size']} ({row['activation_bytes'] // 1024} KB) {row['hop_activation_us']:.1f} µs"
            for row in hops
        )
    )
    console.print(
        "bound: the slowest of the model's own pieces of the pipeline's cut, each timed alone with plain torch and "
        "one thread (inference: a forward under inference_mode; learning: one forward, the backward and the "
        "optimizer's step, the loss in the last piece); own tick: the slowest stage of that cut alone as partime's "
        "own Stage runs it (learning with the pipelines' grad mode and the default compensation: by default a stage "
        "before the last keeps its forward's graph for the backward and compensates its delay); stage ms: the first pipeline's bound; ÷ bound, ÷ own tick: "
        "ms/sample over them; latency: from the moment the stream pulls a sample to the moment its result comes "
        "out, over the timed samples of every round"
    )
    console.print(
        first.get("floor_left_out")
        or "python floor: the simplest Python pipeline of the same cut (benchmarks/python_floor.py: a spawned process "
        "per stage but the last, shared-memory rings with semaphores, one thread each; learning, each sample's graph "
        "kept for its late gradient, no compensation); ÷ floor: ms/sample over it"
    )
    busy = max([row.get("hop_others_busy") or 0.0 for row in rows] + [row["others_busy"] or 0.0 for row in rows])
    _close(console, rows, json_path, busy, "up to", " (column 'others'): the sizes where they did are skewed")


def sweep_table(rows: list[dict]) -> Table:
    """The rows of one mode (and optimizer) of ``run_sweep`` as a table, by frame size then contender."""
    first = rows[0]
    title = f"partime bench, {first['mode']}"
    if first.get("optimizer") is not None:
        title += f" with {OPTIMIZER_NAMES.get(first['optimizer'], first['optimizer'])}"
    if first.get("grad_mode") not in (None, DEFAULT_GRAD_MODE):
        title += f", grad_mode={first['grad_mode']!r}"
    table = Table(title=f"{title}: median ms per sample over {first['rounds']} rounds")
    names: tuple[str, ...] = (
        "frames",
        "stage ms",
        "contender",
        "ms/sample",
        "× seq 1 thr",
        "× seq all cores",
        "÷ bound",
        "÷ floor",
        "÷ own tick",
    )
    names += ("p50 ms", "p99 ms", "others", "cut")
    for name in names:
        table.add_column(name, justify="left" if name in ("contender", "cut") else "right", no_wrap=name != "cut")
    for row in rows:
        cut = "" if row.get("balance") is None else str(row["balance"])
        if row["kind"] in ("bound", "own tick"):
            cut += " alone: " + ", ".join(f"{ms:.2f}" for ms in row["stage_alone_ms"]) + " ms"
        table.add_row(
            f"{row['size']}x{row['size']}",
            f"{row['bound_stage_ms']:.2f}",
            row["contender"],
            f"{row['ms_per_sample']:.3f}",
            f"{row['speedup_vs_seq_1thread']:.2f}",
            f"{row['speedup_vs_seq_allcores']:.2f}",
            "" if row.get("ms_over_bound") is None else f"{row['ms_over_bound']:.2f}",
            "" if row.get("ms_over_floor") is None else f"{row['ms_over_floor']:.2f}",
            "" if row.get("ms_over_own_tick") is None else f"{row['ms_over_own_tick']:.2f}",
            f"{row['latency_p50_ms']:.2f}",
            f"{row['latency_p99_ms']:.2f}",
            "?" if row["others_busy"] is None else f"{row['others_busy']:.0%}",
            cut,
        )
    return table


def print_rate(console: Console, rows: list[dict], json_path: Path | None) -> None:
    """The rows of ``bench_rate.run_rate``: the highest rates (if searched), the runs at each rate,
    for each pipeline how it compares with the plain model, what was measured, and the JSON."""
    first = rows[0]
    contenders = list({row["contender"]: row for row in rows}.values())
    if first["sustained_fps"] is not None:
        console.print(rate_table(contenders))
    console.print(rate_runs_table(rows))
    seq = next(row for row in contenders if row["kind"] == "sequential" and row["threads"] == 1)
    for row in rows:
        if row["kind"] == "pipeline" and row["fraction"] == 0.8 and row["latency_p99_ms"] is not None:
            console.print(
                f"{row['contender']}: the highest rate {_figure(row['sustained_vs_seq_1thread'])}x that of sequential "
                f"with one thread ({_figure(row['sustained_vs_seq_allcores'])}x with every core); p99 latency at 80 % "
                f"of it {row['latency_p99_ms']:.2f} ms, {row['p99_over_seq_ms']:.2f}x sequential's time per sample "
                f"({seq['ms_per_sample']:.2f} ms, one thread)"
            )
    console.print(
        f"{first['cores']} cores; {first['mode']}; batch-1 frames 3x{first['size']}x{first['size']}; a stem and "
        f"{first['layers']} blocks of 5x5 conv ({first['channels']} channels) + ReLU"
        + (
            f", a head, cross-entropy and {OPTIMIZER_NAMES.get(first['optimizer'], first['optimizer'])}"
            if first["mode"] == "learning"
            else ""
        )
        + f"; each run: {first['warmup']} frames of warm-up, {first['samples']} timed, read with when_behind='drop'; "
        f"{_count(first['rounds'], 'round')} that alternate the contenders; ms/sample: on recorded frames, median of "
        f"{first['blocks']} blocks, median over rounds; latency: from a frame's arrival to its result, kept frames "
        "of every round"
    )
    _close(console, rows, json_path, first["others_busy"], "", ": every figure is skewed")


def rate_table(contenders: list[dict]) -> Table:
    """One row of ``run_rate`` per contender: its speed on recorded frames and its highest rate."""
    first = contenders[0]
    table = Table(
        title=f"partime bench --rate, {first['mode']}: the highest rate at which {first['samples']} frames drop none, "
        "in one of two tries "
        f"(median over {_count(first['rounds'], 'round')})"
    )
    names = ("contender", "ms/sample", "recorded fps", "highest fps", "per round", "× seq 1 thr", "× seq all cores")
    for name in (*names, "cut"):
        table.add_column(name, justify="left" if name in ("contender", "per round", "cut") else "right")
    for row in contenders:
        table.add_row(
            row["contender"],
            f"{row['ms_per_sample']:.2f}",
            f"{1e3 / row['ms_per_sample']:.0f}",
            f"{row['sustained_fps']:.0f}",
            ", ".join(f"{fps:.0f}" for fps in row["sustained_fps_per_round"]),
            _figure(row["sustained_vs_seq_1thread"]),
            _figure(row["sustained_vs_seq_allcores"]),
            "" if row["balance"] is None else str(row["balance"]),
        )
    if any(0 in row["sustained_fps_per_round"] for row in contenders):
        table.caption = "0: it dropped frames at every rate it was tried at"
    return table


def rate_runs_table(rows: list[dict]) -> Table:
    """The runs of ``run_rate`` at each rate, by contender: frames kept and dropped, and latencies."""
    first = rows[0]
    table = Table(
        title=f"partime bench --rate, {first['mode']}: a live source at each rate ({_count(first['rounds'], 'run')} each)"
    )
    names = ("contender", "% of highest", "offered fps", "kept fps", "dropped", "p50 ms", "p99 ms", "p99 ÷ seq ms")
    for name in names:
        table.add_column(name, justify="left" if name == "contender" else "right")
    for row in rows:
        if not row["offered"]:
            continue  # its sustained rate is 0: nothing ran
        table.add_row(
            row["contender"],
            "" if row["fraction"] is None else f"{row['fraction']:.0%}",
            f"{row['offered_fps']:.1f}",
            f"{row['kept_fps']:.1f}",
            f"{row['dropped']} of {row['offered']}",
            _figure(row["latency_p50_ms"]),
            _figure(row["latency_p99_ms"]),
            _figure(row["p99_over_seq_ms"]),
        )
    return table


def _figure(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _close(
    console: Console, rows: list[dict], json_path: Path | None, busy: float | None, up_to: str, skewed: str
) -> None:
    """The end of a report: a warning if other processes kept (``up_to``) more than a tenth of the
    CPUs ``busy`` (``skewed``: which figures that skews), and ``rows`` written to ``json_path``."""
    if busy is not None and busy > 0.1:
        console.print(
            f"[yellow]other processes kept {up_to + ' ' if up_to else ''}{busy:.0%} of the CPUs busy{skewed}; "
            "run the bench again on a quiet machine"
        )
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")
        console.print(f"rows written to {json_path}")

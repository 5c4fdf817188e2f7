"""The figures of ``partime bench --plot``: with ``--sizes``, each contender's speed-up against the stage
time; with ``--rate max``, each one's latency against the offered rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .runner import MODES


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per mode (learning: per optimizer) in ``rows`` (those of ``bench_sweep.run_sweep``):
    for every contender, its speed-up over sequential with one thread against ``bound_stage_ms``
    (the bound's slowest piece alone, log scale), one point per frame size; saved to ``path`` (PNG,
    matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    panels = sorted(
        dict.fromkeys((row["mode"], row.get("optimizer")) for row in rows if row["mode"] in MODES),
        key=lambda panel: MODES.index(panel[0]),
    )
    if not panels:
        raise ValueError("no rows to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False, sharey=True)
    styles = {"sequential": ":", "bound": "--", "own tick": "-."}
    names = list(dict.fromkeys(row["contender"] for row in rows))
    colours = {name: f"C{i % 10}" for i, name in enumerate(names)}  # a contender has one colour in every panel
    for ax, (mode, optimizer) in zip(axes[0], panels):
        series: dict[str, list[tuple[float, float]]] = {}
        kinds: dict[str, str] = {}
        for row in rows:
            if (row["mode"], row.get("optimizer")) == (mode, optimizer):
                series.setdefault(row["contender"], []).append((row["bound_stage_ms"], row["speedup_vs_seq_1thread"]))
                kinds[row["contender"]] = row["kind"]
        for name, points in series.items():
            points.sort()
            ax.plot(
                [x for x, _ in points],
                [y for _, y in points],
                marker="o",
                linestyle=styles.get(kinds[name], "-"),
                color=colours[name],
                label=name,
            )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        stage_ms = sorted({x for points in series.values() for x, _ in points})
        ax.set_xticks(stage_ms, [f"{x:.2g}" for x in stage_ms])  # one tick per frame size
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("stage time: the bound, the slowest piece of the cut alone (ms)")
        ax.set_title(mode if optimizer is None else f"{mode} ({optimizer})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("speed-up over sequential, 1 thread")
    first = rows[0]
    fig.suptitle(
        f"partime bench: a stem and {first['layers']} 3x3 convolutions of {first['channels']} channels, "
        f"batch-1 frames of {', '.join(str(s) for s in sorted({row['size'] for row in rows}))} pixels a side"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_rate(rows: list[dict[str, Any]], path: Path) -> None:
    """The rows of ``bench_rate.run_rate`` (a search): for every contender that kept up with some
    rate, its p50 (solid) and p99 (dashed) latency against the offered rate, one point per rate
    run, and its highest rate without a drop as a dotted vertical line; saved to ``path`` (PNG,
    matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows or any(row["sustained_fps"] is None for row in rows):
        raise ValueError("the plot needs the rows of a search (run_rate with rate=None)")
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    names = list(dict.fromkeys(row["contender"] for row in rows))
    for i, name in enumerate(names):
        mine = sorted((r for r in rows if r["contender"] == name and r["offered"]), key=lambda r: r["offered_fps"])
        if not mine:
            continue  # it kept up with no rate: nothing ran below it
        colour, fps = f"C{i % 10}", [row["offered_fps"] for row in mine]
        for key, style, label in (("latency_p50_ms", "-", "p50"), ("latency_p99_ms", "--", "p99")):
            ax.plot(
                fps, [row[key] for row in mine], marker="o", linestyle=style, color=colour, label=f"{name}, {label}"
            )
        ax.axvline(mine[0]["sustained_fps"], color=colour, linestyle=":", linewidth=1.2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("offered rate (frames per second); dotted: the highest rate without a drop")
    ax.set_ylabel("latency, arrival to result (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    first = rows[0]
    ax.set_title(
        f"partime bench --rate, {first['mode']}: a stem and {first['layers']} 5x5 convolutions of "
        f"{first['channels']} channels, {first['size']}x{first['size']} frames",
        fontsize="medium",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

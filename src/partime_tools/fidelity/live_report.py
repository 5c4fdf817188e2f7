"""What the live view reports: the plain loop against the pipeline at each depth on each stream, optimizer and rate.

``summarise`` promises one line per stream, optimizer, rate and contender (the plain loop, the
pipeline at each depth; means over the reported seeds) and ``compare`` one per stream, optimizer,
rate and pipeline depth, with that pipeline's gap to the plain loop; ``markdown`` and ``plot`` show
them, ``write`` puts rows, summary, times and plot in a folder. Comparisons and times written
before the live view had depths (no ``depth``) read as ``LEGACY_DEPTH``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .runs import OPTIMIZER_NAMES

FILES = {"json": "live.json", "markdown": "live.md", "png": "live.png"}
LINE_STYLES = ("-", "--", ":", "-.")
"""The rolling scores' line style of each rate, in the order of the rates."""
PLAIN_COLOUR = "black"
PIPELINE_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
"""The pipeline's colour at each depth, the smallest depth first."""
LEGACY_DEPTH = 2
"""The pipeline's depth in what the live view wrote before it ran at several depths."""


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per stream, optimizer, rate and contender (the plain loop, and the pipeline at each
    depth, ``depth``: 1 for the plain loop): its step size, rate, time per sample,
    and the means over seeds of the share of the stream it kept, its test-then-train score over
    what it kept (``score``) and its final model's score on the held-out samples (``held_out``).
    A mean over seeds with a diverged run is None (an accuracy over the kept samples counts the
    samples after a divergence as misses instead)."""
    groups: dict[tuple[str, str, float, str, int], list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["stream"], row["optimizer"], row["multiple"], row["contender"], row["depth"])
        groups.setdefault(key, []).append(row)
    return [
        dict(
            stream=stream,
            optimizer=optimizer,
            multiple=multiple,
            contender=contender,
            depth=depth,
            label=group[0]["label"],
            lr=group[0]["lr"],
            rate=group[0]["rate"],
            seconds_per_sample=group[0]["seconds_per_sample"],
            metric=group[0]["metric"],
            kept=statistics.mean(r["kept"] / r["frames"] for r in group),
            score=_mean_or_none([r["score"] for r in group]),
            held_out=_mean_or_none([r["held_out"] for r in group]),
            seeds=len(group),
            diverged=sum(r["diverged_at"] is not None for r in group),
        )
        for (stream, optimizer, multiple, contender, depth), group in groups.items()
    ]


def compare(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each stream, optimizer, rate and pipeline depth of ``summarise``'s lines with the plain
    loop beside it: both lines, the depth, and the pipeline's gap to the plain loop over the kept
    samples (``gap``) and on the held-out ones (``held_out_gap``): points of accuracy (pipeline
    minus plain), or percent of the plain loop's loss (positive: the pipeline's is higher);
    ``better``: the contender whose final model scored better on the held-out samples (None on a
    tie or without both scores). In the order of the lines, the depths of one rate together."""
    plains = {(x["stream"], x["optimizer"], x["multiple"]): x for x in lines if x["contender"] == "plain"}
    out = []
    for pipeline in (x for x in lines if x["contender"] != "plain"):
        stream, optimizer, multiple = pipeline["stream"], pipeline["optimizer"], pipeline["multiple"]
        plain = plains.get((stream, optimizer, multiple))
        if plain is None:
            continue
        metric = plain["metric"]
        held_gap = _gap(pipeline["held_out"], plain["held_out"], metric)
        better = None
        if held_gap:
            better = "pipeline" if (held_gap > 0) == (metric == "accuracy") else "plain"
        out.append(
            dict(
                stream=stream,
                optimizer=optimizer,
                multiple=multiple,
                depth=pipeline["depth"],
                metric=metric,
                plain=plain,
                pipeline=pipeline,
                gap=_gap(pipeline["score"], plain["score"], metric),
                held_out_gap=held_gap,
                better=better,
            )
        )
    return out


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else statistics.mean(v for v in values if v is not None)


def _gap(value: float | None, base: float | None, metric: str) -> float | None:
    if value is None or base is None:
        return None
    return 100 * (value - base) if metric == "accuracy" else 100 * (value - base) / base


def markdown(
    comparisons: Sequence[dict[str, Any]], times: Sequence[dict[str, Any]], check: dict[str, Any] | None = None
) -> str:
    """The times per sample (a row per model, optimizer and depth), the comparisons as one table (a
    row per stream, optimizer, rate and depth) and, if given, ``check_real``'s counts, as Markdown."""
    out = [
        "Seconds per learning sample (the rates are multiples of the plain loop's 1 / time; the last column: "
        "where the times were measured):",
        "",
        "| model | optimizer | D | plain loop, ms | pipeline, ms | pipeline's cut | times |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in times:
        cut = list(t["balance"]) if t.get("balance") else ""
        depth = t.get("depth", LEGACY_DEPTH)
        out.append(
            f"| {t['model']} | {t['optimizer']} | {depth} | {t['plain_ms']:.2f} | {t['pipeline_ms']:.2f} | {cut} "
            f"| {t['source']} |"
        )
    if comparisons:
        depths = ", ".join(str(d) for d in sorted({_depth(c) for c in comparisons}))
        labels = ", ".join(dict.fromkeys(_without_depth(c["pipeline"]["label"]) for c in comparisons))
        out += [
            "",
            (
                f"Plain loop (D = 1) against the pipeline at D = {depths} with its defaults ({labels}); each "
                "cell: plain loop / pipeline at the row's D. Score: test-then-train over the samples each kept; "
                "held-out: the final model on the samples after the live part, no learning. Gap: pipeline minus "
                "plain loop, in points of accuracy, or in percent of the plain loop's loss (positive: the "
                "pipeline's is higher)."
            ),
            "",
            "| stream | optimizer | rate | D | kept | step size | score | held-out | gap: score, held-out | better |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for c in comparisons:
        plain, pipeline = c["plain"], c["pipeline"]
        diverged = "".join(
            f" ({x['diverged']}/{x['seeds']} {name} diverged)"
            for name, x in (("plain", plain), ("pipeline", pipeline))
            if x["diverged"]
        )
        cells = [
            c["stream"],
            OPTIMIZER_NAMES.get(c["optimizer"], c["optimizer"]),
            f"{c['multiple']:g}× ({plain['rate']:.0f}/s)",
            str(_depth(c)),
            f"{100 * plain['kept']:.0f}% / {100 * pipeline['kept']:.0f}%",
            f"{plain['lr']:g} / {pipeline['lr']:g}",
            f"{_score(plain['score'], c['metric'])} / {_score(pipeline['score'], c['metric'])}",
            f"{_score(plain['held_out'], c['metric'])} / {_score(pipeline['held_out'], c['metric'])}",
            f"{_gap_text(c['gap'], c['metric'])}, {_gap_text(c['held_out_gap'], c['metric'])}",
            (c["better"] or "neither") + diverged,
        ]
        out.append("| " + " | ".join(cells) + " |")
    if check:
        out += [
            "",
            (
                f"On the real clock: {check['frames']} samples of {check['stream']} at {check['rate']:.0f}/s "
                f"({check['optimizer']}, seed {check['seed']}):"
            ),
            "",
            "| contender | D | kept | the schedule's prediction |",
            "|---|---|---|---|",
        ]
        for got in check["contenders"]:
            note = " (diverged)" if got["diverged"] else ""
            out.append(f"| {got['contender']} | {got['depth']} | {got['kept']}{note} | {got['predicted']} |")
    return "\n".join(out) + "\n"


def _depth(comparison: dict[str, Any]) -> int:
    """The pipeline's depth of a comparison, written before the live view had depths or after."""
    return int(comparison.get("depth", LEGACY_DEPTH))


def _without_depth(label: str) -> str:
    """A pipeline's label without its ``D=n`` (``"D=2 stash + step-scale"`` -> ``"stash + step-scale"``)."""
    head, _, rest = label.partition(" ")
    return rest if head.startswith("D=") and rest else label


def _score(value: float | None, metric: str) -> str:
    if value is None:
        return "diverged"
    return f"{100 * value:.1f}%" if metric == "accuracy" else f"{value:.5f}"


def _gap_text(gap: float | None, metric: str) -> str:
    if gap is None:
        return "-"
    return f"{gap:+.1f}" + ("" if metric == "accuracy" else "%")


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Rolling test-then-train accuracy (digits) or loss (camera) against seconds of stream, on the
    first reported seed: a panel per stream (rows) and optimizer (columns), a line per contender
    and rate: the plain loop in black, the pipeline in a colour per depth (``PIPELINE_COLOURS``),
    a line style per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = list(dict.fromkeys(r["stream"] for r in rows))
    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))
    multiples = list(dict.fromkeys(r["multiple"] for r in rows))
    depths = sorted({r["depth"] for r in rows if r["contender"] != "plain"})
    seed = min(r["seed"] for r in rows)
    fig, axes = plt.subplots(
        len(streams),
        len(optimizers),
        figsize=(5 * len(optimizers) + 2.5, 3.6 * len(streams)),
        squeeze=False,
        layout="constrained",
    )
    for row in rows:
        if row["seed"] != seed or not row["history"]:
            continue
        ax = axes[streams.index(row["stream"])][optimizers.index(row["optimizer"])]
        seconds, values = zip(*row["history"])
        plain = row["contender"] == "plain"
        ax.plot(
            seconds,
            values,
            color=PLAIN_COLOUR if plain else PIPELINE_COLOURS[depths.index(row["depth"]) % len(PIPELINE_COLOURS)],
            linestyle=LINE_STYLES[multiples.index(row["multiple"]) % len(LINE_STYLES)],
            linewidth=1.5 if plain else 1,
            label=f"{'plain loop' if plain else 'D=' + str(row['depth'])}, {row['multiple']:g}× "
            f"({100 * row['kept'] / row['frames']:.0f}% kept)",
        )
    for (i, stream), (j, optimizer) in ((a, b) for a in enumerate(streams) for b in enumerate(optimizers)):
        ax = axes[i][j]
        ax.set_title(f"{OPTIMIZER_NAMES.get(optimizer, optimizer)}: {stream}", fontsize=9)
        ax.set_xlabel("seconds of stream")
        ax.set_ylabel("rolling loss" if stream == "camera" else "rolling accuracy")
        if stream == "camera":
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=6, ncols=2 if len(ax.lines) > 6 else 1)
    fig.suptitle(
        f"the plain loop (D = 1) against the pipeline with its defaults at D = {', '.join(map(str, depths))}, "
        f"seed {seed}",
        fontsize=10,
    )
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(
    rows: Sequence[dict[str, Any]],
    out_dir: Path,
    *,
    tuning: Sequence[dict[str, Any]] = (),
    times: Sequence[dict[str, Any]] = (),
    check: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """The rows, the runs that chose the step sizes, the times per sample and the real-clock
    check (JSON), the comparison (Markdown) and the plot (PNG) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = summarise(rows)
    comparisons = compare(lines)
    paths = {kind: out_dir / name for kind, name in FILES.items()}
    paths["json"].write_text(
        json.dumps(
            dict(
                runs=list(rows),
                summary=lines,
                comparisons=comparisons,
                tuning=list(tuning),
                times=list(times),
                check_real=check,
            ),
            indent=1,
        )
    )
    paths["markdown"].write_text(markdown(comparisons, times, check))
    plot(rows, paths["png"])
    return paths

"""What fidelity reports: the summary over seeds, its Markdown tables and the plot, and the files.

``summarise`` promises one line per stream and configuration with its gap to sequential;
``markdown`` and ``plot`` show them, ``write`` puts rows, summary and plot in a folder.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .fidelity_configs import Config, automatic


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per stream and configuration: the mean over seeds, and the gap to sequential,
    over the whole stream (``value``, ``gap``) and over its last quarter (``late_value``,
    ``late_gap``: what the delay still costs once the model has learnt most of what it will).

    The gap is in percentage points of accuracy (pipeline minus sequential) for the digits, and
    in percent of the sequential loss for the camera (positive: the pipeline's loss is higher).
    A run whose loss became non-finite counts as diverged: for accuracy its remaining samples
    count as misses; a loss over seeds with a diverged run is None.
    """
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row.get("optimizer", "sgd"), row["stream"], row["label"]), []).append(row)
    lines = []
    for (opt, stream, label), group in groups.items():
        key = "loss" if stream == "camera" else "accuracy"
        values = [r[key] for r in group]
        lines.append(
            dict(
                optimizer=opt,
                lr=group[0].get("lr"),
                stream=stream,
                label=label,
                depth=group[0]["depth"],
                balance=group[0].get("balance"),
                metric=key,
                value=_mean_or_none(values),
                spread=None if None in values else statistics.pstdev(values),
                late_value=_mean_or_none([r.get(f"late_{key}") for r in group]),
                seeds=len(group),
                diverged=sum(r.get("diverged_at") is not None for r in group),
            )
        )
    for line in lines:
        base = next(
            x
            for x in lines
            if x["stream"] == line["stream"] and x["optimizer"] == line["optimizer"] and x["depth"] == 1
        )
        line["gap"] = _gap(line["value"], base["value"], line["metric"])
        line["late_gap"] = _gap(line["late_value"], base["late_value"], line["metric"])
    return lines


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    """The mean over seeds; None if any seed has none (a diverged loss, a run with no last quarter)."""
    present = [v for v in values if v is not None]
    return None if len(present) < len(values) else statistics.mean(present)


def _gap(value: float | None, base: float | None, metric: str) -> float | None:
    """``value`` against sequential's ``base``: points of accuracy, or percent of the loss."""
    if value is None or base is None:
        return None
    if metric == "accuracy":
        return 100 * (value - base)
    return 100 * (value - base) / base


OPTIMIZER_NAMES = {"sgd": "SGD", "momentum": "SGD with momentum 0.9", "adam": "Adam"}


def default_label(depth: int, optimizer: str) -> str:
    """The label of what a ``Pipeline`` learns with by default (``stash``, ``"auto"``) at ``depth``."""
    return Config("digits", depth, "stash", automatic(optimizer)).label


def headline(lines: Sequence[dict[str, Any]]) -> str:
    """For each optimizer and depth, the gap of the best configuration of each stream (and which
    it is) and the gap of the default, as a Markdown table."""
    stream_names = list(dict.fromkeys(line["stream"] for line in lines))
    out = [
        "| optimizer | D | " + " | ".join(f"{s}: best | {s}: default" for s in stream_names) + " |",
        "|---|---|" + "---|---|" * len(stream_names),
    ]
    keys = dict.fromkeys((line["optimizer"], line["depth"]) for line in lines if line["depth"] > 1)
    for opt, depth in keys:
        cells = []
        for stream in stream_names:
            mine = [x for x in lines if (x["optimizer"], x["depth"], x["stream"]) == (opt, depth, stream)]
            scored = [x for x in mine if x["gap"] is not None]
            sign = 1 if stream != "camera" else -1  # accuracy: higher is better; loss: lower
            best = max(scored, key=lambda x: sign * x["gap"], default=None)
            default = next((x for x in mine if x["label"] == default_label(depth, opt)), None)
            cells.append("" if best is None else f"{_gap_text(best)} {best['label'].removeprefix(f'D={depth} ')}")
            cells.append("" if default is None else _gap_text(default))
        out.append(f"| {OPTIMIZER_NAMES.get(opt, opt)} | {depth} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _gap_text(line: dict[str, Any]) -> str:
    if line["gap"] is None:
        return "diverged"
    return f"{line['gap']:+.1f}" + ("%" if line["metric"] == "loss" else "")


def markdown(lines: Sequence[dict[str, Any]]) -> str:
    """The summary as Markdown: with several optimizers, the best configuration and the default
    at each depth, then a block for each optimizer, headed by its step sizes; in each, the table,
    a row per configuration, a column per stream."""
    optimizers = list(dict.fromkeys(line["optimizer"] for line in lines))
    if len(optimizers) == 1:
        return _table(lines)
    blocks = [
        "Gap to sequential at each depth: the best configuration, and the default "
        '(`stash`, `compensation="auto"`).\n\n' + headline(lines)
    ]
    for opt in optimizers:
        mine = [line for line in lines if line["optimizer"] == opt]
        lrs = ", ".join(f"{line['stream']} {line['lr']:g}" for line in mine if line["depth"] == 1)
        blocks.append(f"### {OPTIMIZER_NAMES.get(opt, opt)} (step size: {lrs})\n\n" + _table(mine))
    return "\n".join(blocks)


def _table(lines: Sequence[dict[str, Any]]) -> str:
    """One optimizer's summary as a Markdown table: a row per configuration, a column per stream."""
    stream_names = list(dict.fromkeys(line["stream"] for line in lines))
    labels = list(dict.fromkeys(line["label"] for line in lines))
    cell = {(line["stream"], line["label"]): line for line in lines}
    heads = {
        "digits": "moving digits: accuracy (gap, pp)",
        "shuffled": "shuffled digits: accuracy (gap, pp)",
        "camera": "panning camera: next-frame MSE (gap, %)",
    }
    out = [
        "| configuration | " + " | ".join(heads[s] for s in stream_names) + " |",
        "|---|" + "---|" * len(stream_names),
    ]
    depths = {line["label"]: line["depth"] for line in lines}
    optimizer = lines[0]["optimizer"]
    for label in labels:
        depth = depths[label]
        mark = " (default)" if depth > 1 and label == default_label(depth, optimizer) else ""
        cells = []
        for s in stream_names:
            line = cell.get((s, label))
            note = f", {line['diverged']}/{line['seeds']} diverged" if line and line["diverged"] else ""
            if line is None:
                cells.append("")
            elif line["value"] is None:
                cells.append(f"diverged ({line['diverged']}/{line['seeds']})")
            elif line["metric"] == "accuracy":
                cells.append(f"{100 * line['value']:.1f}% ({line['gap']:+.1f}{_late(line, '')}{note})")
            else:
                cells.append(f"{line['value']:.5f} ({line['gap']:+.1f}%{_late(line, '%')}{note})")
        out.append(f"| {label}{mark} | " + " | ".join(cells) + " |")
    if any(line.get("late_gap") is not None and line["depth"] > 1 for line in lines):
        out += ["", 'In brackets: the gap to sequential over the whole stream; after "end", over its last quarter.']
    cuts = {(line["stream"], line["depth"]): line["balance"] for line in lines if line["depth"] > 1 and line["balance"]}
    if cuts:
        out += ["", "Layers per stage: " + "; ".join(f"{s} D={d} {list(b)}" for (s, d), b in cuts.items()) + "."]
    return "\n".join(out) + "\n"


def _late(line: dict[str, Any], unit: str) -> str:
    """A table cell's last-quarter gap (``"; end -0.6"``); nothing for sequential or where there is none."""
    if line.get("late_gap") is None or line["depth"] == 1:
        return ""
    return f"; end {line['late_gap']:+.1f}{unit}"


MODE_COLOURS = {"partime": "tab:red", "stash": "tab:blue", "weight-stash": "tab:green"}
COMPENSATION_LINES = {
    "": "-",
    "lr-scale": "--",
    "weight-prediction": ":",
    "delay-correction": "-.",
    "optimizer-prediction": ":",
    "optimizer-prediction+long-momentum": (0, (5, 1, 1, 1, 1, 1)),
    "spike": "--",
    "step-scale": (0, (1, 3)),
    "step-scale+delay-correction": (0, (3, 1, 1, 1)),
    "step-scale+optimizer-prediction+long-momentum": (0, (6, 2)),
}


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Rolling test-then-train accuracy (digits) or loss (camera) over the stream, seed 0: a row of
    panels per optimizer and stream, one colour per grad mode, one line style per compensation,
    sequential in black."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r.get("optimizer", "sgd"), r["stream"]) for r in rows))
    depths = sorted({r["depth"] for r in rows if r["depth"] > 1})
    fig, axes = plt.subplots(
        len(panels),
        len(depths),
        figsize=(5 * len(depths) + 2.5, 3.6 * len(panels)),
        squeeze=False,
        sharex=True,
        layout="constrained",
    )
    for (i, (opt, stream)), (j, depth) in itertools.product(enumerate(panels), enumerate(depths)):
        ax = axes[i][j]
        for row in rows:
            if (
                (row.get("optimizer", "sgd"), row["stream"]) != (opt, stream)
                or row["seed"] != 0
                or row["depth"] not in (1, depth)
            ):
                continue
            xs = [k * row["frames"] / len(row["history"]) for k in range(len(row["history"]))]
            if row["depth"] == 1:
                style = dict(color="black", linewidth=2)
            else:
                style = dict(
                    color=MODE_COLOURS.get(row["grad_mode"]),
                    linewidth=1,
                    linestyle=COMPENSATION_LINES.get(row["compensation"], "-"),
                )
            ax.plot(xs, row["history"], label=row["label"].replace(f"D={depth} ", ""), **style)
        ax.set_title(f"{OPTIMIZER_NAMES.get(opt, opt)}: {stream}, D = {depth}", fontsize=9)
        ax.set_xlabel("sample")
        ax.set_ylabel("rolling loss" if stream == "camera" else "rolling accuracy")
        if stream == "camera":
            ax.set_yscale("log")
    handles: dict[str, Any] = {}
    for ax in axes.flat:  # the optimizers differ in their compensations: a legend of every line
        handles.update(zip(ax.get_legend_handles_labels()[1], ax.get_legend_handles_labels()[0]))
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(rows: Sequence[dict[str, Any]], out_dir: Path, tuning: Sequence[dict[str, Any]] = ()) -> dict[str, Path]:
    """The rows and the runs that chose the step sizes (JSON), the summary (Markdown) and the
    plot (PNG) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = summarise(rows)
    paths = {"json": out_dir / "fidelity.json", "markdown": out_dir / "fidelity.md", "png": out_dir / "fidelity.png"}
    paths["json"].write_text(json.dumps({"runs": list(rows), "summary": lines, "tuning": list(tuning)}, indent=1))
    paths["markdown"].write_text(markdown(lines))
    plot(rows, paths["png"])
    return paths

"""What fidelity reports: the summary over seeds, its Markdown tables and the plot, and the files.

``summarise`` promises one line per stream and configuration with its gap to sequential;
``own_step_summary`` the best configuration and the default of each optimizer, depth and stream
when each learnt at its own step size; ``markdown`` and ``plot`` show them, ``write`` puts rows,
summary and plot in a folder.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .configs import DEFAULT_GRAD_MODE, Config, automatic


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


OPTIMIZER_NAMES = {
    "sgd": "SGD",
    "momentum": "SGD with momentum 0.9",
    "adam": "Adam",
    "nadam": "NAdam β1 = 0.99",
    "muon": "Muon (AdamW for the rest)",
}


def default_label(depth: int, optimizer: str) -> str:
    """The label of what a ``Pipeline`` learns with by default (``DEFAULT_GRAD_MODE``,
    ``"auto"``) at ``depth``."""
    return Config("digits", depth, DEFAULT_GRAD_MODE, automatic(optimizer)).label


def _best_and_default(
    lines: Sequence[dict[str, Any]], optimizer: str, depth: int, stream: str
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Among ``lines``, the best configuration of one optimizer, depth and stream (the largest
    gain in accuracy, the smallest rise in loss; a diverged one never), and the default; None
    where there is none."""
    mine = [x for x in lines if (x["optimizer"], x["depth"], x["stream"]) == (optimizer, depth, stream)]
    sign = 1 if stream != "camera" else -1  # accuracy: higher is better; loss: lower
    best = max((x for x in mine if x["gap"] is not None), key=lambda x: sign * x["gap"], default=None)
    default = next((x for x in mine if x["label"] == default_label(depth, optimizer)), None)
    return best, default


def _depths(lines: Sequence[dict[str, Any]]) -> list[tuple[str, int]]:
    """Each (optimizer, depth) of the pipelines among ``lines``, in their order."""
    return list(dict.fromkeys((line["optimizer"], line["depth"]) for line in lines if line["depth"] > 1))


def headline(lines: Sequence[dict[str, Any]]) -> str:
    """For each optimizer and depth, the gap of the best configuration of each stream (and which
    it is) and the gap of the default, as a Markdown table."""
    stream_names = list(dict.fromkeys(line["stream"] for line in lines))
    out = [
        "| optimizer | D | " + " | ".join(f"{s}: best | {s}: default" for s in stream_names) + " |",
        "|---|---|" + "---|---|" * len(stream_names),
    ]
    for opt, depth in _depths(lines):
        cells = []
        for stream in stream_names:
            best, default = _best_and_default(lines, opt, depth, stream)
            cells.append("" if best is None else f"{_gap_text(best)} {best['label'].removeprefix(f'D={depth} ')}")
            cells.append("" if default is None else _gap_text(default))
        out.append(f"| {OPTIMIZER_NAMES.get(opt, opt)} | {depth} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def own_step_summary(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each optimizer, depth and stream of ``lines`` (each configuration at its own step
    size), sequential's step size and, for the best configuration and the default (None where
    there is none), its label, step size and gaps to sequential at sequential's step size."""
    stream_names = list(dict.fromkeys(line["stream"] for line in lines))
    out = []
    for (opt, depth), stream in itertools.product(_depths(lines), stream_names):
        base = next((x for x in lines if (x["optimizer"], x["stream"], x["depth"]) == (opt, stream, 1)), None)
        if base is None:
            continue
        best, default = _best_and_default(lines, opt, depth, stream)
        out.append(
            dict(
                optimizer=opt,
                depth=depth,
                stream=stream,
                sequential_lr=base["lr"],
                best=_chosen_step(best),
                default=_chosen_step(default),
            )
        )
    return out


def _chosen_step(line: dict[str, Any] | None) -> dict[str, Any] | None:
    """What ``own_step_summary`` keeps of a summary line: which it is, its step size, its gaps."""
    if line is None:
        return None
    return {key: line[key] for key in ("label", "lr", "metric", "gap", "late_gap", "seeds", "diverged")}


def own_step_table(lines: Sequence[dict[str, Any]]) -> str:
    """``own_step_summary`` as a Markdown table: a row per optimizer and depth; for each stream,
    sequential's step size, and the gap and step size of the best configuration and the default."""
    summary = own_step_summary(lines)
    stream_names = list(dict.fromkeys(x["stream"] for x in summary))
    out = [
        "| optimizer | D | " + " | ".join(f"{s}: sequential | {s}: best | {s}: default" for s in stream_names) + " |",
        "|---|---|" + "---|---|---|" * len(stream_names),
    ]
    cell = {(x["optimizer"], x["depth"], x["stream"]): x for x in summary}
    for opt, depth in dict.fromkeys((x["optimizer"], x["depth"]) for x in summary):
        cells = []
        for stream in stream_names:
            x = cell.get((opt, depth, stream))
            if x is None:
                cells += ["", "", ""]
                continue
            best, default = x["best"], x["default"]
            cells.append(f"lr {x['sequential_lr']:g}")
            label = "" if best is None else " " + best["label"].removeprefix(f"D={depth} ")
            cells.append("" if best is None else f"{_gap_text(best)}{label} (lr {best['lr']:g})")
            cells.append("" if default is None else f"{_gap_text(default)} (lr {default['lr']:g})")
        out.append(f"| {OPTIMIZER_NAMES.get(opt, opt)} | {depth} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _gap_text(line: dict[str, Any]) -> str:
    if line["gap"] is None:
        return "diverged"
    return f"{line['gap']:+.1f}" + ("%" if line["metric"] == "loss" else "")


def markdown(lines: Sequence[dict[str, Any]], own_step: bool = False) -> str:
    """The summary as Markdown: with several optimizers, the best configuration and the default
    at each depth, then a block for each optimizer, headed by its step sizes; in each, the table,
    a row per configuration, a column per stream. With ``own_step`` (each configuration learnt at
    its own step size), the table "each at its own best step" (``own_step_table``) comes first,
    and each cell of the blocks names its step size."""
    optimizers = list(dict.fromkeys(line["optimizer"] for line in lines))
    default = f'(`{DEFAULT_GRAD_MODE}`, `compensation="auto"`)'
    if own_step:
        blocks = [
            "## Each at its own best step\n\nGap to sequential at each depth, each configuration and "
            "sequential at its own best step size (chosen on the tuning seed, reported on the others): "
            f"the best configuration, and the default {default}.\n\n" + own_step_table(lines)
        ]
    elif len(optimizers) == 1:
        return _table(lines)
    else:
        blocks = [f"Gap to sequential at each depth: the best configuration, and the default {default}.\n\n"]
        blocks[0] += headline(lines)
    for opt in optimizers:
        mine = [line for line in lines if line["optimizer"] == opt]
        lrs = ", ".join(f"{line['stream']} {line['lr']:g}" for line in mine if line["depth"] == 1)
        steps = f"each at its own step size; sequential: {lrs}" if own_step else f"step size: {lrs}"
        blocks.append(f"### {OPTIMIZER_NAMES.get(opt, opt)} ({steps})\n\n" + _table(mine, own_step))
    return "\n".join(blocks)


def _table(lines: Sequence[dict[str, Any]], own_step: bool = False) -> str:
    """One optimizer's summary as a Markdown table: a row per configuration, a column per stream
    (with ``own_step``, each cell names its step size)."""
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
            step = f" at lr {line['lr']:g}" if line and own_step else ""
            if line is None:
                cells.append("")
            elif line["value"] is None:
                cells.append(f"diverged ({line['diverged']}/{line['seeds']}){step}")
            elif line["metric"] == "accuracy":
                cells.append(f"{100 * line['value']:.1f}% ({line['gap']:+.1f}{_late(line, '')}{note}){step}")
            else:
                cells.append(f"{line['value']:.5f} ({line['gap']:+.1f}%{_late(line, '%')}{note}){step}")
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


MODE_COLOURS = {"partime": "tab:red", "stash": "tab:blue", "weight-stash": "tab:green", "graph-stash": "tab:purple"}
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
    """Rolling test-then-train accuracy (digits) or loss (camera) over the stream, the first seed of
    ``rows``: a row of panels per optimizer and stream, one colour per grad mode, one line style
    per compensation, sequential in black. Rows kept without their history are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r.get("optimizer", "sgd"), r["stream"]) for r in rows))
    depths = sorted({r["depth"] for r in rows if r["depth"] > 1})
    first = min(r["seed"] for r in rows)
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
                or not row.get("history")
                or row["seed"] != first
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


def write(
    rows: Sequence[dict[str, Any]], out_dir: Path, tuning: Sequence[dict[str, Any]] = (), own_step: bool = False
) -> dict[str, Path]:
    """The rows and the runs that chose the step sizes (JSON), the summary (Markdown) and the
    plot (PNG) in ``out_dir``; with ``own_step`` (each configuration at its own step size), the
    JSON holds ``own_step_summary`` too, under ``"own_step"``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = summarise(rows)
    paths = {"json": out_dir / "fidelity.json", "markdown": out_dir / "fidelity.md", "png": out_dir / "fidelity.png"}
    data: dict[str, Any] = {"runs": list(rows), "summary": lines, "tuning": list(tuning)}
    if own_step:
        data["own_step"] = own_step_summary(lines)
    paths["json"].write_text(json.dumps(data, indent=1))
    paths["markdown"].write_text(markdown(lines, own_step))
    plot(rows, paths["png"])
    return paths

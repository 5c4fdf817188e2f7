"""How much learning with delay costs: each stream, sequential against D-stage pipelines.

Every configuration (a stream, an optimizer and its step size, a depth D, a grad mode, a
compensation, a seed) learns online, test-then-train, through the ``inline`` executor: the
numbers are those of a real D-stage pipeline (the executors are tested equal), but the run
measures learning, not hardware, and needs one core. D = 1 is sequential online learning. Each run is scored over the whole stream
and over its last quarter alone: the first says what the delay costs in all, the second what it
still costs once most has been learnt.

The cut at each depth is, by default, the one a ``Pipeline`` given ``balance=D`` chooses when it
learns (``delay_cut``: as fast as the fastest cut within 10%, with the fewest weights delayed),
planned once per model and depth so that every run at that depth uses the same cut; ``cut="even"``
gives each stage the same number of layers instead, to show what the choice of cut is worth.

Each optimizer (``OPTIMIZERS``: plain SGD, SGD with momentum 0.9, Adam) learns each stream at the
step size of ``LR_GRID`` that suits sequential learning of it best on ``TUNING_SEED``
(``tuning_configs``, ``best_step_sizes``), so that a pipeline is held to a well-tuned baseline.

Streams:
- ``digits``: ``streams.moving_digits``, a small CNN classifying each frame (accuracy);
- ``shuffled``: the same frames in i.i.d. order, where the smoothness bet does not hold;
- ``camera``: ``streams.panning_camera``, a small convolutional net predicting the next frame
  (loss: mean squared error; the pair (frame, next frame) travels through the stages as a tuple
  and the loss takes only the output).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from .. import lookahead, streams
from ..compensation import AUTOMATIC
from ..errors import StageError
from ..metrics import OnlineMetrics
from ..partition import plan
from ..pipeline import Pipeline

log = logging.getLogger(__name__)

STREAMS = ("digits", "shuffled", "camera")
GRAD_MODES = ("partime", "stash", "weight-stash")
HOLD, BATCH = 10, 4  # digits: each digit held 10 frames; 4 independent streams per sample
OPTIMIZERS = ("sgd", "momentum", "adam")
LR_GRID = {
    "sgd": (0.03, 0.1, 0.3, 1.0, 3.0),
    "momentum": (0.003, 0.01, 0.03, 0.1, 0.3),
    "adam": (3e-4, 1e-3, 3e-3, 1e-2),
}
"""The step sizes tried for sequential learning; each stream and optimizer learns with its best."""
TUNING_SEED = 0
"""The seed whose sequential runs choose the step size."""
DIGITS_LR = 0.07  # plain SGD's best step size for sequential learning of moving digits
# The compensations each grad mode is measured with ("+" joins options used together), beside what
# the default, compensation="auto", chooses for the optimizer. The optimizer-aware options need the
# optimizer's momentum (plain SGD has none, and its prediction is its weights), and with a
# prediction both stash modes compute the same (the predicted weights are stashed).
COMPENSATIONS = {
    "partime": ("",),
    "weight-stash": ("", "delay-correction"),
    "stash": (
        "",
        "delay-correction",
        "step-scale",
        "optimizer-prediction",
        "optimizer-prediction+long-momentum",
        "spike",
    ),
}
CUTS = ("planned", "even")


def automatic(optimizer: str) -> str:
    """What ``compensation="auto"`` chooses for ``optimizer``, as a fidelity compensation."""
    return "+".join(AUTOMATIC[optimizer])


def compensations(grad_mode: str, optimizer: str) -> tuple[str, ...]:
    """The compensations measured with ``grad_mode`` under ``optimizer`` (with ``stash``, the
    default's choice among them)."""
    names = [
        c
        for c in COMPENSATIONS[grad_mode]
        if optimizer != "sgd" or not any(option in lookahead.OPTIONS for option in c.split("+"))
    ]
    if grad_mode == "stash":
        names.append(automatic(optimizer))
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class Config:
    """One run: a stream learnt by a D-stage pipeline (D = 1: sequential)."""

    stream: str
    depth: int
    grad_mode: str = "partime"
    compensation: str = ""
    seed: int = 0
    balance: tuple[int, ...] | None = None  # layers per stage; None: even
    optimizer: str = "sgd"
    lr: float = DIGITS_LR

    @property
    def label(self) -> str:
        if self.depth == 1:
            return "sequential"
        return f"D={self.depth} {self.grad_mode}" + "".join(f" + {c}" for c in self.compensation.split("+") if c)


class Carry(nn.Module):
    """Applies ``module`` to the first tensor of a tuple and carries the others along."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return (self.module(value[0]), *value[1:])


def next_frame_error(output: tuple[Tensor, Tensor]) -> Tensor:
    """The camera's loss: the predicted frame against the next frame that travelled beside it."""
    predicted, actual = output
    return nn.functional.mse_loss(predicted, actual)


def digits_model() -> nn.Sequential:
    """A small CNN for 24 × 24 digits, ten top-level layers."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 6 * 6, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def camera_model() -> nn.Sequential:
    """A small convolutional next-frame predictor for 3 × 16 × 16 frames, eight layers."""
    layers = [
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 3, 3, padding=1),
        nn.Sigmoid(),
    ]
    return nn.Sequential(*(Carry(layer) for layer in layers))


def even_balance(layers: int, depth: int) -> list[int]:
    """Layers per stage, as even as possible, the larger stages first."""
    base, extra = divmod(layers, depth)
    return [base + (i < extra) for i in range(depth)]


def _stream(config: Config, frames: int) -> tuple[Iterator[Any], Iterator[Any] | None]:
    if config.stream == "camera":
        pairs = streams.next_frame_pairs(streams.panning_camera(frames + 1, seed=config.seed, size=16, batch=BATCH))
        return iter(pairs), None
    make = streams.moving_digits if config.stream == "digits" else streams.shuffled_digits
    data = make(frames, seed=config.seed, hold=HOLD, batch=BATCH)
    xs, ys = itertools.tee(data)
    return (x for x, _ in xs), (y for _, y in ys)


def run(config: Config, frames: int) -> dict[str, Any]:
    """Learn ``frames`` samples of the stream under ``config``; the scores and their history."""
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    camera = config.stream == "camera"
    model = camera_model() if camera else digits_model()
    loss_fn = next_frame_error if camera else nn.CrossEntropyLoss()
    optimizer = optimizer_factory(config.optimizer, config.lr)
    xs, ys = _stream(config, frames)
    targets: list[Tensor] = []
    if ys is not None:
        ys = _recording(ys, targets)
    metrics = OnlineMetrics(window=500)
    late = OnlineMetrics(window=500)  # the last quarter of the stream: what the delay costs once learnt
    late_frames = frames // 4
    late_from = frames - late_frames
    diverged_at = None
    balance = list(config.balance) if config.balance else even_balance(len(model), config.depth)
    with Pipeline(
        model,
        balance,
        executor="inline",
        loss_fn=loss_fn,
        optimizer=optimizer,
        grad_mode=config.grad_mode,
        compensation=tuple(config.compensation.split("+")) if config.compensation else (),
    ) as pipe:
        try:
            for result in pipe.stream(xs, ys):
                # test-then-train: the output was computed before this sample's gradient was applied
                target = targets[result.index] if targets else None
                # Never skipped (nonfinite="raise"): the model's output, a tensor (the camera model's, a tuple).
                output = cast(tuple[Tensor, ...], result.output)[0] if camera else cast(Tensor, result.output)
                metrics.update(output, target, result.loss)
                if result.index >= late_from:
                    late.update(output, target, result.loss)
        except StageError as exc:
            if "not finite" not in exc.message:
                raise
            diverged_at = exc.sample  # learning blew up: a result of its own, not a failure of the run
    history = metrics.history()["rolling_loss" if camera else "rolling_accuracy"]
    accuracy = late_accuracy = None
    if not camera:  # the samples after a divergence count as misses
        accuracy = _share_correct(metrics, frames)
        if late_frames:  # under 4 frames there is no last quarter
            late_accuracy = _share_correct(late, late_frames)
    diverged = diverged_at is not None
    return dict(
        asdict(config),
        balance=balance,
        label=config.label,
        frames=frames,
        accuracy=accuracy,
        loss=None if diverged else metrics.loss,
        late_accuracy=late_accuracy,
        late_loss=None if diverged or not late.count else late.loss,
        diverged_at=diverged_at,
        history=history[:: max(1, len(history) // 200)],
    )


def optimizer_factory(name: str, lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> optimizer`` for one of ``OPTIMIZERS``: plain SGD, SGD with momentum 0.9, Adam."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def _share_correct(metrics: OnlineMetrics, frames: int) -> float:
    """The share of the ``frames × BATCH`` rows that ``metrics`` scored correct (unscored rows are misses)."""
    return metrics.accuracy * metrics.rows / (frames * BATCH) if metrics.rows else 0.0


def _recording(ys: Iterator[Tensor], into: list[Tensor]) -> Iterator[Tensor]:
    for y in ys:
        into.append(y)
        yield y


def cut(stream: str, depth: int, how: str = "planned") -> tuple[int, ...]:
    """Layers per stage of the stream's model at ``depth``: ``"planned"`` as a learning
    ``Pipeline(balance=depth)`` would cut it (timed on one thread on a sample of the stream), or
    ``"even"``, the same number of layers in each stage (the larger stages first)."""
    if how not in CUTS:
        raise ValueError(f"unknown cut {how!r}; choose from {', '.join(CUTS)}")
    model = camera_model() if stream == "camera" else digits_model()
    if how == "even":
        return tuple(even_balance(len(model), depth))
    xs, _ = _stream(Config(stream, depth), 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return plan(model, depth, next(xs), learning=True).balance
    finally:
        torch.set_num_threads(threads)


StepSizes = dict[tuple[str, str], float]
"""The step size of each (stream, optimizer)."""


def tuning_configs(stream_names: Sequence[str], optimizers: Sequence[str]) -> list[Config]:
    """Sequential learning of each stream with each optimizer at every step size of its grid."""
    return [
        Config(stream, 1, seed=TUNING_SEED, optimizer=opt, lr=lr)
        for stream in stream_names
        for opt in optimizers
        for lr in LR_GRID[opt]
    ]


def best_step_sizes(rows: Sequence[dict[str, Any]]) -> StepSizes:
    """For each (stream, optimizer) among ``rows``, the step size whose run scored best (a
    diverged run never wins): the highest accuracy, or the lowest loss on the camera."""
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for row in rows:
        key = (row["stream"], row["optimizer"])
        if row["stream"] == "camera":
            score = -row["loss"] if row["loss"] is not None else -math.inf
        else:
            score = row["accuracy"] if row["diverged_at"] is None else -math.inf
        if key not in best or score > best[key][0]:
            best[key] = (score, row["lr"])
    return {key: lr for key, (_, lr) in best.items()}


def configs(
    stream_names: Sequence[str],
    depths: Sequence[int],
    seeds: int,
    how: str = "planned",
    step_sizes: StepSizes | None = None,
) -> list[Config]:
    """Sequential, and every grad mode and its compensations at each depth, for each seed and
    each optimizer of ``step_sizes`` (default: plain SGD at ``DIGITS_LR``); every run of one model
    at one depth cut the same way (``cut``): the shuffled control as moving digits."""
    step_sizes = step_sizes or {(stream, "sgd"): DIGITS_LR for stream in stream_names}
    models = {stream: "camera" if stream == "camera" else "digits" for stream in stream_names}
    cuts = {(model, depth): cut(model, depth, how) for model in dict.fromkeys(models.values()) for depth in depths}
    out = []
    for (stream, opt), lr in step_sizes.items():
        for seed in range(seeds):
            out.append(Config(stream, 1, seed=seed, optimizer=opt, lr=lr))
            for depth, mode in itertools.product(depths, GRAD_MODES):
                for comp in compensations(mode, opt):
                    out.append(Config(stream, depth, mode, comp, seed, cuts[models[stream], depth], opt, lr))
    return out


def run_all(
    cfgs: Sequence[Config], frames: int, jobs: int = 1, progress: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Every run, ``jobs`` at a time in worker processes; rows in the order of ``cfgs``."""
    rows: list[dict[str, Any]] = []
    if jobs <= 1:
        for config in cfgs:
            rows.append(run(config, frames))
            if progress:
                progress(rows[-1])
        return rows
    with ProcessPoolExecutor(jobs) as pool:
        for row in pool.map(run, cfgs, itertools.repeat(frames)):
            rows.append(row)
            if progress:
                progress(row)
    return rows


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

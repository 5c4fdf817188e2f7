"""The results pages of the documentation site (docs/results/), made from the experiments' JSON.

Two steps::

    .venv/bin/python experiments/results_pages.py summarise   # big JSON -> small committed JSON and images
    .venv/bin/python experiments/results_pages.py             # small JSON -> docs/results/*.md

``summarise`` needs the full output of ``partime fidelity`` and ``partime fidelity --live``
(``experiments/learning/fidelity.json``, ``live-2026-12-04.json``: megabytes of per-run curves,
not committed). It keeps what the pages show (the summary lines, the comparisons, the times per
sample) in ``*-summary.json`` beside them, and makes the site's pictures under 200 KB from the
plots those runs wrote (the same picture, with fewer colours, and smaller where it must be).

The default step writes ``speed.md``, ``fidelity.md``, ``live.md`` and ``soak.md`` from committed
JSON only (``--out`` elsewhere: ``tests/test_results_pages.py`` checks that the committed pages
are what this writes), and copies the speed and soak pictures beside them. The tables are the
tools' own: ``experiments/speed/tables.py`` for the bench, ``partime_tools.fidelity.report`` and
``live_report`` for fidelity and the live view.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

from partime_tools.fidelity import live_report, report

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SPEED = HERE / "speed"
LEARNING = HERE / "learning"
SOAK = HERE / "soak"
OUT = ROOT / "docs" / "results"
MAX_BYTES = 200_000


def _load(name: str, path: Path) -> ModuleType:
    """A script of the experiments, loaded from beside its data."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _load("speed_tables", SPEED / "tables.py")
"""The bench's tables."""
optimizer_tables = _load("optimizer_tables", LEARNING / "optimizers_table.py")
"""Every optimizer's best configuration beside the best sequential learner."""

# What made each page's data, where its JSON does not record it.
VM = "the project's 2-core x86_64 VM without GPU, torch 2.13.0 (CPU build), nothing else running"
SOURCES = {
    "speed": {
        "inference": "`partime bench --sizes --infer` (2026-12-02), `experiments/speed/sweep-inference.json`",
        "learning": "`partime bench --sizes --learn --optimizer sgd,adam` (2026-12-03), `experiments/speed/learning.json`",
        "torch": "`benchmarks/torch_pipelining.py` (2026-12-02), `experiments/speed/torch_pipelining.json`",
        "floor": (
            "`partime bench --sizes 12,24,48 --learn --optimizer sgd,adam --rounds 3` and "
            "`partime bench --sizes 12,24,48,96 --infer --rounds 3` (2026-12-04, a day the VM ran about twice "
            "as slow as on the days above and wandered by ±20–30 % between rounds), "
            "`experiments/speed/learning-floor.json` and `experiments/speed/inference-floor.json`"
        ),
    },
    "fidelity": "`partime fidelity --own-step --depths 2` (with SGD, and with momentum and Adam) and "
    "`partime fidelity --own-step --depths 4` (2026-12-02; the exact commands are in "
    "`experiments/learning/fidelity-own-step.md`)",
    "live": "`partime fidelity --live --optimizer sgd,momentum,adam,nadam,muon --depths 2,4,8 --rates 2 "
    "--times experiments/learning/live-times.json --out experiments/learning/live-measured` (2026-12-04; the times "
    "measured first, with nothing else running, by the same command with `--frames 10 --seeds 1 --rates 1.5` and "
    "no `--times`)",
    "live-bound": "the same with `--times 8,4,2,1 --out experiments/learning/live-bound` (2026-12-04)",
    "soak": "`partime soak --out experiments/soak` (100,000 samples for inference, 20,000 for learning; 2026-12-04)",
}
SUMMARIES = {  # full JSON -> the keys its summary keeps
    "live": (LEARNING / "live-measured" / "live.json", ("summary", "comparisons", "times", "check_real")),
    "live-bound": (LEARNING / "live-bound" / "live.json", ("summary", "comparisons", "times", "check_real")),
}
PLOTS = {  # not committed: over 200 KB
    "fidelity": LEARNING / "fidelity.png",
    "live": LEARNING / "live-measured" / "live.png",
    "live-bound": LEARNING / "live-bound" / "live.png",
}


def summary_path(name: str) -> Path:
    """Where ``summarise`` writes the compact JSON of ``name`` (``fidelity`` or ``live``)."""
    return LEARNING / f"{name}-summary.json"


def summarise() -> None:
    """From the full JSON and plots (not committed), the compact JSON and the site's pictures."""
    from PIL import Image

    for name, (full, keys) in SUMMARIES.items():
        data = json.loads(full.read_text())
        summary_path(name).write_text(json.dumps({k: data[k] for k in keys}, indent=1) + "\n")
    for name, png in PLOTS.items():
        image = Image.open(png).convert("RGB")
        while True:  # fewer colours first; then smaller, until the picture fits
            buffer = io.BytesIO()
            image.quantize(colors=64).save(buffer, "PNG", optimize=True)
            if buffer.tell() <= MAX_BYTES:
                break
            image = image.resize((image.width * 4 // 5, image.height * 4 // 5), Image.LANCZOS)
        (OUT / f"{name}.png").write_bytes(buffer.getvalue())


def over_bound(rows: list[dict[str, Any]]) -> str:
    """``process D=2``'s time per sample over the bound at each frame size, as text."""
    mine = sorted((r["size"], r["ms_over_bound"]) for r in rows if r["contender"] == "process D=2")
    return ", ".join(f"{ratio:.2f}× at {size} px" for size, ratio in mine)


def floor_table(rows: list[dict[str, Any]]) -> str:
    """Per mode, optimizer and frame size: the bound, the Python floor and ``process D=2``, in ms per
    sample, with the pipeline's time over each and its speed-up over the plain loop."""
    lines = [
        "| run | frames | bound, ms | floor, ms | process D=2, ms | ÷ bound | ÷ floor | × plain loop (1 thread / 2 threads) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    pipelines = [r for r in rows if r["contender"] == "process D=2"]
    for r in sorted(pipelines, key=lambda r: (r["mode"], r.get("optimizer") or "", r["size"])):
        run = r["mode"] + (f", {r['optimizer']}" if r.get("optimizer") else "")
        lines.append(
            f"| {run} | {r['size']} × {r['size']} | {r['bound_ms']:.2f} | {r['floor_ms']:.2f} | "
            f"{r['ms_per_sample']:.2f} | {r['ms_over_bound']:.2f} | {r['ms_over_floor']:.2f} | "
            f"{r['speedup_vs_seq_1thread']:.2f} / {r['speedup_vs_seq_allcores']:.2f} |"
        )
    return "\n".join(lines)


def speed_page() -> str:
    """The bench's tables: inference and learning by frame size, and torch's pipelining beside them."""
    out = [
        "# Speed",
        "",
        (
            f"Measured on {VM}. Each figure is the median over rounds of the median time per sample over "
            "5 blocks of 300 frames, after 20 of warm-up. A pipeline's cell gives its speed-up over the "
            "plain model on one thread, then its time per sample over the **bound** (the slowest of the "
            "model's own pieces of the cut, alone with plain torch) and over **partime's own tick** (the "
            "slowest stage alone as partime's `Stage` runs it). The bench's model is `conv3_net` "
            "(8 × Conv3×3, 24 channels), cut at D = 2."
        ),
        "",
        "![speed-up against stage time](sweep-inference.png)",
    ]
    pipelines = []
    for key, name in (("inference", "sweep-inference.json"), ("learning", "learning.json")):
        rows = json.loads((SPEED / name).read_text())
        out += ["", f"Data: {SOURCES['speed'][key]}."]
        for mode, optimizer in sorted({(r["mode"], r.get("optimizer") or "") for r in rows}):
            mine = [r for r in rows if r["mode"] == mode and (r.get("optimizer") or "") == optimizer]
            with_ = f" with {optimizer}" if optimizer else ""
            pipelines.append((f"{mode}{with_}", mine))
            out += [
                "",
                f"## {mode.capitalize()}{with_}: speed-up over the sequential model on 1 thread",
                "",
                tables.speed_table(mine),
                "",
                tables.latency_table(mine),
            ]
    floor_rows = [
        row
        for name in ("learning-floor.json", "inference-floor.json")
        for row in json.loads((SPEED / name).read_text())
    ]
    out += [
        "",
        "## Against the Python floor",
        "",
        (
            "The **Python floor** (`benchmarks/python_floor.py`) is the simplest Python pipeline that does "
            "the work of partime's default on the same cut: a process per stage but the last, shared-memory "
            "rings with semaphores, one forward per sample with its graph kept for the late gradient, the "
            "optimizer's plain step, no compensation and no checks. The bench times it in the same rounds "
            f'as every pipeline. Data: {SOURCES["speed"]["floor"]}. Below 1 in "÷ floor": partime is faster.'
        ),
        "",
        floor_table(floor_rows),
    ]
    torch_rows = json.loads((SPEED / "torch_pipelining.json").read_text())
    out += [
        "",
        "## torch.distributed.pipelining",
        "",
        (
            f"Data: {SOURCES['speed']['torch']}. Speed-up over the sequential model on 1 thread, per schedule "
            "and number of microbatches (a microbatch is a sample: the schedules wait for a whole batch)."
        ),
        "",
        tables.torch_table(torch_rows),
        "",
        "## Reading",
        "",
        "A D = 2 process pipeline's time per sample over the bound, by frame size: "
        + "; ".join(f"{label} {over_bound(rows)}" for label, rows in pipelines)
        + ". The gap to the bound is the tick around the stages: largest at the smallest stages, a few "
        "percent at stages of several milliseconds. The experiments behind these figures, and the ones "
        "on where the caller's time goes, are indexed in `experiments/README.md` (speed).",
    ]
    return "\n".join(out) + "\n"


def default_gaps(lines: list[dict[str, Any]]) -> list[str]:
    """Per optimizer and stream, the default configuration's gap at each depth, as text."""
    out = []
    for optimizer in dict.fromkeys(line["optimizer"] for line in lines):
        for stream in dict.fromkeys(line["stream"] for line in lines):
            gaps = [
                f"{line['gap']:+.1f}{'%' if line['metric'] == 'loss' else ''}"
                if line["gap"] is not None
                else "diverged"
                for line in lines
                if (line["optimizer"], line["stream"]) == (optimizer, stream)
                and line["depth"] > 1
                and line["label"] == report.default_label(line["depth"], optimizer)
            ]
            out.append(f"{report.OPTIMIZER_NAMES.get(optimizer, optimizer)} on {stream} {', '.join(gaps)}")
    return out


FIDELITY = ("own-step-d2-sgd.json", "own-step-d2-momentum-adam.json", "own-step-d4.json")
OPTIMIZER_SWEEP = LEARNING / "optimizers" / "rows.jsonl"
"""The rows of ``optimizers_sweep.py``: NAdam and Muon at D = 2, 4 and 8, every optimizer at D = 8."""


def optimizer_sweep_rows() -> list[dict[str, Any]]:
    """The reported runs of ``OPTIMIZER_SWEEP``."""
    rows = [json.loads(line) for line in OPTIMIZER_SWEEP.read_text().splitlines()]
    return [row for row in rows if row["phase"] == "reported"]


def fidelity_lines() -> list[dict[str, Any]]:
    """The summary lines of the own-step runs: every line at D = 2, and the deeper lines of the others."""
    lines: list[dict[str, Any]] = []
    for i, name in enumerate(FIDELITY):
        summary = json.loads((LEARNING / name).read_text())["summary"]
        lines += [line for line in summary if line["depth"] == 2 or (i and line["depth"] > 2) or line["depth"] == 1]
    lines += report.summarise(optimizer_sweep_rows())
    seen: set[tuple[str, str, int]] = set()  # sequential comes once per optimizer and stream: the first run's
    unique = []
    for line in lines:
        key = (line["optimizer"], line["stream"], line["depth"], line["label"])
        if key not in seen:
            seen.add(key)
            unique.append(line)
    return unique


def optimizer_page_section() -> str:
    """Every optimizer's best configuration at each depth, against the best sequential learner of any optimizer."""
    results = {**optimizer_tables.REFERENCE, **optimizer_tables.measured(str(OPTIMIZER_SWEEP))}
    depths = sorted({depth for (_, _, depth) in results if depth > 1})
    return (
        "## Which optimizer under delay\n\n"
        "NAdam and Muon, and every optimizer at D = 8, from `experiments/learning/optimizers_sweep.py`; "
        "SGD, momentum and Adam at D = 2 and 4 from the runs above and the remedies of "
        "`experiments/learning/fidelity-own-step.md` (`optimizers_table.py` holds them).\n\n"
        + "\n\n".join(optimizer_tables.table(results, depth) for depth in depths)
        + "\n"
    )


def fidelity_page() -> str:
    """What learning with delay costs against sequential learning, each at its own best step size."""
    lines = fidelity_lines()
    return (
        "# Learning fidelity\n\n"
        f"Data: {SOURCES['fidelity']}; "
        + ", ".join(f"`experiments/learning/{name}`" for name in FIDELITY)
        + "; NAdam and Muon, and every optimizer at D = 8: `experiments/learning/optimizers_sweep.py` "
        "(2026-12-04; `experiments/learning/optimizers.md`), `experiments/learning/optimizers/rows.jsonl`"
        + ". Every run goes through the inline executor, so the figures do not depend on the machine. "
        "Each configuration, and sequential learning (D = 1), learns at the step size of its "
        "optimizer's grid that scored best on seed 0, and is reported as the mean over seeds 1 and 2, "
        "3000 samples each, scored test-then-train; the gap is in points of accuracy (digits) or in "
        "percent of sequential's loss (camera).\n\n"
        + report.markdown(lines, own_step=True)
        + "\n"
        + optimizer_page_section()
        + "\n## The full sweep\n\n"
        "Every grad mode and compensation at D = 2, 4 and 8, at sequential's step size "
        "(`partime fidelity --optimizer sgd,momentum,adam`, 2026-12-01, when the default grad mode was "
        "`stash`; `experiments/learning/fidelity.md`): rolling score over the stream, first seed.\n\n"
        "![rolling score over the stream, first seed](fidelity.png)\n"
        + "\n## Reading\n\n"
        + "The default's gap to sequential learning at D = 2, then 4 (and 8 where measured), each at its own step size: "
        + "; ".join(default_gaps(lines))
        + ". Later runs of the camera at fidelity's fixed cuts, and the remedies tried and not kept, are "
        "in `experiments/learning/fidelity-own-step.md` and `experiments/measured-and-not-kept.md`.\n"
    )


def live_page() -> str:
    """The live view: the plain loop against pipelines of 2, 4 and 8 stages on a stream faster than
    the plain loop, with the times measured here and with the times of the pipelines' bound."""
    measured = json.loads(summary_path("live").read_text())
    bound = json.loads(summary_path("live-bound").read_text())
    ratios: dict[int, list[float]] = {}
    for t in measured["times"]:
        ratios.setdefault(t["depth"], []).append(t["pipeline_ms"] / t["plain_ms"])
    spans = ", ".join(f"{min(r):.2f}–{max(r):.2f} at D = {d}" for d, r in sorted(ratios.items()))
    return (
        "# Live view\n\n"
        "A stream arrives at twice the rate the plain loop keeps up with; each learner (the plain loop, "
        "and a pipeline of D = 2, 4 and 8 stages with its defaults) takes the samples it is free for, "
        "skips the rest, and learns from what it took at its own best step size (chosen on seed 0, "
        "reported on seeds 1 and 2). What each keeps follows from its time per learning sample; what "
        "it learns goes through the inline executor, so the learning does not depend on the machine.\n\n"
        "## With the times of this machine\n\n"
        f"Data: {SOURCES['live']}, on {VM}; summarised in `experiments/learning/live-summary.json` "
        "(`experiments/results_pages.py summarise`).\n\n"
        "![the live view with this machine's times: rolling score against seconds of stream](live.png)\n\n"
        + live_report.markdown(measured["comparisons"], measured["times"], measured["check_real"])
        + "\n## At the pipelines' bound\n\n"
        f"Data: {SOURCES['live-bound']}; summarised in `experiments/learning/live-bound-summary.json`. "
        "Each pipeline learns a sample in 1 / D of the plain loop's time, as on a machine with a core per "
        "stage where the pipeline reaches its bound: what the delay costs against what keeping more "
        "samples gains.\n\n"
        "![the live view at the bound: rolling score against seconds of stream](live-bound.png)\n\n"
        + live_report.markdown(bound["comparisons"], bound["times"], bound["check_real"])
        + "\n## Reading\n\n"
        + "On this machine's two cores and these small models a pipeline's time per learning sample is "
        f"{spans} of the plain loop's: at D = 2 it keeps about as many samples as the plain loop, deeper "
        f"ones fewer. On the held-out samples {_wins(measured['comparisons'])}. At the bound, where every "
        f"pipeline keeps every sample and the plain loop half, {_wins(bound['comparisons'])}: keeping twice "
        "the samples outweighs the delay at D = 2 on most streams and optimizers, less often at D = 4, "
        "and at D = 8 mostly on the shuffled control.\n"
    )


def _wins(comparisons: list[dict[str, Any]]) -> str:
    """In how many comparisons the pipeline did better, at each depth, as text."""
    depths = sorted({c["depth"] for c in comparisons})
    parts = []
    for depth in depths:
        mine = [c["better"] for c in comparisons if c["depth"] == depth]
        parts.append(f"at D = {depth} the pipeline did better in {mine.count('pipeline')} of {len(mine)}")
    parts[-1] = "and " + parts[-1]
    return ", ".join(parts)


def soak_page() -> str:
    """Resident memory per process over a long stream: it must stay flat after the warm-up."""
    runs: list[dict[str, Any]] = json.loads((SOAK / "soak.json").read_text())
    out = [
        "# Soak",
        "",
        (
            f"Data: {SOURCES['soak']}, on {VM}; `experiments/soak/soak.json`. A small MLP "
            f"(4 × Linear(256, 256)) in a D = {runs[0]['depth']} process pipeline, batches of "
            f"{runs[0]['sample_bytes'] // 1024} KB; the resident memory (RSS) of the caller and of every "
            "stage process is recorded along the stream."
        ),
        "",
        "![resident memory per process over the stream](soak.png)",
        "",
        "| mode | samples | process | MB after the warm-up | MB at the end | most growth, MB |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        for process, row in run["summary"].items():
            out.append(
                f"| {run['mode']} | {run['samples']:,} | {process} | {row['start_mb']:.1f} | "
                f"{row['end_mb']:.1f} | {row['growth_mb']:.1f} |"
            )
    growth = max(row["growth_mb"] for run in runs for row in run["summary"].values())
    leak_mb = min(run["samples"] - run["warmup"] for run in runs) * runs[0]["sample_bytes"] / 2**20
    out += [
        "",
        "## Reading",
        "",
        (
            f"After the warm-up (the first 20 % of each stream) no process grew by more than {growth:.1f} MB, "
            f"where a leak of one sample per tick would have added at least {leak_mb:,.0f} MB."
        ),
    ]
    return "\n".join(out) + "\n"


PAGES = {"speed": speed_page, "fidelity": fidelity_page, "live": live_page, "soak": soak_page}
PICTURES = {"sweep-inference.png": SPEED / "sweep-inference.png", "soak.png": SOAK / "soak.png"}


def write_pages(out: Path) -> list[Path]:
    """Write the four pages into ``out``, with the speed and soak pictures; the paths of the pages."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, page in PAGES.items():
        path = out / f"{name}.md"
        path.write_text(page())
        paths.append(path)
    for name, source in PICTURES.items():
        if out.resolve() != source.parent:
            shutil.copyfile(source, out / name)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", nargs="?", choices=("pages", "summarise"), default="pages")
    parser.add_argument("--out", type=Path, default=OUT, help="where the pages go (default: docs/results)")
    args = parser.parse_args()
    if args.step == "summarise":
        summarise()
    for path in write_pages(args.out):
        print(f"written: {path}")


if __name__ == "__main__":
    main()

"""The user's view of every optimizer under delay, in one table per depth: for each optimizer and
stream, sequential learning and the best pipeline configuration measured (each at its own best step
size on seed 0, the mean of seeds 1 and 2), each against the best sequential learner of any
optimizer on that stream.

NAdam and Muon come from ``optimizers_sweep.py``'s ``rows.jsonl``; SGD, momentum and Adam from the
runs of ``fidelity-own-step.md`` at fidelity's fixed cuts (``REFERENCE``, copied from its tables:
best of every remedy measured there, the default included).

    python experiments/learning/optimizers_table.py experiments/learning/optimizers/rows.jsonl
"""

import json
import statistics
import sys
from collections import defaultdict

STREAMS = ("digits", "shuffled", "camera")
NAMES = {
    "sgd": "SGD",
    "momentum": "SGD, momentum 0.9",
    "adam": "Adam",
    "nadam": "NAdam β1 = 0.99",
    "muon": "Muon + AdamW",
}
# (optimizer, stream, depth): (score, configuration, lr); depth 1 is sequential. Accuracy, or the
# camera's next-frame MSE.
REFERENCE = {
    ("sgd", "digits", 1): (0.828, "sequential", 0.1),
    ("sgd", "shuffled", 1): (0.705, "sequential", 0.1),
    ("sgd", "camera", 1): (0.00352, "sequential", 1),
    ("sgd", "digits", 2): (0.861, "default", 0.1),
    ("sgd", "shuffled", 2): (0.710, "default", 0.1),
    ("sgd", "camera", 2): (0.00390, "default", 3),
    ("sgd", "digits", 4): (0.834, "default", 0.1),
    ("sgd", "shuffled", 4): (0.693, "graph-stash + delay-correction", 0.1),
    ("sgd", "camera", 4): (0.00654, "default", 1),
    ("momentum", "digits", 1): (0.290, "sequential", 0.003),
    ("momentum", "shuffled", 1): (0.689, "sequential", 0.01),
    ("momentum", "camera", 1): (0.00261, "sequential", 0.3),
    ("momentum", "digits", 2): (0.279, "graph-stash + spike", 0.003),
    ("momentum", "shuffled", 2): (0.713, "default", 0.01),
    ("momentum", "camera", 2): (0.00391, "default", 0.3),
    ("momentum", "digits", 4): (0.260, "graph-stash + optimizer-prediction + long-momentum", 0.003),
    ("momentum", "shuffled", 4): (0.671, "graph-stash + optimizer-prediction + long-momentum", 0.01),
    ("momentum", "camera", 4): (0.00708, "default", 0.3),
    ("adam", "digits", 1): (0.489, "sequential", 0.001),
    ("adam", "shuffled", 1): (0.832, "sequential", 0.003),
    ("adam", "camera", 1): (0.00148, "sequential", 0.01),
    ("adam", "digits", 2): (0.550, "default", 0.001),
    ("adam", "shuffled", 2): (0.834, "graph-stash + optimizer-prediction + long-momentum", 0.003),
    ("adam", "camera", 2): (0.00266, "default", 0.003),
    ("adam", "digits", 4): (0.492, "graph-stash + step-scale", 0.001),
    ("adam", "shuffled", 4): (0.815, "graph-stash + optimizer-prediction + long-momentum", 0.003),
    ("adam", "camera", 4): (0.00425, "default", 0.003),
}


def measured(path: str) -> dict:
    """(optimizer, stream, depth): (score, configuration, lr) of the best configuration in ``path``'s
    reported rows (seeds 1 and 2 averaged; a diverged run scores as missing: worst)."""
    runs = defaultdict(list)
    with open(path) as lines:
        rows = [json.loads(line) for line in lines]
    for row in rows:
        if row["phase"] == "reported":
            runs[row["optimizer"], row["stream"], row["depth"], row["label"], row["lr"]].append(row)
    best: dict = {}
    for (opt, stream, depth, label, lr), rows in runs.items():
        camera = stream == "camera"
        if camera and any(r["loss"] is None for r in rows):
            continue
        score = statistics.mean(r["loss"] if camera else r["accuracy"] for r in rows)
        name = label.split(" ", 1)[1] if depth > 1 else "sequential"
        key = (opt, stream, depth)
        if key not in best or (score < best[key][0] if camera else score > best[key][0]):
            best[key] = (score, name, lr)
    return best


def cell(stream: str, value: tuple, top: float) -> str:
    score, name, lr = value
    if stream == "camera":
        return f"{score:.5f} ({100 * (score / top - 1):+.0f} %) {name}, lr {lr:g}"
    return f"{100 * score:.1f}% ({100 * (score - top):+.1f}) {name}, lr {lr:g}"


def table(results: dict, depth: int) -> str:
    tops = {}
    for stream in STREAMS:
        seq = [v[0] for (o, s, d), v in results.items() if s == stream and d == 1]
        tops[stream] = min(seq) if stream == "camera" else max(seq)
    out = [
        (
            f"D = {depth}: the best configuration of each optimizer; in brackets its gap to the best sequential "
            "learner of any optimizer (points, or % of loss on the camera)"
        ),
        "",
        "| optimizer | " + " | ".join(STREAMS) + " |",
        "|---|" + "---|" * len(STREAMS),
    ]
    for opt, name in NAMES.items():
        for d in (1, depth):
            cells = [cell(s, results[opt, s, d], tops[s]) if (opt, s, d) in results else "" for s in STREAMS]
            label = name + (", sequential" if d == 1 else f", D = {depth}")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    results = {**REFERENCE, **measured(sys.argv[1])}
    print("\n\n".join(table(results, depth) for depth in sorted({d for (_, _, d) in results if d > 1})))

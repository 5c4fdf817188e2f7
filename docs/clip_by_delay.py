"""Gradient clipping for the delayed stages, tried as a remedy for learning with delay and not kept.

A delayed stage (delay τ > 0) clips the norm of its whole gradient, before its step, to a multiple
of the running mean of its recent norms (an exponential average over about 20 steps, fed with
the clipped norms): ``CLIP`` times that mean ("flat"), or ``1 + c / τ`` times it ("by delay", so
the stalest stages clip hardest). The clipping is put around partime's own step
(``partime.core.stage.step``) here, in each run's process; nothing else changes. Each run is one
of ``partime fidelity``'s (``tools.fidelity.runs.run``, 3000 samples, its fixed cuts, the inline
executor, so the figures do not depend on the machine), on seeds 1 and 2, at the step sizes ``jobs``
lists: for the defaults, those their own-step tuning chose (docs/fidelity-own-step.md), and the same
for the clipped variants.

Run: ``.venv/bin/python docs/clip_by_delay.py`` (about 5 minutes on two cores); the figures in
docs/measured-and-not-kept.md came from it.
"""

import json
from concurrent.futures import ProcessPoolExecutor

import torch

import partime.core.stage as stage_module
from partime_tools.fidelity import runs
from partime_tools.fidelity.configs import Config

EMA = 0.95
"""The running mean's weight on its past: about 20 steps."""

ORIGINAL = (stage_module.make_learning, stage_module.step)


def clipping(kind: str, c: float) -> None:
    """Put the clipping of ``kind`` ("" none, "flat" or "delay") with constant ``c`` around partime's
    own step, afresh (a worker process runs many runs)."""
    make_learning, step = ORIGINAL
    delays, means = {}, {}

    def make(index, config, named, extra=()):
        learning = make_learning(index, config, named, extra)
        delays[id(learning)] = 2 * (config.depth - 1 - index)
        return learning

    def clipped_step(learning, params, grads, anchor):
        tau = delays.get(id(learning), 0)
        found = [g for g in grads if g is not None]
        if kind and tau > 0 and found:
            limit_factor = c if kind == "flat" else 1 + c / tau
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in found])).item()
            mean = means.get(id(learning))
            if mean is not None and norm > mean * limit_factor:
                grads = [None if g is None else g * (mean * limit_factor / norm) for g in grads]
                norm = mean * limit_factor
            means[id(learning)] = norm if mean is None else EMA * mean + (1 - EMA) * norm
        return step(learning, params, grads, anchor)

    stage_module.make_learning, stage_module.step = make, clipped_step


def one(job: tuple) -> dict:
    stream, optimizer, depth, compensation, lr, kind, c, seed = job
    clipping(kind, c)
    config = Config(stream, depth, "graph-stash", compensation, seed, runs.cut(stream, depth), optimizer, lr)
    row = runs.run(config, 3000)
    return dict(zip(("stream", "optimizer", "depth", "compensation", "lr", "kind", "c", "seed"), job)) | {
        "loss": row["loss"],
        "accuracy": row["accuracy"],
    }


def jobs() -> list[tuple]:
    sgd, adaptive = "step-scale+delay-correction", "step-scale+optimizer-prediction+long-momentum"
    out = []
    for seed in (1, 2):
        for stream in ("digits", "shuffled"):
            out.append((stream, "sgd", 1, "", 0.1, "", 0, seed))
            for depth in (2, 4):
                out += [(stream, "sgd", depth, sgd, 0.1, "", 0, seed)]
                out += [(stream, "sgd", depth, "delay-correction", 0.1, "flat", 2.0, seed)]
        out.append(("camera", "sgd", 1, "", 1.0, "", 0, seed))
        out.append(("camera", "sgd", 2, sgd, 3.0, "", 0, seed))
        out.append(("camera", "sgd", 2, sgd, 1.0, "", 0, seed))
        out.append(("camera", "sgd", 2, "delay-correction", 1.0, "flat", 2.0, seed))
        out.append(("camera", "sgd", 4, sgd, 1.0, "", 0, seed))
        out.append(("camera", "sgd", 4, "delay-correction", 1.0, "", 0, seed))
        for kind, c in (("flat", 1.5), ("flat", 2.0), ("flat", 3.0), ("delay", 4.0), ("delay", 8.0)):
            out.append(("camera", "sgd", 4, "delay-correction", 1.0, kind, c, seed))
        for optimizer, lr, sequential_lr in (("momentum", 0.3, 0.3), ("adam", 0.003, 0.01)):
            out.append(("camera", optimizer, 1, "", sequential_lr, "", 0, seed))
            out.append(("camera", optimizer, 4, adaptive, lr, "", 0, seed))
            out.append(("camera", optimizer, 4, adaptive, lr, "flat", 2.0, seed))
            out.append(("camera", optimizer, 4, "optimizer-prediction+long-momentum", lr, "flat", 2.0, seed))
    return out


def report(rows: list[dict]) -> None:
    """Each configuration's score per seed, with its gap to sequential on that seed."""
    sequential = {(r["stream"], r["optimizer"], r["seed"]): r for r in rows if r["depth"] == 1}
    for r in rows:
        if r["depth"] == 1:
            continue
        base = sequential[(r["stream"], r["optimizer"], r["seed"])]
        if r["stream"] == "camera":
            score = f"loss {r['loss']:.5f} ({(r['loss'] / base['loss'] - 1) * 100:+.0f}%)"
        else:
            score = f"accuracy {r['accuracy'] * 100:.1f}% ({(r['accuracy'] - base['accuracy']) * 100:+.1f} points)"
        clip = f"{r['kind']} {r['c']}" if r["kind"] else "none"
        label = f"{r['stream']} {r['optimizer']} D={r['depth']} {r['compensation'] or 'graph-stash'} lr {r['lr']}"
        print(f"{label}, clip {clip}, seed {r['seed']}: {score}")


if __name__ == "__main__":
    with ProcessPoolExecutor(2) as pool:
        found = list(pool.map(one, jobs()))
    print(json.dumps(found))
    report(found)

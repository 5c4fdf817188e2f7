"""Adam where there is no delay, NAdam (β1 = 0.99) in the delayed stages: the user's view at D = 2.

A stage's optimizer factory is given only the stage's parameters; here it tells the last stage (no
delay) by its layers' shapes (the last stage of the fixed cut at D = 2: the camera's last two
convolutions, the digits model's second convolution and its classifier) and makes Adam there,
NAdam with β1 = 0.99 elsewhere, at one step size. Each stream: the pipeline at every step size of
Adam's grid on seed 0, then at its best on seeds 1 and 2 (as ``partime fidelity --own-step``),
rows appended to ``rows.jsonl``; sequential Adam and sequential NAdam are in the other sweeps.

    PYTHONPATH=src python experiments/learning/adam_then_nadam.py OUT_DIR [JOBS] [STREAMS]
"""

import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from partime_tools.fidelity import runs as fid
from partime_tools.fidelity.tuning import own_key

FRAMES = 3000
SEEDS = 2
LAST_STAGE_SHAPES = {"camera": (3, 16, 3, 3), "digits": (32, 16, 3, 3), "shuffled": (32, 16, 3, 3)}
plain_factory = fid.optimizer_factory


def factory(name, lr):
    """``"adam-nadam:STREAM"``: Adam for the stage holding the stream's last-stage layer, NAdam elsewhere."""
    if not name.startswith("adam-nadam:"):
        return plain_factory(name, lr)
    shape = LAST_STAGE_SHAPES[name.split(":")[1]]

    def make(params):
        params = list(params)
        if any(tuple(p.shape) == shape for p in params):
            return torch.optim.Adam(params, lr=lr)
        return torch.optim.NAdam(params, lr=lr, betas=(0.99, 0.999), decoupled_weight_decay=True)

    return make


def run(config, frames):
    fid.optimizer_factory = factory  # in this worker process too
    return fid.run(config, frames)


def main(out: Path, jobs: int, streams: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "rows.jsonl").open("a")
    for stream in streams:
        name = f"adam-nadam:{stream}"
        lrs = (3e-4, 1e-3, 3e-3, 1e-2)
        base = fid.Config(stream, 2, "graph-stash", balance=fid.cut(stream, 2), optimizer=name)
        with ProcessPoolExecutor(jobs) as pool:
            tuning = list(pool.map(run, [replace(base, seed=0, lr=lr) for lr in lrs], [FRAMES] * len(lrs)))
            best = fid.own_best_steps(tuning)[own_key(tuning[0])]
            reported = list(pool.map(run, [replace(base, seed=s, lr=best) for s in (1, 2)], [FRAMES] * SEEDS))
        for phase, rows in (("tuning", tuning), ("reported", reported)):
            for row in rows:
                log.write(json.dumps(dict(row, phase=phase, history=None)) + "\n")
        log.flush()
        print(
            stream,
            "lr",
            best,
            [r["accuracy"] if r["accuracy"] is not None else r["loss"] for r in reported],
            flush=True,
        )


if __name__ == "__main__":
    main(
        Path(sys.argv[1]),
        int(sys.argv[2]) if len(sys.argv) > 2 else 2,
        sys.argv[3].split(",") if len(sys.argv) > 3 else list(fid.STREAMS),
    )

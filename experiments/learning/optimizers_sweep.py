"""The user's view of NAdam (β1 = 0.99) and Muon under delay, run stream by stream.

What ``partime fidelity --own-step --optimizer nadam,muon`` runs, cut to what a shared 2-core
machine finishes (``PLAN``, in the order run): sequential and graph-stash at D = 2, 4 and 8, with
nothing added (what "auto" chose for them when the sweep began) and with step-scale (the
measurement "auto" is chosen by); then, at D = 8, SGD, momentum and Adam with their defaults. Each
configuration learns at its own best step size on seed 0 (NAdam and Muon: ``STEPS``; the others:
their ``own_grid``), reported on seeds 1 and 2. Each (stream, optimizer) is tuned and reported
before the next one starts; every row is appended to ``rows.jsonl`` as it comes, and a row
already there is not run again, so that a sweep cut short and started again keeps what it finished.

    PYTHONPATH=src python experiments/learning/optimizers_sweep.py OUT_DIR [JOBS]
"""

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from partime_tools.fidelity import runs as fid
from partime_tools.fidelity.configs import automatic
from partime_tools.fidelity.tuning import own_grid, own_key

FRAMES = 3000
SEEDS = 2
STEPS = (1e-3, 3e-3, 1e-2)  # 3e-4 was tried on moving digits first, and never chosen
AUTO = "auto"  # what compensation="auto" chooses for the optimizer
BOTH = [(2, ""), (2, "step-scale"), (4, ""), (4, "step-scale")]
PLAN = [  # (optimizer, stream, configurations beside sequential: (depth, compensation) with graph-stash)
    ("nadam", "digits", [(2, ""), (2, "step-scale"), (4, "")]),
    ("nadam", "camera", BOTH),
    ("nadam", "shuffled", BOTH),
    ("muon", "camera", [(2, ""), (2, "step-scale"), (4, "")]),
    ("nadam", "digits", [(4, "step-scale")]),
    ("muon", "digits", BOTH),
    ("muon", "shuffled", BOTH),
    ("muon", "camera", [(4, "step-scale")]),
    *[
        (opt, stream, [(8, ""), (8, "step-scale")])
        for opt in ("nadam", "muon")
        for stream in ("digits", "shuffled", "camera")
    ],
    *[(opt, stream, [(8, AUTO)]) for opt in ("sgd", "momentum", "adam") for stream in ("digits", "shuffled", "camera")],
]


def key(config: fid.Config) -> str:
    return json.dumps([config.stream, config.optimizer, config.label, config.lr, config.seed])


def row_key(row: dict) -> str:
    """The ``key`` of the configuration that made ``row``."""
    return key(fid.Config(**{k: row[k] for k in asdict(fid.Config("digits", 1))}))


def main(out: Path, jobs: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    done = {}
    if (out / "rows.jsonl").exists():
        for line in (out / "rows.jsonl").read_text().splitlines():
            row = json.loads(line)
            done[row_key(row)] = row
    log = (out / "rows.jsonl").open("a")

    def run_all(configs: list[fid.Config], phase: str) -> list[dict]:
        todo = [c for c in configs if key(c) not in done]
        for row in fid.run_all(todo, FRAMES, jobs):
            row = dict(row, phase=phase, history=None)  # the histories would make rows.jsonl megabytes
            log.write(json.dumps(row) + "\n")
            log.flush()
            done[row_key(row)] = row
        return [done[key(c)] for c in configs]

    for opt, stream, plan in PLAN:
        configs = [fid.Config(stream, 1, optimizer=opt)] + [
            fid.Config(
                stream,
                d,
                "graph-stash",
                automatic(opt) if comp == AUTO else comp,
                balance=fid.cut(stream, d),
                optimizer=opt,
            )
            for d, comp in plan
        ]
        steps_tried = STEPS if opt in ("nadam", "muon") else own_grid(opt)
        tuning = [replace(c, seed=fid.TUNING_SEED, lr=lr) for c in configs for lr in steps_tried]
        steps = fid.own_best_steps(run_all(tuning, "tuning"))
        run_all([replace(c, seed=s, lr=steps[own_key(c)]) for s in (1, 2) for c in configs], "reported")
        print(f"{opt} {stream} done", flush=True)
    rows = [r for r in done.values() if r["phase"] == "reported"]
    fid.write(rows, out, tuning=[r for r in done.values() if r["phase"] == "tuning"], own_step=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2)

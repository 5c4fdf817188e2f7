"""The user's view of NAdam (β1 = 0.99) and Muon under delay, run stream by stream.

What ``partime fidelity --own-step --optimizer nadam,muon`` runs, cut to what a shared 2-core
machine finishes in an hour: sequential, D = 2 with the default (graph-stash, "auto"), D = 2 with
step-scale (NAdam only: the one measurement "auto" is chosen by), D = 4 with the default; each
configuration at its own best step size of the optimizer's grid on seed 0, reported on seeds 1
and 2. Each (stream, optimizer) is tuned and reported before the next one starts, and every row
is appended to ``rows.jsonl`` as it comes, so that a sweep cut short keeps what it finished.

    PYTHONPATH=src python experiments/learning/optimizers_sweep.py OUT_DIR [JOBS]
"""

import json
import sys
from pathlib import Path

from partime_tools.fidelity import runs as fid

FRAMES = 3000
SEEDS = 2
PLAN = {  # optimizer: the configurations beside sequential, (depth, compensation) with graph-stash
    "nadam": [(2, ""), (2, "step-scale"), (4, "")],
    "muon": [(2, ""), (4, "")],
}


def main(out: Path, jobs: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "rows.jsonl").open("a")
    tuned, reported = [], []
    for opt, plan in PLAN.items():
        for stream in fid.STREAMS:
            configs = [fid.Config(stream, 1, optimizer=opt)] + [
                fid.Config(stream, d, "graph-stash", comp, balance=fid.cut(stream, d), optimizer=opt)
                for d, comp in plan
            ]
            tuning = fid.at_every_own_step(configs)
            rows = fid.run_all(tuning, FRAMES, jobs)
            for row in rows:
                log.write(json.dumps(dict(row, phase="tuning")) + "\n")
            log.flush()
            tuned += rows
            chosen = fid.at_own_steps(tuning, fid.own_best_steps(rows), SEEDS)
            rows = fid.run_all(chosen, FRAMES, jobs)
            for row in rows:
                log.write(json.dumps(dict(row, phase="reported")) + "\n")
            log.flush()
            reported += rows
            fid.write(reported, out, tuning=tuned, own_step=True)
            print(f"{opt} {stream} done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2)

"""Each configuration at its own best step size: the helper the remedy experiments beside this file share.

``learnt`` runs one job of ``partime fidelity`` (``partime_tools.fidelity.runs.run``: 3000 samples,
fidelity's fixed cuts, the inline executor, so the figures do not depend on the machine);
``at_own_steps`` tunes each configuration's step size on the tuning seed and reports it on the
others, as ``partime fidelity --own-step`` does.
"""

import json
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from partime_tools.fidelity import runs
from partime_tools.fidelity.configs import Config
from partime_tools.fidelity.tuning import reported_seeds, score


def learnt(job: tuple, knob: str, optimizer: str) -> dict:
    """Run ``job`` (``(stream, depth, compensation, knob's value, lr, seed)``) with ``optimizer`` at
    fidelity's fixed cut; the job's values by name, and the run's scores."""
    stream, depth, compensation, _, lr, seed = job
    config = Config(stream, depth, "graph-stash", compensation, seed, runs.cut(stream, depth), optimizer, lr)
    row = runs.run(config, 3000)
    named = dict(zip(("stream", "depth", "compensation", knob, "lr", "seed"), job))
    return named | {"loss": row["loss"], "accuracy": row["accuracy"], "diverged_at": row["diverged_at"]}


def at_own_steps(one: Callable[[tuple], dict], tuning: list[tuple], knobs: int) -> None:
    """Run ``one`` on every job of ``tuning`` (each ``(stream, *knobs, lr, seed)``, ``knobs`` values
    that make one configuration), take each configuration's best step size (``score``), run it on
    the reported seeds, and print the rows as JSON, then each configuration's step size and mean
    score over those seeds (a diverged run counts as NaN)."""
    with ProcessPoolExecutor(2) as pool:
        tuned = list(pool.map(one, tuning))
        names = list(tuned[0])[: 1 + knobs]  # the stream and the knobs, as ``one`` names them
        best: dict[tuple, dict] = {}
        for row in tuned:
            key = tuple(row[name] for name in names)
            if key not in best or score(row) > score(best[key]):
                best[key] = row
        reported = [(*key, best[key]["lr"], seed) for key in best for seed in reported_seeds(2)]
        rows = list(pool.map(one, reported))
    print(json.dumps(dict(tuning=tuned, reported=rows)))
    for key, chosen in best.items():
        mine = [r for r in rows if tuple(r[name] for name in names) == key]
        metric = "loss" if key[0] == "camera" else "accuracy"
        values = [r[metric] if r["diverged_at"] is None else float("nan") for r in mine]
        print(*key, f"lr {chosen['lr']:g}", metric, statistics.mean(values), sep=" | ")

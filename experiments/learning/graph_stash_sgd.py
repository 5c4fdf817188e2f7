"""The three stash modes under the default compensation for plain SGD (step-scale and
delay-correction), each stream at the step size best for sequential learning of it (the
README's grid), D = 2 and 4, seeds 0 and 1, 3000 samples: ``.venv/bin/python experiments/learning/graph_stash_sgd.py``
(about 10 minutes on 2 cores). Prints one line per run and writes ``graph_stash_sgd.json``;
``experiments/learning/fidelity-graph-stash.md`` holds the gaps to sequential learning it gave.
"""

import itertools
import json
from concurrent.futures import ProcessPoolExecutor

from partime_tools.fidelity import runs as fid
from partime_tools.fidelity.configs import Config

LR = {"digits": 0.1, "shuffled": 0.1, "camera": 1.0}  # sequential's best for plain SGD

if __name__ == "__main__":
    with ProcessPoolExecutor(2) as pool:  # made before this process computes anything with torch
        cuts = {(m, d): fid.cut(m, d) for m in ("digits", "camera") for d in (2, 4)}
        cfgs = []
        for stream, lr in LR.items():
            model = "camera" if stream == "camera" else "digits"
            for seed in (0, 1):
                cfgs.append(Config(stream, 1, seed=seed, optimizer="sgd", lr=lr))
                for depth, mode in itertools.product((2, 4), ("stash", "graph-stash", "weight-stash")):
                    comp = "step-scale+delay-correction"
                    cfgs.append(Config(stream, depth, mode, comp, seed, cuts[model, depth], "sgd", lr))
        rows = list(pool.map(fid.run, cfgs, itertools.repeat(3000)))
    for row in rows:
        row.pop("history", None)
        print(row["stream"], row["depth"], row["grad_mode"], row["seed"], row["accuracy"], row["loss"])
    with open("graph_stash_sgd.json", "w") as out:
        json.dump(rows, out, indent=1)

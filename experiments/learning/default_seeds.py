"""The default configuration on seeds that chose nothing: sequential against ``stash`` with
``compensation="auto"`` at each depth, on seeds 2 and 3 of every fidelity stream, at the step
sizes that ``partime fidelity`` chose (read from its JSON).

    .venv/bin/python experiments/learning/default_seeds.py experiments/learning/fidelity.json --out experiments/learning/fidelity-default-seeds.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from partime_tools.fidelity import runs as fid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fidelity_json", type=Path)
    parser.add_argument("--frames", type=int, default=3000)
    parser.add_argument("--seeds", default="2,3")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("fidelity-default-seeds.md"))
    args = parser.parse_args()
    measured = json.loads(args.fidelity_json.read_text())
    steps = fid.best_step_sizes(measured["tuning"])
    cuts = {(r["stream"], r["depth"]): tuple(r["balance"]) for r in measured["runs"] if r["depth"] > 1}
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = []
    for (stream, opt), lr in steps.items():
        for seed in seeds:
            configs.append(fid.Config(stream, 1, seed=seed, optimizer=opt, lr=lr))
            for (s, depth), balance in cuts.items():
                if s == stream:
                    configs.append(fid.Config(stream, depth, "stash", fid.automatic(opt), seed, balance, opt, lr))
    rows = fid.run_all(configs, args.frames, jobs=args.jobs)
    text = fid.markdown(fid.summarise(rows))
    args.out.write_text(
        f"Seeds {args.seeds}, {args.frames} samples, the step sizes and cuts of {args.fidelity_json.name}.\n\n{text}"
    )
    print(args.out.read_text())


if __name__ == "__main__":
    main()

"""The user's view at D = 2 on more seeds: is a gap of a point or two a gap, or the seeds?

``partime fidelity --own-step`` chooses each configuration's step size on seed 0 and reports the
mean of seeds 1 and 2. Two seeds are few for targets of a point: this runs sequential learning and
the default (``graph-stash``, ``compensation="auto"``) at D = 2 at the step sizes that tuning chose
(README, "Learning with delay"; experiments/learning/fidelity-own-step.md) on seeds 1 to 6, at fidelity's fixed
cuts, 3000 samples each, and prints each cell's gap on each seed and its mean and standard error
over the six (each run is one of ``tools.fidelity.runs.run``'s, through the inline executor: the
figures do not depend on the machine).

Run: ``.venv/bin/python experiments/learning/own_step_seeds.py`` (about 10 minutes on two cores); the table in
experiments/learning/fidelity-own-step.md came from it.
"""

import statistics
from concurrent.futures import ProcessPoolExecutor

from partime_tools.fidelity import runs
from partime_tools.fidelity.configs import Config, automatic

SEEDS = range(1, 7)

STEPS = {  # (stream, optimizer): (sequential's step size, the default's), as tuning chose them on seed 0
    ("digits", "sgd"): (0.1, 0.1),
    ("shuffled", "sgd"): (0.1, 0.1),
    ("camera", "sgd"): (1.0, 3.0),
    ("digits", "momentum"): (0.003, 0.003),
    ("shuffled", "momentum"): (0.01, 0.01),
    ("camera", "momentum"): (0.3, 0.3),
    ("digits", "adam"): (0.001, 0.001),
    ("shuffled", "adam"): (0.003, 0.003),
    ("camera", "adam"): (0.01, 0.003),
}


def one(job: tuple) -> tuple:
    stream, optimizer, depth, lr, seed = job
    compensation = automatic(optimizer) if depth > 1 else ""
    config = Config(stream, depth, "graph-stash", compensation, seed, runs.cut(stream, depth), optimizer, lr)
    row = runs.run(config, 3000)
    return job, row["loss"] if stream == "camera" else row["accuracy"]


def main() -> None:
    jobs = [
        (stream, optimizer, depth, lr, seed)
        for (stream, optimizer), steps in STEPS.items()
        for depth, lr in zip((1, 2), steps)
        for seed in SEEDS
    ]
    with ProcessPoolExecutor(2) as pool:
        scores = dict(pool.map(one, jobs))
    print("| optimizer | stream | gap on seeds 1 to 6 | mean | standard error |")
    print("|---|---|---|---|---|")
    for (stream, optimizer), (lr_sequential, lr_default) in STEPS.items():
        gaps = []
        for seed in SEEDS:
            plain = scores[stream, optimizer, 1, lr_sequential, seed]
            delayed = scores[stream, optimizer, 2, lr_default, seed]
            gaps.append((delayed / plain - 1) * 100 if stream == "camera" else (delayed - plain) * 100)
        unit = " %" if stream == "camera" else ""
        listed = ", ".join(f"{g:+.1f}" for g in gaps)
        error = statistics.stdev(gaps) / len(gaps) ** 0.5
        print(f"| {optimizer} | {stream} | {listed} | {statistics.mean(gaps):+.1f}{unit} | {error:.1f}{unit} |")


if __name__ == "__main__":
    main()

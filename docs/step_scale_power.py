"""The power of ``step-scale`` at D = 2 and 4, in the user's view: every configuration at its own
best step size.

``step-scale`` divides a delayed stage's step size by ``(1 + τ) ** p``, ``p =
partime.learning.compensation.STEP_SCALE_POWER`` (1), a constant chosen where the camera diverged at
D = 8. This runs the default configuration of each optimizer (``graph-stash`` with
``compensation="auto"``, which holds ``step-scale``) with ``p`` of 0.5 and 1, and sequential
learning, on ``partime fidelity``'s three streams, as ``partime fidelity --own-step`` does: each
at every step size of its optimizer's own grid on seed 0, then at the best of them on seeds 1 and
2 (3000 samples, the inline executor, so the figures do not depend on the machine). The cuts are
fidelity's fixed ones (``tools.fidelity.configs.FIXED_CUTS``): those that docs/fidelity-own-step.md's runs
planned, but for the camera at D = 2 with momentum and Adam, which was cut at [2, 6] there and is
at [4, 4] here, as with SGD.

Run: ``.venv/bin/python docs/step_scale_power.py`` (about 25 minutes on two cores); it prints the
rows as JSON, then a table of each configuration's mean score over seeds 1 and 2 and its gap to
sequential's.
"""

import json
import statistics
from concurrent.futures import ProcessPoolExecutor

from partime.learning import compensation
from partime_tools.fidelity import runs
from partime_tools.fidelity.configs import Config, automatic
from partime_tools.fidelity.tuning import TUNING_SEED, own_grid, reported_seeds, score

POWERS = (0.5, 1.0)
DEPTHS = (2, 4)
STREAMS = ("digits", "shuffled", "camera")
OPTIMIZERS = ("sgd", "momentum", "adam")
SEEDS = 2

Key = tuple[float | None, int, str, str]
"""A configuration: the power (None for sequential), the depth, the stream and the optimizer."""


def config(key: Key, seed: int, lr: float) -> Config:
    _, depth, stream, optimizer = key
    if depth == 1:
        return Config(stream, 1, seed=seed, optimizer=optimizer, lr=lr)
    return Config(stream, depth, "graph-stash", automatic(optimizer), seed, runs.cut(stream, depth), optimizer, lr)


def one(job: tuple[Key, Config]) -> tuple[Key, dict]:
    key, run_config = job
    compensation.STEP_SCALE_POWER = 1.0 if key[0] is None else key[0]  # a spawned worker runs many jobs
    row = runs.run(run_config, 3000)
    row.pop("history")
    return key, row


def keys() -> list[Key]:
    sequential: list[Key] = [(None, 1, stream, opt) for stream in STREAMS for opt in OPTIMIZERS]
    piped: list[Key] = [(p, d, stream, opt) for p in POWERS for d in DEPTHS for stream in STREAMS for opt in OPTIMIZERS]
    return sequential + piped


def main() -> None:
    with ProcessPoolExecutor(2) as pool:
        tuning = [(key, config(key, TUNING_SEED, lr)) for key in keys() for lr in own_grid(key[3])]
        best: dict[Key, tuple[float, float]] = {}
        for key, row in pool.map(one, tuning):
            if key not in best or score(row) > best[key][0]:
                best[key] = (score(row), row["lr"])
        reported = [(key, config(key, seed, best[key][1])) for key in keys() for seed in reported_seeds(SEEDS)]
        rows = list(pool.map(one, reported))
    print(json.dumps([dict(power=key[0], **row) for key, row in rows]))
    means: dict[Key, float] = {}
    for key in keys():
        found = [row for k, row in rows if k == key]
        values = [row["loss"] if key[2] == "camera" else row["accuracy"] for row in found]
        means[key] = statistics.mean(v if v is not None else float("inf") for v in values)
    for optimizer in OPTIMIZERS:
        for depth in DEPTHS:
            for power in POWERS:
                cells = []
                for stream in STREAMS:
                    key, base = (power, depth, stream, optimizer), means[(None, 1, stream, optimizer)]
                    lr = best[key][1]
                    if stream == "camera":
                        cells.append(f"{stream} {means[key]:.5f} ({(means[key] / base - 1) * 100:+.1f}%) at lr {lr}")
                    else:
                        cells.append(f"{stream} {means[key] * 100:.1f}% ({(means[key] - base) * 100:+.1f}) at lr {lr}")
                print(f"{optimizer} D={depth} p={power}: " + "; ".join(cells))
    for stream in STREAMS:
        for optimizer in OPTIMIZERS:
            key = (None, 1, stream, optimizer)
            print(f"sequential {optimizer} {stream}: {means[key]:.5f} at lr {best[key][1]}")


if __name__ == "__main__":
    main()

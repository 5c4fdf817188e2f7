"""Other combinations of partime's remedies for SGD with momentum 0.9 at D = 2, beside the default.

The default for momentum (``step-scale``, ``optimizer-prediction``, ``long-momentum``) misses the
user's view's targets at D = 2 on moving digits (2.5 points behind sequential) and on the camera
(+50 %). These runs add ``delay-correction`` to it, and try ``spike`` and ``delay-correction``
with ``step-scale`` in its place, on the three streams.

Each configuration runs through ``tools.fidelity.runs.run`` (3000 samples, fidelity's fixed cuts,
the inline executor: the figures do not depend on the machine) at every step size of momentum's
own grid on seed 0 and at the best of them on seeds 1 and 2 (``own_steps.at_own_steps``).

Run: ``.venv/bin/python experiments/learning/momentum_combinations.py`` (about 6 minutes on two cores); it prints
the rows as JSON, then each configuration's step size and mean score over seeds 1 and 2. The
figures in experiments/measured-and-not-kept.md came from it.
"""

from own_steps import at_own_steps, learnt  # beside this script

from partime_tools.fidelity.configs import automatic
from partime_tools.fidelity.tuning import TUNING_SEED, own_grid

CONFIGS = (
    automatic("momentum"),
    automatic("momentum") + "+delay-correction",
    "step-scale+spike",
    "step-scale+optimizer-prediction+delay-correction",
)


def one(job: tuple) -> dict:
    return learnt(job, "unused", "momentum")


def main() -> None:
    jobs = [
        (stream, 2, compensation, None, lr, TUNING_SEED)
        for stream in ("digits", "camera", "shuffled")
        for compensation in CONFIGS
        for lr in own_grid("momentum")
    ]
    at_own_steps(one, jobs, 3)


if __name__ == "__main__":
    main()

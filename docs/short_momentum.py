"""A shorter momentum for the delayed stages, tried as a remedy for SGD with momentum under delay.

Mitliagkas, Zhang, Hadjis and Ré ("Asynchrony begets momentum, with an application to deep
learning", 2016) find that stale gradients act as a momentum of their own, so that an optimizer
run with delay should lower its explicit momentum to stay where it was tuned. partime's default for
momentum does the opposite on the delayed stages (``long-momentum`` raises it to 0.99, and
``optimizer-prediction`` runs the forward with the weights that momentum will reach). This tries
the other way: each delayed stage's SGD momentum lowered from 0.9 to ``μ`` (0.5, or 0: plain SGD),
its dampening set so that a constant gradient moves it as far per step as before
(``(1 - dampening) / (1 - μ)`` kept), with ``step-scale``, and with ``step-scale`` and
``optimizer-prediction`` where the momentum is not 0.

Each configuration runs through ``tools.fidelity.runs.run`` (3000 samples, fidelity's fixed cuts,
the inline executor: the figures do not depend on the machine) on the two streams where the
default with momentum misses at D = 2, moving digits and the camera, at every step size of
momentum's own grid on seed 0 and at the best of them on seeds 1 and 2, beside sequential learning
and the default, the same way.

Run: ``.venv/bin/python docs/short_momentum.py`` (about 5 minutes on two cores); it prints the rows as JSON, then each
configuration's step size and mean score over seeds 1 and 2. The figures in
docs/measured-and-not-kept.md came from it.
"""

from basis_rotation import at_own_steps, learnt  # beside this script

from partime.core import stage as stage_module
from partime_tools.fidelity.configs import automatic
from partime_tools.fidelity.tuning import TUNING_SEED, own_grid

ORIGINAL = stage_module.make_learning


def shortening(mu: float | None) -> None:
    """Make each delayed stage's momentum ``mu`` (None: as the configuration says), afresh: a
    worker process runs many runs."""

    def make(index, config, named, extra=()):
        learning = ORIGINAL(index, config, named, extra)
        if mu is not None and index < config.depth - 1 and learning.optimizer is not None:
            for group in learning.optimizer.param_groups:
                before = float(group["momentum"])
                group["dampening"] = 1 - (1 - float(group["dampening"])) * (1 - mu) / (1 - before)
                group["momentum"] = mu
        return learning

    stage_module.make_learning = make


def one(job: tuple) -> dict:
    shortening(job[3])
    return learnt(job, "mu", "momentum")


CONFIGS = (  # (depth, compensation, the delayed stages' momentum: None as configured)
    (1, "", None),
    (2, automatic("momentum"), None),
    (2, "step-scale", 0.5),
    (2, "step-scale+optimizer-prediction", 0.5),
    (2, "step-scale", 0.0),
)


def main() -> None:
    grid = own_grid("momentum")
    at_own_steps(
        one, [(s, d, c, mu, lr, TUNING_SEED) for s in ("digits", "camera") for d, c, mu in CONFIGS for lr in grid], 3
    )


if __name__ == "__main__":
    main()

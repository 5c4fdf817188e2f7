"""Adam in a rotated basis for the delayed stages, tried as a remedy for learning with delay.

Jung, Shin and Lee ("Mitigating Staleness in Asynchronous Pipeline Parallelism via Basis
Rotation", ICML 2026, arXiv 2602.03515) trace Adam's extra cost under delay to the misalignment
between the Hessian's eigenbasis and the coordinate basis in which Adam scales each coordinate,
and run Adam in a basis that diagonalises the gradient's covariance instead. ``RotatedAdam`` is
that bilateral rotation in its simplest form (as SOAP, Vyas et al. 2024, runs it): for each
parameter of two or more dimensions, seen as a matrix ``G`` of its first dimension by the rest,
running averages ``L`` of ``G Gᵀ`` and ``R`` of ``Gᵀ G``, their eigenvectors ``Q_L`` and ``Q_R``
recomputed every ``EVERY`` steps; Adam's first moment kept in the parameter's own coordinates,
its second moment in the rotated ones (of ``Q_Lᵀ G Q_R``), and the step ``Q_L (m̂' / (√v̂' + ε)) Q_Rᵀ``
with ``m' = Q_Lᵀ m Q_R``. A parameter of one dimension (a bias) steps as in Adam.

Here the delayed stages (stage ``i < D - 1``) learn with ``RotatedAdam`` and the last stage with
Adam, at the same step size, so sequential learning (D = 1) stays plain Adam; each configuration
runs through ``tools.fidelity.runs.run`` (3000 samples, the inline executor: the figures do not
depend on the machine), at each step size of fidelity's grid for Adam on seed 0, and at the best
of them on seeds 1 and 2 (the user's view). Beside them: the default (Adam with ``step-scale``,
``optimizer-prediction`` and ``long-momentum``), and sequential learning with ``RotatedAdam``
itself, which says whether the rotation helps because of the delay or in general.

Run: ``.venv/bin/python docs/basis_rotation.py`` (about 30 minutes on two cores, most of it sequential
learning with ``RotatedAdam`` on the digits model, whose 1152-wide linear layer takes an
eigendecomposition of a 1152 × 1152 matrix every ``EVERY`` steps); it prints the rows as JSON, then
each configuration's step size and mean score over seeds 1 and 2. The figures in
docs/measured-and-not-kept.md came from it.
"""

import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from partime.core.stage import learning as stage_learning
from partime_tools.fidelity import runs
from partime_tools.fidelity.configs import Config
from partime_tools.fidelity.tuning import TUNING_SEED, own_grid, reported_seeds, score

EVERY = 10
"""Steps between two eigendecompositions of a parameter's ``L`` and ``R``."""

BASIS_EMA = 0.95
"""The running averages' weight on their past (SOAP's ``shampoo_beta``)."""


class RotatedAdam(torch.optim.Optimizer):
    """Adam with each matrix-shaped parameter's second moment in the eigenbasis of its gradient's
    covariance (see the module)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    if p.dim() >= 2:
                        rows = p.shape[0]
                        cols = p.numel() // rows
                        state["L"] = torch.zeros(rows, rows, dtype=p.dtype)
                        state["R"] = torch.zeros(cols, cols, dtype=p.dtype)
                        state["exp_avg_sq"] = torch.zeros(rows, cols, dtype=p.dtype)
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                bias1, bias2 = 1 - beta1**t, 1 - beta2**t
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                if p.dim() < 2:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    denom = (state["exp_avg_sq"] / bias2).sqrt_().add_(group["eps"])
                    p.addcdiv_(state["exp_avg"] / bias1, denom, value=-group["lr"])
                    continue
                matrix = g.reshape(p.shape[0], -1)
                state["L"].mul_(BASIS_EMA).add_(matrix @ matrix.T, alpha=1 - BASIS_EMA)
                state["R"].mul_(BASIS_EMA).add_(matrix.T @ matrix, alpha=1 - BASIS_EMA)
                if t == 1 or t % EVERY == 0:
                    state["QL"] = torch.linalg.eigh(state["L"].double())[1].to(p.dtype)
                    state["QR"] = torch.linalg.eigh(state["R"].double())[1].to(p.dtype)
                left, right = state["QL"], state["QR"]
                rotated = left.T @ matrix @ right
                state["exp_avg_sq"].mul_(beta2).addcmul_(rotated, rotated, value=1 - beta2)
                moment = left.T @ state["exp_avg"].reshape(p.shape[0], -1) @ right
                update = (moment / bias1) / (state["exp_avg_sq"] / bias2).sqrt_().add_(group["eps"])
                p.add_((left @ update @ right.T).reshape(p.shape), alpha=-group["lr"])


ORIGINAL = stage_learning._make_optimizer


def rotating(depth: int, rotate: str) -> None:
    """Make each stage's optimizer as the run's factory does (Adam), but ``RotatedAdam`` at the same
    step size for the delayed stages (``rotate="delayed"``) or every stage (``"all"``): afresh, since a
    worker process runs many runs."""

    def make(index, factory, names, params):
        optimizer = ORIGINAL(index, factory, names, params)
        if rotate == "all" or (rotate == "delayed" and index < depth - 1):
            return RotatedAdam(params, lr=optimizer.param_groups[0]["lr"])
        return optimizer

    stage_learning._make_optimizer = make


def learnt(job: tuple, knob: str, optimizer: str) -> dict:
    """Run ``job`` (``(stream, depth, compensation, knob's value, lr, seed)``) with ``optimizer`` at
    fidelity's fixed cut; the job's values by name, and the run's scores."""
    stream, depth, compensation, _, lr, seed = job
    config = Config(stream, depth, "graph-stash", compensation, seed, runs.cut(stream, depth), optimizer, lr)
    row = runs.run(config, 3000)
    named = dict(zip(("stream", "depth", "compensation", knob, "lr", "seed"), job))
    return named | {"loss": row["loss"], "accuracy": row["accuracy"], "diverged_at": row["diverged_at"]}


def one(job: tuple) -> dict:
    rotating(job[1], job[3])
    return learnt(job, "rotate", "adam")


DEFAULT = "step-scale+optimizer-prediction+long-momentum"
CONFIGS = (  # (depth, compensation, which stages rotate)
    (1, "", "none"),
    (1, "", "all"),
    (2, DEFAULT, "none"),
    (2, "step-scale", "none"),
    (2, "step-scale", "delayed"),
    (2, "", "delayed"),
)


def at_own_steps(one, tuning: list[tuple], knobs: int) -> None:
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


def main() -> None:
    streams = sys.argv[1].split(",") if len(sys.argv) > 1 else ["camera", "digits", "shuffled"]
    at_own_steps(
        one, [(s, d, c, r, lr, TUNING_SEED) for s in streams for d, c, r in CONFIGS for lr in own_grid("adam")], 3
    )


if __name__ == "__main__":
    main()

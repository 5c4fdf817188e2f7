"""How much learning with delay costs: each stream, sequential against D-stage pipelines.

Every configuration (a stream, an optimizer and its step size, a depth D, a grad mode, a
compensation, a seed) learns online, test-then-train, through the ``inline`` executor: the
numbers are those of a real D-stage pipeline (the executors are tested equal), but the run
measures learning, not hardware, and needs one core. D = 1 is sequential online learning. Each run is scored over the whole stream
and over its last quarter alone: the first says what the delay costs in all, the second what it
still costs once most has been learnt.

The cut at each depth is, by default, fixed (``FIXED_CUTS``: cuts that a learning ``Pipeline``
given ``balance=D`` chose on the development machine), so that the figures follow from the
configuration alone; ``cut="planned"`` plans it afresh on the machine that runs the bench, as
such a pipeline would (``steady_cut``: as fast as the fastest cut within 10%, with the fewest
weights delayed), once per model and depth, so that every run at that depth uses the same cut;
``cut="even"`` gives each stage the same number of layers, to show what the choice of cut is worth.

Each optimizer (``OPTIMIZERS``: plain SGD, SGD with momentum 0.9, Adam) learns each stream at the
step size of ``LR_GRID`` that suits sequential learning of it best on ``TUNING_SEED``
(``tuning_configs``, ``best_step_sizes``), so that a pipeline is held to a well-tuned baseline;
or, in the user's view, each configuration learns at its own best step size, chosen on
``TUNING_SEED`` and reported on other seeds (``own_step_tuning``, ``own_best_steps``,
``at_own_steps``; see ``fidelity_tuning``).

Streams:
- ``digits``: ``streams.moving_digits``, a small CNN classifying each frame (accuracy);
- ``shuffled``: the same frames in i.i.d. order, where the smoothness bet does not hold;
- ``camera``: ``streams.panning_camera``, a small convolutional net predicting the next frame
  (loss: mean squared error; the pair (frame, next frame) travels through the stages as a tuple
  and the loss takes only the output).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict
from typing import Any, cast

import torch
from torch import Tensor

from partime import GradMode, Pipeline, StageError, streams
from partime.internals import plan
from partime.metrics import OnlineMetrics
from partime.optim import MuonWithAdamW

from .configs import (
    COMPENSATIONS,
    CUTS,
    DEFAULT,
    DEFAULT_GRAD_MODE,
    DIGITS_LR,
    FIXED_CUTS,
    GRAD_MODES,
    OPTIMIZERS,
    STREAMS,
    Config,
    automatic,
    choice,
    choices,
    compensations,
    picked,
)
from .models import Carry, camera_model, digits_model, even_balance, loss_named, model_named, model_of, next_frame_error
from .pool import worker_pool
from .report import (
    COMPENSATION_LINES,
    MODE_COLOURS,
    OPTIMIZER_NAMES,
    default_label,
    headline,
    markdown,
    own_step_summary,
    own_step_table,
    plot,
    summarise,
    write,
)
from .tuning import (
    LARGER_STEP,
    LR_GRID,
    SMALLER_STEP,
    TUNING_SEED,
    OwnSteps,
    StepSizes,
    at_every_own_step,
    at_own_steps,
    best_step_sizes,
    own_best_steps,
    own_grid,
    reported_seeds,
    tuning_configs,
)

# What moved to fidelity_configs, fidelity_tuning and fidelity_report is still reached as fidelity.NAME.
__all__ = [
    "BATCH",
    "COMPENSATIONS",
    "COMPENSATION_LINES",
    "CUTS",
    "DEFAULT",
    "DEFAULT_GRAD_MODE",
    "DIGITS_LR",
    "FIXED_CUTS",
    "GRAD_MODES",
    "HOLD",
    "LARGER_STEP",
    "LR_GRID",
    "MODE_COLOURS",
    "OPTIMIZERS",
    "OPTIMIZER_NAMES",
    "SMALLER_STEP",
    "STREAMS",
    "TUNING_SEED",
    "Carry",
    "Config",
    "OwnSteps",
    "StepSizes",
    "at_every_own_step",
    "at_own_steps",
    "automatic",
    "best_step_sizes",
    "camera_model",
    "choice",
    "choices",
    "compensations",
    "configs",
    "cut",
    "default_label",
    "digits_model",
    "even_balance",
    "headline",
    "markdown",
    "next_frame_error",
    "optimizer_factory",
    "own_best_steps",
    "own_grid",
    "own_step_summary",
    "own_step_table",
    "own_step_tuning",
    "picked",
    "plot",
    "reported_seeds",
    "run",
    "run_all",
    "samples_of",
    "summarise",
    "tuning_configs",
    "write",
]

log = logging.getLogger(__name__)

HOLD, BATCH = 10, 4  # digits: each digit held 10 frames; 4 independent streams per sample


def samples_of(config: Config, frames: int) -> tuple[Iterator[Any], Iterator[Any] | None]:
    """The first ``frames`` samples of ``config``'s stream and seed, and their targets (None on the
    camera, whose samples are (frame, next frame) pairs)."""
    if config.stream == "camera":
        pairs = streams.next_frame_pairs(streams.panning_camera(frames + 1, seed=config.seed, size=16, batch=BATCH))
        return iter(pairs), None
    make = streams.moving_digits if config.stream == "digits" else streams.shuffled_digits
    data = make(frames, seed=config.seed, hold=HOLD, batch=BATCH)
    xs, ys = itertools.tee(data)
    return (x for x, _ in xs), (y for _, y in ys)


def run(config: Config, frames: int) -> dict[str, Any]:
    """Learn ``frames`` samples of the stream under ``config``; the scores and their history."""
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    camera = config.stream == "camera"
    model, loss_fn = model_named(model_of(config.stream)), loss_named(model_of(config.stream))
    optimizer = optimizer_factory(config.optimizer, config.lr)
    xs, ys = samples_of(config, frames)
    targets: list[Tensor] = []
    if ys is not None:
        ys = _recording(ys, targets)
    metrics = OnlineMetrics(window=500)
    late = OnlineMetrics(window=500)  # the last quarter of the stream: what the delay costs once learnt
    late_frames = frames // 4
    late_from = frames - late_frames
    diverged_at = None
    balance = list(config.balance) if config.balance else even_balance(len(model), config.depth)
    # names from the command line and the configs, as typed: the Pipeline refuses an unknown one
    compensation: Any = tuple(config.compensation.split("+")) if config.compensation else ()
    with Pipeline(
        model,
        balance,
        executor="inline",
        threads=1,
        loss_fn=loss_fn,
        optimizer=optimizer,
        grad_mode=cast(GradMode, config.grad_mode),
        compensation=compensation,
    ) as pipe:
        try:
            for result in pipe.stream(xs, ys):
                # test-then-train: the output was computed before this sample's gradient was applied
                target = targets[result.index] if targets else None
                # Never skipped (nonfinite="raise"): the model's output, a tensor (the camera model's, a tuple).
                output = cast(tuple[Tensor, ...], result.output)[0] if camera else cast(Tensor, result.output)
                metrics.update(output, target, result.loss)
                if result.index >= late_from:
                    late.update(output, target, result.loss)
        except StageError as exc:
            if "not finite" not in exc.message:
                raise
            diverged_at = exc.sample  # learning blew up: a result of its own, not a failure of the run
    history = metrics.history()["rolling_loss" if camera else "rolling_accuracy"]
    accuracy = late_accuracy = None
    if not camera:  # the samples after a divergence count as misses
        accuracy = _share_correct(metrics, frames)
        if late_frames:  # under 4 frames there is no last quarter
            late_accuracy = _share_correct(late, late_frames)
    diverged = diverged_at is not None
    return dict(
        asdict(config),
        balance=balance,
        label=config.label,
        frames=frames,
        accuracy=accuracy,
        loss=None if diverged else metrics.loss,
        late_accuracy=late_accuracy,
        late_loss=None if diverged or not late.count else late.loss,
        diverged_at=diverged_at,
        history=history[:: max(1, len(history) // 200)],
    )


def optimizer_factory(name: str, lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> optimizer`` for one of ``OPTIMIZERS``: plain SGD, SGD with momentum 0.9, Adam,
    NAdam with β1 = 0.99 and decoupled weight decay (AsyncPP's recipe; no decay by default), Muon
    for the matrices and AdamW for the rest (``partime.optim.MuonWithAdamW``)."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    if name == "nadam":
        return lambda params: torch.optim.NAdam(params, lr=lr, betas=(0.99, 0.999), decoupled_weight_decay=True)
    if name == "muon":
        return lambda params: MuonWithAdamW(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def _share_correct(metrics: OnlineMetrics, frames: int) -> float:
    """The share of the ``frames × BATCH`` rows that ``metrics`` scored correct (unscored rows are misses)."""
    return metrics.accuracy * metrics.rows / (frames * BATCH) if metrics.rows else 0.0


def _recording(ys: Iterator[Tensor], into: list[Tensor]) -> Iterator[Tensor]:
    for y in ys:
        into.append(y)
        yield y


def cut(stream: str, depth: int, how: str = "fixed") -> tuple[int, ...]:
    """Layers per stage of the stream's model at ``depth``: ``"fixed"``, ``FIXED_CUTS``'s (a
    ValueError for a depth it does not hold); ``"planned"`` as a learning
    ``Pipeline(balance=depth)`` would cut it on this machine (timed on one thread on a sample of
    the stream); or ``"even"``, the same number of layers in each stage (the larger stages first)."""
    if how not in CUTS:
        raise ValueError(f"unknown cut {how!r}; choose from {', '.join(CUTS)}")
    model_name = model_of(stream)
    if how == "fixed" and depth > 1:
        if (model_name, depth) not in FIXED_CUTS:
            held = ", ".join(str(d) for m, d in FIXED_CUTS if m == model_name)
            raise ValueError(
                f"no fixed cut of the {model_name} model at D = {depth} (fixed cuts: D = {held}); "
                "pass cut 'planned' (--cut planned) or 'even'"
            )
        return FIXED_CUTS[model_name, depth]
    model = model_named(model_name)
    if how != "planned":  # even, or fixed at D = 1: the whole model
        return tuple(even_balance(len(model), depth))
    xs, _ = samples_of(Config(stream, depth), 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return plan(model, depth, next(xs), learning=True).balance
    finally:
        torch.set_num_threads(threads)


def configs(
    stream_names: Sequence[str],
    depths: Sequence[int],
    seeds: int,
    how: str = "fixed",
    step_sizes: StepSizes | None = None,
    only: Collection[str] | None = None,
) -> list[Config]:
    """Sequential, and every grad mode and its compensations at each depth (those that ``only``
    picks, by the names of ``choices``; None: all), for each seed and each optimizer of
    ``step_sizes`` (default: plain SGD at ``DIGITS_LR``); every run of one model at one depth cut
    the same way (``cut``): the shuffled control as moving digits."""
    step_sizes = step_sizes or {(stream, "sgd"): DIGITS_LR for stream in stream_names}
    models = {stream: model_of(stream) for stream in stream_names}
    cuts = {(model, depth): cut(model, depth, how) for model in dict.fromkeys(models.values()) for depth in depths}
    out = []
    for (stream, opt), lr in step_sizes.items():
        for seed in range(seeds):
            out.append(Config(stream, 1, seed=seed, optimizer=opt, lr=lr))
            for depth, mode in itertools.product(depths, GRAD_MODES):
                for comp in compensations(mode, opt):
                    if picked(mode, comp, opt, only):
                        out.append(Config(stream, depth, mode, comp, seed, cuts[models[stream], depth], opt, lr))
    return out


def own_step_tuning(
    stream_names: Sequence[str],
    depths: Sequence[int],
    optimizers: Sequence[str],
    how: str = "fixed",
    only: Collection[str] | None = None,
) -> list[Config]:
    """What ``configs`` runs with each of ``optimizers`` (``only`` as there), each configuration,
    sequential included, on ``TUNING_SEED`` at every step size of its optimizer's ``own_grid``."""
    smallest = {(stream, opt): own_grid(opt)[0] for stream in stream_names for opt in optimizers}
    return at_every_own_step(configs(stream_names, depths, 1, how, smallest, only))


def run_all(
    cfgs: Sequence[Config], frames: int, jobs: int = 1, progress: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Every run, ``jobs`` at a time in worker processes; rows in the order of ``cfgs``."""
    rows: list[dict[str, Any]] = []
    if jobs <= 1:
        for config in cfgs:
            rows.append(run(config, frames))
            if progress:
                progress(rows[-1])
        return rows
    with worker_pool(jobs) as pool:
        for row in pool.map(run, cfgs, itertools.repeat(frames)):
            rows.append(row)
            if progress:
                progress(row)
    return rows

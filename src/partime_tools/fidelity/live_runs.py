"""The live view's runs: the plain loop and pipelines of each depth learning the part of a live stream each keeps.

A live stream arrives faster than the plain loop (sequential online learning, D = 1) learns from
it. The plain loop keeps fewer samples and learns from each at once; a D-stage pipeline may be
faster, so keep more, but learns with delay. The plain loop runs once per stream, optimizer and
rate; a pipeline contends at each depth asked for, beside it. Each contender keeps what
``fidelity_live.drop_schedule`` says it keeps at its time per sample (``Times``) and learns from
that, test-then-train, through the ``inline`` executor: what it learns does not depend on the
machine it runs on, only on the times it is given. A pipeline learns as a ``Pipeline`` does
when nothing is chosen (its default grad mode and compensation); the plain loop is the same
``Pipeline`` with one stage.

The stream is ``partime fidelity``'s (``digits``, ``shuffled``, ``camera``). Its first ``frames``
samples are the live part; the samples after it (``held_out`` of them) score each contender's
final model, with no learning. Each contender learns at the step size of ``LR_GRID`` that suits it
best on ``TUNING_SEED`` of its live run (``tuning_configs``, ``best_step_sizes``); the runs of
``configs`` are reported on other seeds (``fidelity_tuning.reported_seeds``).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

import torch
from torch import Tensor, nn

from partime import Pipeline, StageError
from partime.internals import AUTO
from partime.metrics import OnlineMetrics

from .live import drop_schedule
from .models import loss_named, model_named, model_of, next_frame_error
from .pool import worker_pool
from .runs import BATCH, LR_GRID, TUNING_SEED, Config, automatic, optimizer_factory, samples_of

CONTENDERS = ("plain", "pipeline")
HELD_OUT = 500
"""Samples after the live part that score each final model."""
WINDOW = 500
"""Results in the rolling score."""


@dataclass(frozen=True)
class Times:
    """Seconds per sample while learning: the plain loop's, and the pipeline's per tick at each depth."""

    plain: float
    pipeline: Mapping[int, float]

    def of(self, contender: str, depth: int) -> float:
        """The time of ``contender`` (one of ``CONTENDERS``); a pipeline's at ``depth`` (a
        KeyError for a depth it holds no time of)."""
        return self.plain if contender == "plain" else self.pipeline[depth]


TimesTable = dict[tuple[str, str], Times]
"""The ``Times`` of each (model, optimizer): ``model_of(stream)``, one of ``OPTIMIZERS``."""
Cuts = dict[tuple[str, str, int], tuple[int, ...]]
"""The pipeline's layers per stage for each (model, optimizer, depth): those whose ``Times`` were measured."""


@dataclass(frozen=True)
class LiveConfig:
    """One run: ``contender`` learning what it keeps of ``stream`` arriving at ``rate`` samples per
    second (``multiple`` times the plain loop's learning rate), busy ``seconds_per_sample`` with
    each sample it takes, cut into ``balance`` (layers per stage: one stage for the plain loop,
    ``depth`` for a pipeline)."""

    stream: str
    contender: str
    optimizer: str
    lr: float
    multiple: float
    rate: float
    seconds_per_sample: float
    balance: tuple[int, ...]
    seed: int = TUNING_SEED

    @property
    def depth(self) -> int:
        """The number of stages: 1 for the plain loop."""
        return len(self.balance)

    @property
    def label(self) -> str:
        return "plain loop" if self.contender == "plain" else pipeline_label(self.optimizer, self.depth)


def pipeline_label(optimizer: str, depth: int) -> str:
    """What the ``depth``-stage pipeline learns with under ``optimizer``: ``Pipeline``'s default
    grad mode and compensation (``"auto"``: what it chooses for the optimizer), as ``partime
    fidelity`` labels it."""
    defaults = inspect.signature(Pipeline).parameters
    compensation = defaults["compensation"].default
    if compensation == AUTO:
        names = automatic(optimizer)
    else:
        names = compensation if isinstance(compensation, str) else "+".join(compensation)
    return Config("digits", depth, defaults["grad_mode"].default, names).label


def stream_items(stream: str, seed: int, samples: int) -> Iterator[Any]:
    """The first ``samples`` samples of ``partime fidelity``'s ``stream`` from ``seed``, as
    ``Pipeline.stream`` takes them: ``(x, y)`` pairs of the digits, the camera's ``(frame, next frame)``."""
    xs, ys = samples_of(Config(stream, 1, seed=seed), samples)
    return xs if ys is None else zip(xs, ys)


def loss_of(model: nn.Module, stream: str) -> Callable[[Any], Tensor]:
    """The loss of ``model`` on one item of ``stream_items`` (forward and loss), to call ``backward`` on."""
    if stream == "camera":
        return lambda item: next_frame_error(model(item))
    cross_entropy = nn.CrossEntropyLoss()
    return lambda item: cross_entropy(model(item[0]), item[1])


def run(config: LiveConfig, frames: int, held_out: int = HELD_OUT) -> dict[str, Any]:
    """``config``'s contender learning the samples it keeps of ``frames`` arriving live, then its
    final model scored on the ``held_out`` samples after them; the scores and their history."""
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    camera = config.stream == "camera"
    model = model_named(model_of(config.stream))
    schedule = drop_schedule(frames, config.rate, config.seconds_per_sample)
    went_in = {entry.index for entry in schedule}
    items = stream_items(config.stream, config.seed, frames + held_out)
    live = itertools.islice(items, frames)
    metrics = OnlineMetrics(window=WINDOW)
    history: list[tuple[float, float]] = []
    diverged_at = None
    trained = None
    with Pipeline(
        model,
        list(config.balance),
        executor="inline",
        threads=1,
        loss_fn=loss_named(model_of(config.stream)),
        optimizer=optimizer_factory(config.optimizer, config.lr),
    ) as pipe:
        try:
            for result in pipe.stream(item for k, item in enumerate(live) if k in went_in):
                # test-then-train: the output was computed before this sample's gradient was applied
                output = cast(tuple[Tensor, ...], result.output)[0] if camera else cast(Tensor, result.output)
                metrics.update(output, None if camera else cast(Tensor, result.target), result.loss)
                rolling = metrics.rolling_loss if camera else metrics.rolling_accuracy
                history.append((schedule[result.index].arrived, rolling))
            trained = pipe.module
        except StageError as exc:
            if "not finite" not in exc.message:
                raise
            # learning blew up: a result of its own, not a failure of the run
            diverged_at = frames if exc.sample is None else schedule[exc.sample].index  # None: after the stream
    for _ in live:  # what a run that diverged left of the live part: the held-out samples come after it
        pass
    score = None
    if not camera:  # the kept samples after a divergence count as misses
        score = metrics.accuracy * metrics.rows / (len(schedule) * BATCH) if metrics.rows else 0.0
    elif diverged_at is None:
        score = metrics.loss
    return dict(
        asdict(config),
        label=config.label,
        depth=config.depth,
        frames=frames,
        seconds=frames / config.rate,
        kept=len(schedule),
        metric="loss" if camera else "accuracy",
        score=score,
        held_out=None if trained is None or not held_out else held_out_score(trained, items, camera),
        held_out_samples=held_out,
        diverged_at=diverged_at,
        history=history[:: max(1, len(history) // 200)],
    )


def held_out_score(model: nn.Module, items: Iterator[Any], camera: bool) -> float:
    """``model``'s score on ``items`` with no learning: accuracy over their rows, or the camera's
    mean next-frame error."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for item in items:
            if camera:
                total += float(next_frame_error(model(item)))
                count += 1
            else:
                x, y = item
                total += float((model(x).argmax(dim=-1) == y).sum())
                count += y.numel()
    return total / count


def tuning_configs(
    stream_names: Sequence[str],
    optimizers: Sequence[str],
    multiples: Sequence[float],
    depths: Sequence[int],
    times: TimesTable,
    cuts: Cuts,
) -> list[LiveConfig]:
    """Each contender (the plain loop, a pipeline at each of ``depths``) on each stream, optimizer
    and rate at every step size of its grid, on ``TUNING_SEED``."""
    return [
        replace(config, lr=lr)
        for config in _contenders(stream_names, optimizers, multiples, depths, times, cuts)
        for lr in LR_GRID[config.optimizer]
    ]


LiveStepSizes = dict[tuple[str, str, float, str, int], float]
"""The step size of each (stream, optimizer, multiple, contender, depth): depth 1 for the plain loop."""


def step_key(row: dict[str, Any]) -> tuple[str, str, float, str, int]:
    """The key of ``LiveStepSizes`` of a run's row."""
    return (row["stream"], row["optimizer"], row["multiple"], row["contender"], row["depth"])


def best_step_sizes(rows: Sequence[dict[str, Any]]) -> LiveStepSizes:
    """For each stream, optimizer, rate and contender (a pipeline at each depth) among ``rows``,
    the step size whose run scored best over the samples it kept (a diverged run never wins): the
    highest accuracy, or the lowest loss on the camera."""
    best: dict[tuple[str, str, float, str, int], tuple[float, float]] = {}
    for row in rows:
        if row["diverged_at"] is not None or row["score"] is None:
            score = -float("inf")
        else:
            score = -row["score"] if row["metric"] == "loss" else row["score"]
        key = step_key(row)
        if key not in best or score > best[key][0]:
            best[key] = (score, row["lr"])
    return {key: lr for key, (_, lr) in best.items()}


def configs(
    stream_names: Sequence[str],
    optimizers: Sequence[str],
    multiples: Sequence[float],
    depths: Sequence[int],
    times: TimesTable,
    cuts: Cuts,
    seeds: Sequence[int],
    step_sizes: LiveStepSizes,
) -> list[LiveConfig]:
    """Each contender (the plain loop, a pipeline at each of ``depths``) on each stream, optimizer
    and rate at its step size of ``step_sizes``, on each of ``seeds``."""
    return [
        replace(c, lr=step_sizes[c.stream, c.optimizer, c.multiple, c.contender, c.depth], seed=seed)
        for c in _contenders(stream_names, optimizers, multiples, depths, times, cuts)
        for seed in seeds
    ]


def _contenders(
    stream_names: Sequence[str],
    optimizers: Sequence[str],
    multiples: Sequence[float],
    depths: Sequence[int],
    times: TimesTable,
    cuts: Cuts,
) -> Iterator[LiveConfig]:
    """The contenders of each stream, optimizer and rate (``multiple`` times the plain loop's
    learning rate, 1 / its time per sample): the plain loop once (every layer in one stage), then
    the pipeline at each of ``depths`` (cut as ``cuts`` says), the step size still to choose."""
    for stream, optimizer, multiple in itertools.product(stream_names, optimizers, multiples):
        model = model_of(stream)
        measured = times[model, optimizer]
        rate = multiple / measured.plain
        layers = sum(cuts[model, optimizer, depths[0]])
        yield LiveConfig(stream, "plain", optimizer, 0.0, multiple, rate, measured.plain, (layers,))
        for depth in depths:
            cut = cuts[model, optimizer, depth]
            seconds = measured.of("pipeline", depth)
            yield LiveConfig(stream, "pipeline", optimizer, 0.0, multiple, rate, seconds, cut)


def run_all(
    cfgs: Sequence[LiveConfig],
    frames: int,
    held_out: int = HELD_OUT,
    jobs: int = 1,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every run, ``jobs`` at a time in worker processes; rows in the order of ``cfgs``."""
    rows: list[dict[str, Any]] = []
    with worker_pool(jobs) if jobs > 1 else nullcontext() as pool:
        more = (frames for _ in cfgs), (held_out for _ in cfgs)
        for row in pool.map(run, cfgs, *more) if pool else map(run, cfgs, *more):
            rows.append(row)
            if progress:
                progress(row)
    return rows

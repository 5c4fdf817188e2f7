"""The demo's online learning (``partime demo``, its second part): one model learnt from moving
digits by the plain loop and by a pipeline of ``DEPTH`` stages, accuracy against seconds.

The stream is ``streams.moving_digits`` (scikit-learn's handwritten digits drifting, turning and
scaling smoothly, ``BATCH`` streams side by side, each digit held ``HOLD`` frames); the model is
``digits_convnet``, whose stages at D = 2 take a few milliseconds a sample each, enough for two
cores to gain on a pipeline's fixed cost per tick. Three learners take the same samples in the
same order, from the same weights, with SGD at the same step size ``LR`` (the plain loop's best
of ``STEP_SIZES`` on seed ``TUNING_SEED`` of the stream, by held-out accuracy: ``plain_accuracies``):

- the plain loop (forward, loss, backward, step per sample) on one thread;
- the plain loop on every core this process may use (what a user would run instead);
- ``Pipeline(model, DEPTH)`` with the library's defaults (balance by timing, grad mode,
  ``compensation="auto"``), one thread per stage process.

Each result is scored before its own gradient reaches the weights (test-then-train), so the
rolling accuracy is an honest online figure; each learner's clock starts when it is offered its
first sample (the pipeline's includes starting its workers). The figures say, at ``MARKS`` moments
of the fastest learner's run and at the end of each other one, how many samples each had learnt
and its rolling accuracy then;
each learner's samples per second; and the accuracy of each trained model on held-out digits
(another seed, shuffled), which says it learnt digits, not just the last few labels.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from rich.progress import Progress, TaskID
from rich.table import Table
from torch import Tensor, nn

from partime import Pipeline, streams
from partime.metrics import OnlineMetrics

from ..fidelity.runs import BATCH, HOLD

DEPTH = 2
SIZE = 24  # pixels a side of the moving digits
WIDTH = 16  # channels of the first blocks; deeper blocks have twice and four times as many
LR = 0.03  # SGD's step size for every learner (see TUNING_SEED)
STEP_SIZES = (0.01, 0.03, 0.05, 0.1)
TUNING_SEED = 1  # the stream's seed on which LR was chosen: plain_accuracies(STEP_SIZES, 4000)
WINDOW = 200  # rows (digits) in the rolling accuracy
MARKS = 6  # moments of the fastest learner's run the figures give every learner's accuracy at

LEARNERS = {
    "plain_1thread": "plain loop, 1 thread",
    "plain_allcores": "plain loop, {threads} threads",
    "pipeline": f"pipeline D={DEPTH}, 1 thread a stage",
}
"""The learners by the key of their figures, and their names in the table."""


def digits_convnet(seed: int = 0) -> nn.Sequential:
    """A convolutional net for ``SIZE x SIZE`` grey digits, ten logits: five 3x3 convolution blocks
    (``WIDTH``, ``WIDTH``, 2x, 2x and 4x as many channels; ReLU; max-pooled to half the size after the
    second, fourth and fifth) and a head (a hidden layer of 128), six top-level blocks to cut between.

    The convolutions are He-initialised (with PyTorch's default a five-deep stack barely learns from
    this stream); the weights depend only on ``seed``, not on the global random state.
    """
    w = WIDTH
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(
            nn.Sequential(nn.Conv2d(1, w, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(w, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Flatten(), nn.Linear(4 * w * (SIZE // 8) ** 2, 128), nn.ReLU(), nn.Linear(128, 10)),
        )
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(cast(Tensor, module.bias))
    return model


@dataclass
class LearnerRun:
    """One learner's run: after each result, the seconds since its first sample was offered and the
    rolling accuracy; the scores of the whole stream, and the trained model."""

    seconds: list[float]
    rolling: list[float]
    metrics: OnlineMetrics
    model: nn.Module

    def at(self, moment: float) -> tuple[int, float]:
        """Samples learnt and the rolling accuracy as they stood ``moment`` seconds into the run
        (0 and nan before the first result)."""
        done = sum(1 for s in self.seconds if s <= moment)
        return done, self.rolling[done - 1] if done else math.nan


Data = tuple[list[Tensor], list[Tensor]]
Report = Callable[[float], None]


def learn_plain(model: nn.Module, data: Data, lr: float, threads: int, report: Report | None = None) -> LearnerRun:
    """The plain loop on a copy of ``model``: forward, loss, backward, SGD step at ``lr`` per sample
    of ``data`` (samples, targets), torch on ``threads`` threads; each output scored before its
    step. ``report`` is given the rolling accuracy after each sample."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    metrics, seconds, rolling = OnlineMetrics(window=WINDOW), [], []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        for x, y in zip(*data, strict=True):
            optimizer.zero_grad()
            output = model(x)
            loss = loss_fn(output, y)
            metrics.update(output.detach(), y, loss.detach())  # scored before its own step
            loss.backward()
            optimizer.step()
            seconds.append(time.perf_counter() - start)
            rolling.append(metrics.rolling_accuracy)
            if report is not None:
                report(metrics.rolling_accuracy)
    finally:
        torch.set_num_threads(before)
    return LearnerRun(seconds, rolling, metrics, model)


def learn_pipelined(model: nn.Module, data: Data, lr: float, report: Report | None = None) -> tuple[LearnerRun, str]:
    """``Pipeline(model, DEPTH)`` with its defaults, SGD at ``lr``, one thread a stage process, on
    ``data``; each result scored as it comes out (before its own gradient was applied). With the
    pipeline's partition, in words."""
    xs, ys = data
    metrics, seconds, rolling = OnlineMetrics(window=WINDOW), [], []

    def optimizer(params):
        return torch.optim.SGD(params, lr=lr)

    pipe = Pipeline(
        model, DEPTH, executor="process", loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer, sample=xs[0], threads=1
    )
    with pipe:
        start = time.perf_counter()
        for result in pipe.stream(iter(xs), iter(ys)):
            seconds.append(time.perf_counter() - start)
            output = cast(Tensor, result.output)  # never skipped (nonfinite="raise"): the model's output
            metrics.update(output, ys[result.index], result.loss)
            rolling.append(metrics.rolling_accuracy)
            if report is not None:
                report(metrics.rolling_accuracy)
        trained = pipe.module
    return LearnerRun(seconds, rolling, metrics, trained), str(pipe.partition)


def moving_digits(n: int, seed: int) -> Data:
    """The first ``n`` samples of the moving digits the demo learns from, and their targets."""
    data = list(streams.moving_digits(n, seed=seed, size=SIZE, hold=HOLD, batch=BATCH))
    return [x for x, _ in data], [y for _, y in data]


def heldout_digits(n: int, seed: int) -> tuple[Tensor, Tensor]:
    """``n x BATCH`` held-out digits (``streams.shuffled_digits`` of ``seed``) and their labels."""
    test = list(streams.shuffled_digits(n, seed=seed, size=SIZE, hold=HOLD, batch=BATCH))
    return torch.cat([x for x, _ in test]), torch.cat([y for _, y in test])


def accuracy(model: nn.Module, xs: Tensor, ys: Tensor) -> float:
    """The fraction of ``xs`` whose predicted class (the argmax of ``model``'s logits) is in ``ys``."""
    with torch.no_grad():
        return (model(xs).argmax(1) == ys).float().mean().item()


def plain_accuracies(step_sizes: Sequence[float], samples: int, seed: int = TUNING_SEED) -> dict[float, float]:
    """The held-out accuracy of ``digits_convnet`` after the plain loop (one thread) learnt
    ``samples`` samples of moving digits of ``seed`` with SGD at each of ``step_sizes``: how ``LR``
    was chosen."""
    data = moving_digits(samples, seed)
    test_x, test_y = heldout_digits(200, seed + 1)
    return {lr: accuracy(learn_plain(digits_convnet(), data, lr, 1).model, test_x, test_y) for lr in step_sizes}


def race(bar: Progress, n: int, heldout: int, seed: int, threads: int) -> dict[str, Any]:
    """The three learners (module docstring) on the first ``n`` samples of moving digits of
    ``seed``, the plain loop's second on ``threads`` threads; scored on ``heldout`` samples of held-out
    digits (seed ``seed + 1``). The figures, each named ``learning_...``."""
    model = digits_convnet(seed)
    data = moving_digits(n, seed)
    test_x, test_y = heldout_digits(heldout, seed + 1)

    def progress(key: str) -> Report:
        name = LEARNERS[key].format(threads=threads)
        task: TaskID = bar.add_task(name, total=n)
        return lambda rolling: bar.update(task, advance=1, description=f"{name}: rolling accuracy {rolling:.2f}")

    runs = {
        "plain_1thread": learn_plain(model, data, LR, 1, progress("plain_1thread")),
        "plain_allcores": learn_plain(model, data, LR, threads, progress("plain_allcores")),
    }
    runs["pipeline"], partition = learn_pipelined(model, data, LR, progress("pipeline"))
    # moments spread over the fastest learner's run, where the others are still learning, then each
    # other one's end
    ends = sorted(run.seconds[-1] for run in runs.values())
    moments = [ends[0] * k / MARKS for k in range(1, MARKS)] + [ends[0]]
    moments += [end for end in ends[1:] if end > moments[-1]]
    figures: dict[str, Any] = dict(
        learn_samples=n,
        learning_model=f"digits_convnet: {SIZE}x{SIZE} px, {sum(p.numel() for p in model.parameters()):,} weights",
        learning_partition=partition,
        learning_lr=LR,
        learning_threads=threads,
        learning_seconds=moments,
        learning_heldout_before=accuracy(model, test_x, test_y),
    )
    for key, run in runs.items():
        marks = [run.at(moment) for moment in moments]
        figures |= {
            f"learning_{key}_samples_at": [done for done, _ in marks],
            f"learning_{key}_accuracy_at": [rolling for _, rolling in marks],
            f"learning_{key}_seconds": run.seconds[-1],
            f"learning_{key}_samples_per_s": n / run.seconds[-1],
            f"learning_{key}_rolling_accuracy": run.metrics.rolling_accuracy,
            f"learning_{key}_stream_accuracy": run.metrics.accuracy,
            f"learning_{key}_heldout": accuracy(run.model, test_x, test_y),
        }
    figures["learning_speedup"] = (
        figures["learning_pipeline_samples_per_s"] / figures["learning_plain_1thread_samples_per_s"]
    )
    figures["learning_speedup_allcores"] = (
        figures["learning_pipeline_samples_per_s"] / figures["learning_plain_allcores_samples_per_s"]
    )
    return figures


def learning_table(f: dict[str, Any]) -> Table:
    """The race's figures (``race``): seconds against samples learnt and rolling accuracy for each
    learner, then each one's samples per second, speed-up and held-out accuracy."""
    names = {key: name.format(threads=f["learning_threads"]) for key, name in LEARNERS.items()}
    table = Table(
        title=f"online learning: {f['learn_samples']} samples of moving digits ({BATCH} digits each), "
        f"SGD lr {f['learning_lr']:g} for all (the plain loop's best on seed {TUNING_SEED} of the stream)",
        caption=f"rolling accuracy over the last {WINDOW} digits, each scored before its own step "
        f"(samples learnt); {f['learning_model']}; {f['learning_partition']}",
    )
    table.add_column("seconds", justify="right")  # the last rows: where a slower learner ended
    for name in names.values():
        table.add_column(name, justify="right")
    for k, moment in enumerate(f["learning_seconds"]):
        cells = []
        for key in names:
            done, rolling = f[f"learning_{key}_samples_at"][k], f[f"learning_{key}_accuracy_at"][k]
            cells.append("–" if not done else f"{rolling:.2f} ({done:,})")
        table.add_row(f"{moment:.1f}", *cells)
    table.add_section()
    table.add_row("samples per second", *(f"{f[f'learning_{key}_samples_per_s']:.0f}" for key in names))
    table.add_row(
        "the pipeline's speed-up over it", f"{f['learning_speedup']:.2f}x", f"{f['learning_speedup_allcores']:.2f}x", ""
    )
    table.add_row(
        f"held-out accuracy (before: {f['learning_heldout_before']:.2f})",
        *(f"{f[f'learning_{key}_heldout']:.2f}" for key in names),
    )
    return table

"""A stage's worker loop, whatever carries its messages.

``run_segment`` is the body of every executor whose stages run on their own (a process, a
torch.distributed rank): a plain loop over the ticks of the schedule (``schedule.forward_sample``
and ``backward_sample``) that runs each tick's two halves (``tick.forward_half`` and
``backward_half``: what a stage does is written there, once) between blocking receives and sends
on its links. A flush is an END message that travels down the activation links and tells each
stage how many samples the segment has. A ``tick.Skip`` (a sample skipped under
``nonfinite="skip"``) travels as a SKIP message, a predicted sample's value (``tick.Data.predicted``)
as a PREDICT.

A link is anything with ``put(kind, index, tensors=(), scalar=0.0, *, check=None)`` and
``get(*, check=None) -> Message`` (``shared_memory.Channel`` is one); ``check`` is called while a
link waits and raises to abort.

The caller's ends of those links (samples and targets in, results out) are ``caller_ends.py``'s.

For checkpoints, ``run_segment`` notes in a ``Sent`` what a stage sent its neighbours during its
last tick (what they take at the next one: the values in transit at a tick boundary); a resumed
stage starts at the checkpoint's tick with those values waiting on its links (``in_flight.py``).

With a statistics record (``Links.record``, ``Pipeline(stats=True)``) each tick is timed
(``stats_record.TickClock``: its work, and its wait for the tick's permit and in its receives)
and the record gets both once the tick is over.
"""

from __future__ import annotations

import traceback as tb
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from ..core import schedule
from ..core import tick as tick_rule
from ..core.boundary_layout import Layout
from ..core.boundary_values import ValueSpec, as_tensors, rebuild
from ..core.stage import Stage
from ..core.stats_record import StatsRecord, TickClock
from ..core.tick import backward_half, forward_half
from ..result import Result
from .messages import KIND_DATA, KIND_END, KIND_PREDICT, KIND_SKIP, Message
from .waiting import SPIN_S, wait


class Link(Protocol):
    """One direction of messages between two workers (or a worker and the caller)."""

    def put(
        self,
        kind: int,
        index: int,
        tensors: Sequence[Tensor] = (),
        scalar: float = 0.0,
        *,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Send one message (waiting for room, asking ``check``); the sender keeps its tensors."""
        ...

    def get(self, *, check: Callable[[], None] | None = None) -> Message:
        """The oldest message, waiting for one (asking ``check``)."""
        ...


class Gate(Protocol):
    """A semaphore: the caller's permits, a worker's count of finished ticks."""

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool: ...

    def release(self) -> None: ...


@dataclass
class Links:
    """Where one stage's messages come from and go to."""

    index: int
    layout: Layout
    act_in: Link  # activations (or samples, for stage 0) and the END of each segment
    act_out: Link | None = None  # None for the last stage: it sends results instead
    grad_in: Link | None = None  # from the next stage, when learning and not last
    grad_out: Link | None = None  # to the previous stage, when learning and not first
    targets: Link | None = None  # last stage, supervised learning
    results: Link | None = None  # last stage
    permits: Gate | None = None  # released once per tick the caller offers, if gated
    ticks: Gate | None = None  # released by the worker once per finished tick, if counted
    spin_s: float = SPIN_S  # how long a wait for a permit spins before it blocks (0: threads under one GIL)
    record: StatsRecord | None = None  # the stage's statistics, written after each tick (None: none kept)


class Where:
    """What a worker is doing, for its error report."""

    sample: int | None = None
    phase: str = "start"

    def report(self, stage: int, exc: BaseException) -> dict[str, Any]:
        """A failure as data: the arguments of a ``StageError``."""
        text = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
        return dict(
            stage=stage, sample=self.sample, phase=self.phase, message=f"{type(exc).__name__}: {exc}", traceback=text
        )


@dataclass
class Sent:
    """What a stage sent to its neighbours during its last tick, as ``(sample, tensors,
    predicted)``: the values in transit at a tick boundary, which the neighbours take at the next
    tick. The tensors are None for a SKIP (a hole forward, a gradient that will not come back);
    ``predicted`` marks a PREDICT."""

    activation: tuple[int, tuple[Tensor, ...] | None, bool] | None = None
    gradient: tuple[int, tuple[Tensor, ...] | None, bool] | None = None

    def note(self, tick: int) -> None:
        """Tick ``tick`` (of its segment) is over: what it sent is in ``activation`` and ``gradient``."""


class SentLog(Sent):
    """A ``Sent`` that also keeps what the stage sent in each of its last ``ticks`` ticks: for a
    stage that may run ahead of the tick a checkpoint is taken at (ungated, in inference)."""

    def __init__(self, ticks: int):
        super().__init__()
        self._log: deque[tuple[int, Sent]] = deque(maxlen=ticks)

    def note(self, tick: int) -> None:
        self._log.append((tick, Sent(self.activation, self.gradient)))

    def at(self, tick: int) -> Sent:
        """What tick ``tick`` of the current segment sent (nothing, for a tick before the first)."""
        for noted, sent in reversed(self._log):
            if noted == tick:
                return sent
        if tick < 0:
            return Sent()
        raise LookupError(f"tick {tick} is not among the {len(self._log)} ticks noted: {[t for t, _ in self._log]}")


def run_stage(
    stage: Stage,
    links: Links,
    check: Callable[[], None],
    where: Where,
    sent: Sent,
    *,
    first: Links | None = None,
    tick: int = 0,
) -> None:
    """A stage's life in its worker: segment after segment, the first one from ``tick`` on ``first``
    (a resumed stage's links, ``resume``), every other on ``links``, until ``check`` raises
    (``waiting.Aborted``: the run is over) or the stage fails (its exception, with ``where``)."""
    run_segment(stage, first or links, check, where, tick=tick, sent=sent)
    while True:
        run_segment(stage, links, check, where, sent=sent)


def run_segment(
    stage: Stage, links: Links, check: Callable[[], None], where: Where, *, tick: int = 0, sent: Sent | None = None
) -> None:
    """The ticks of one segment, from ``tick`` (a resumed segment starts later than 0), until this
    stage's last tick in it; ``sent`` (if given) notes what each tick sends.

    With ``permits``, a tick starts only once the caller has offered it, so that no stage runs
    ahead of the caller and the weights can be read between ticks. On a failure inside the stage,
    ``where`` says how far it got (forward, loss, backward, step).
    """
    ticks = segment(stage, links, check, where, tick=tick, sent=sent)
    while True:
        try:
            next(ticks)
        except StopIteration as over:
            if over.value and links.permits is not None:
                links.permits.release()  # the permit it took is the next segment's first tick
            return
        _start_tick(links, check)


def segment(
    stage: Stage, links: Links, check: Callable[[], None], where: Where, *, tick: int = 0, sent: Sent | None = None
) -> Generator[int, None, bool]:
    """The ticks of one segment as a generator that yields each tick before it runs it: whoever
    drives it offers that tick (a worker waits for its permit; the caller runs a stage it hosts
    once per tick it offers) and takes the next item to have it run.

    A tick receives what it takes (the activation, the gradient) once it has started. The END of a
    segment comes as the activation of the first tick past its last sample, and is passed on. The
    generator returns after this stage's last tick in the segment: False, or True if the END came
    at a tick past the segment's end (the last stage's, in inference): the tick last yielded was
    then not run, and is the next segment's first. ``links.ticks`` counts every tick run. A failure
    inside the stage propagates, with ``where`` saying how far it got.
    """
    i, depth, learning = links.index, stage.config.depth, stage.config.learning
    sent = Sent() if sent is None else sent
    n: int | None = None
    clock = TickClock()
    if links.record is not None:
        links.record.begin(stage)
    try:
        while n is None or tick < schedule.segment_ticks(n, depth, learning):
            yield tick
            clock.start()
            message = None
            if schedule.forward_sample(i, tick, n) is not None:
                where.sample, where.phase = None, "receive"
                received = clock.get(links.act_in, check)
                if received.kind == KIND_END:  # the segment has n samples: this tick has no forward
                    n = received.index
                    if links.act_out is not None:  # not the last stage
                        links.act_out.put(KIND_END, n, check=check)
                    if tick >= schedule.segment_ticks(n, depth, learning):
                        return True
                else:
                    message = _message(received, links.layout.into(i))
            play_tick(stage, links, check, where, sent, tick, n, message, clock)
            if links.record is not None:
                links.record.tick(stage, *clock.end())
            _end_tick(links)
            tick += 1
    except BaseException:
        if where.phase in ("forward", "loss", "backward"):
            where.phase = stage.phase
        raise
    return False


def play_tick(
    stage: Stage,
    links: Links,
    check: Callable[[], None],
    where: Where,
    sent: Sent,
    tick: int,
    n: int | None,
    message: tick_rule.Passed | None,
    clock: TickClock,
) -> None:
    """Tick ``tick`` of stage ``links.index`` (of a segment of ``n`` samples, None while it is
    open): the forward half on ``message`` (None: no sample this tick), then the backward half if
    the schedule gives the stage a gradient, which it receives here; ``sent`` notes what it sends,
    ``clock`` counts the waits of its receives."""
    sent.activation = sent.gradient = None
    if message is not None:
        where.sample, where.phase = message.sample, "forward"
        forwarded = forward_half(stage, message, links.act_out is None, lambda: _target(links, check, clock))
        if forwarded.gradient is not None:
            sent.gradient = _put(links.grad_out, forwarded.gradient, check)
        if forwarded.activation is not None:
            sent.activation = _put(links.act_out, forwarded.activation, check)
        if forwarded.result is not None:
            _put_result(links.results, forwarded.result, check)
    if (
        stage.takes_gradient
        and links.grad_in is not None
        and schedule.backward_sample(links.index, tick, stage.config.depth, n) is not None
    ):
        where.sample, where.phase = None, "receive"  # (a stage with a gradient link learns, and is not last)
        received = _message(clock.get(links.grad_in, check), links.layout.activations[links.index])
        where.sample, where.phase = received.sample, "backward"
        back = backward_half(stage, received)
        if back is not None:
            sent.gradient = _put(links.grad_out, back, check)
    sent.note(tick)


def _message(received: Message, spec: ValueSpec) -> tick_rule.Passed:
    """The tick's message that a link's message of layout ``spec`` carries."""
    if received.kind == KIND_SKIP:
        return tick_rule.Skip(received.index)
    return tick_rule.Data(received.index, rebuild(spec, received.tensors), received.kind == KIND_PREDICT)


def _target(links: Links, check: Callable[[], None], clock: TickClock) -> Any:
    """The last stage's next target (None for a loss that takes none)."""
    if links.targets is None or links.layout.target is None:
        return None
    return rebuild(links.layout.target, clock.get(links.targets, check).tensors)


def _put(
    link: Any, message: tick_rule.Passed, check: Callable[[], None]
) -> tuple[int, tuple[Tensor, ...] | None, bool]:
    """Send ``message`` on ``link``; what was sent, as ``Sent`` notes it."""
    if isinstance(message, tick_rule.Skip):
        link.put(KIND_SKIP, message.sample, check=check)
        return message.sample, None, False
    tensors = as_tensors(message.value, "value")
    link.put(KIND_PREDICT if message.predicted else KIND_DATA, message.sample, tensors, check=check)
    return message.sample, tensors, message.predicted


def _put_result(link: Any, result: Result, check: Callable[[], None]) -> None:
    """Send the last stage's ``result`` to the caller (``result_of`` reads it): a skipped result
    as a SKIP, with its output and loss if it has them; a predicted one as a PREDICT."""
    tensors = () if result.output is None else as_tensors(result.output, "output")
    kind = KIND_SKIP if result.skipped else KIND_PREDICT if result.predicted else KIND_DATA
    link.put(kind, result.index, tensors, 0.0 if result.loss is None else result.loss, check=check)


def _start_tick(links: Links, check: Callable[[], None]) -> None:
    if links.permits is not None:
        wait(links.permits, check, links.spin_s)


def _end_tick(links: Links) -> None:
    if links.ticks is not None:
        links.ticks.release()

"""Live sources: arrival times, latency and ``when_behind`` (SPEC.md, "Live sources").

The traces run on a ``FakeClock`` that only the test's own loop moves on (the caller's work
between two results), so every arrival, drop and latency is exact, and the same under every
executor: what a take finds depends only on the clock, and the clock only on the results handed out.
"""

from __future__ import annotations

import re
import threading
import time
import weakref
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from partime import Pipeline
from partime.checkpoint.format import CheckpointError
from partime.core.stage.random_stream import derived
from partime.pipeline.arrivals import newest
from partime.planning.partition import split
from partime.sources import MONOTONIC, FakeClock, at_rate

EXECUTORS = ["inline", "process", "thread"]


def small_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 2))


def numbered(n: int) -> list[torch.Tensor]:
    """Sample ``k`` is ``[k, -k] / n``: every output tells its sample."""
    return [torch.tensor([k, -k], dtype=torch.float32) / n for k in range(n)]


def consume(results, clock: FakeClock, work: float) -> list:
    """Every result; the caller's ``work`` seconds (on ``clock``) after each one with an output."""
    out = []
    for r in results:
        out.append(r)
        if not r.dropped:
            clock.advance(work)
    return out


# -- the drop trace, by hand ---------------------------------------------------------------------
# 8 samples at 8 per second (sample k arrives at k/8 s); D = 2; the caller works 0.25 s after each
# result with an output. Times are binary fractions, so the fake clock's sums are exact.
#
#   take  clock  arrived (unread)   kept  dropped  fed   handed out (at)
#   1     0      0                  0     -        0     -
#   2     0.125  1 (slept until it)  1     -        1     r0 (0.125)            -> clock 0.375
#   3     0.375  2, 3               3     2        3     r1 (0.375)            -> 0.625, then d2 (0.625)
#   4     0.625  4, 5               5     4        5     r3 (0.625)            -> 0.875, then d4 (0.875)
#   5     0.875  6, 7               7     6        7     r5 (0.875)            -> 1.125, then d6 (1.125)
#   6     1.125  (ended)                                 flush: r7 (1.125)
DROPPED = [2, 4, 6]
HANDED_AT = [0.125, 0.375, 0.625, 0.625, 0.875, 0.875, 1.125, 1.125]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_drop_leaves_out_exactly_the_samples_replaced_while_waiting(executor):
    clock, xs = FakeClock(), numbered(8)
    model = small_model()
    with Pipeline(model, [2, 1], executor=executor) as pipe:
        results = consume(pipe.stream(at_rate(xs, 8, clock=clock), when_behind="drop"), clock, 0.25)
    assert [r.index for r in results] == list(range(8))  # none lost, none reordered
    assert [r.index for r in results if r.dropped] == DROPPED
    assert [r.offered_at for r in results] == [k / 8 for k in range(8)]
    assert [r.handed_at for r in results] == HANDED_AT
    assert [r.latency for r in results] == [h - k / 8 for k, h in enumerate(HANDED_AT)]
    with torch.no_grad():
        for r in results:
            if r.dropped:
                assert r.output is None and r.loss is None and r.target is None
            else:
                assert torch.equal(r.output, model(xs[r.index]))


def test_a_dropped_sample_waits_for_every_result_before_it_and_no_longer():
    clock, xs = FakeClock(), numbered(8)
    with Pipeline(small_model(), [1, 1, 1], executor="inline") as pipe:
        results = consume(pipe.stream(at_rate(xs, 8, clock=clock), when_behind="drop"), clock, 0.25)
    assert [r.index for r in results] == list(range(8))
    for r in results:
        if r.dropped:  # handed out right after the result before it: the caller's 0.25 s later
            assert r.handed_at == results[r.index - 1].handed_at + 0.25


class Busy(nn.Module):
    """A layer whose every forward takes ``seconds`` on ``clock``."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.advance(self.seconds)
        return x


def test_a_paced_source_begins_once_the_pipeline_has_started():
    """Starting a pipeline (its layout, here a forward of 1 s, and its first tick) is no reason to
    drop what a paced source sends next: sample 1 arrives one period after the start."""
    clock = FakeClock()
    with Pipeline(nn.Sequential(Busy(clock, 1.0)), 1, executor="inline") as pipe:
        results = list(pipe.stream(at_rate(numbered(4), 2, clock=clock), when_behind="drop"))
    started = results[0].handed_at
    assert started >= 2.0 and results[0].offered_at == 0.0
    assert [r.dropped for r in results] == [False, False, True, False]
    assert [r.offered_at for r in results] == [0.0, started + 0.5, started + 1.0, started + 1.5]


def supervised(n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, generator=gen), torch.randn(2, generator=gen)) for _ in range(n)]


def learner(executor: str, balance=(2, 1)) -> Pipeline:
    return Pipeline(
        small_model(),
        list(balance),
        executor=executor,
        loss_fn=nn.MSELoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )


@pytest.mark.parametrize("executor", EXECUTORS)
def test_learning_under_drop_is_learning_on_the_samples_that_went_in(executor):
    """The ticks are those of the samples that went in: the same losses and outputs, to the bit,
    as the inline reference given only those samples as a recorded stream."""
    clock, pairs = FakeClock(), supervised(24)
    with learner(executor) as pipe:
        results = consume(pipe.stream(at_rate(pairs, 8, clock=clock), when_behind="drop"), clock, 0.25)
        weights = pipe.module.state_dict()
    went_in = [r.index for r in results if not r.dropped]
    assert len(went_in) < len(pairs) and [r.index for r in results] == list(range(24))
    with learner("inline") as reference:
        expected = list(reference.stream([pairs[k] for k in went_in]))
        expected_weights = reference.module.state_dict()
    kept = [r for r in results if not r.dropped]
    assert [r.loss for r in kept] == [e.loss for e in expected]
    for r, e in zip(kept, expected):
        assert torch.equal(r.output, e.output) and torch.equal(r.target, pairs[r.index][1])
    for name, value in expected_weights.items():
        assert torch.equal(weights[name], value), name


def test_drop_with_separate_targets_skips_the_dropped_samples_targets():
    clock, pairs = FakeClock(), supervised(8)
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    with learner("inline") as pipe:
        results = consume(pipe.stream(at_rate(xs, 8, clock=clock), ys, when_behind="drop"), clock, 0.25)
    assert [r.index for r in results if r.dropped] == DROPPED
    for r in results:
        if not r.dropped:
            assert torch.equal(r.target, ys[r.index])


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_wait_takes_every_sample_late_and_says_how_late(executor):
    """Under "wait" a paced source loses nothing; a caller that takes 0.5 s per result at 4
    samples per second falls behind by 0.25 s per sample, and the latency shows it (the source
    began once sample 0 went in, before the caller's work on its result)."""
    clock, xs = FakeClock(), numbered(6)
    with Pipeline(small_model(), 1, executor=executor) as pipe:
        results = consume(pipe.stream(at_rate(xs, 4, clock=clock)), clock, 0.5)
    assert [r.index for r in results] == list(range(6)) and not any(r.dropped for r in results)
    assert [r.offered_at for r in results] == [k / 4 for k in range(6)]
    assert [r.handed_at for r in results] == [k / 2 for k in range(6)]
    assert [r.latency for r in results] == [k / 4 for k in range(6)]


def test_wait_on_a_paced_source_learns_as_on_the_recorded_stream_to_the_bit():
    pairs = supervised(16)
    with learner("process") as pipe:
        paced = list(pipe.stream(at_rate(pairs, 1000, clock=FakeClock())))
    with learner("process") as pipe:
        recorded = list(pipe.stream(pairs))
    assert [r.index for r in paced] == [r.index for r in recorded] == list(range(16))
    for a, b in zip(paced, recorded):
        assert a.loss == b.loss and torch.equal(a.output, b.output) and torch.equal(a.target, b.target)


def test_a_paced_source_that_is_late_for_a_second_keeps_one_waiting_sample():
    """Under "drop", memory stays bounded however far behind the caller is: of the samples that
    arrived while it worked, the reader holds the newest only; the rest are let go at once."""
    clock, alive = FakeClock(), []

    def frames():
        for k in range(400):
            frame = torch.full((64,), float(k))
            alive.append(weakref.ref(frame))
            yield frame

    most = 0
    with Pipeline(small_model_64(), [1, 1], executor="inline") as pipe:
        for r in pipe.stream(at_rate(frames(), 100, clock=clock), when_behind="drop"):
            most = max(most, sum(ref() is not None for ref in alive))
            if not r.dropped:
                clock.advance(1.0)  # 100 samples arrive meanwhile
    assert sum(ref() is None for ref in alive) >= 390
    assert most <= 4  # the caller's own reference, the pipeline's inputs in flight, the newest


def small_model_64() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 2))


# -- any iterable, read by a thread -------------------------------------------------------------


def paced_by_itself(n: int, period: float):
    """A source with a pace of its own (a camera): it sleeps, then yields."""
    for x in numbered(n):
        time.sleep(period)
        yield x


def source_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "partime-source"]


def test_any_iterable_under_drop_is_read_at_its_own_pace():
    xs = numbered(40)
    with Pipeline(small_model(), [2, 1], executor="process") as pipe:
        results = []
        for r in pipe.stream(paced_by_itself(40, 0.004), when_behind="drop"):
            results.append(r)
            if not r.dropped:
                time.sleep(0.02)  # far slower than the source
    assert [r.index for r in results] == list(range(40))
    dropped = [r for r in results if r.dropped]
    assert 10 <= len(dropped) < 40 and not results[-1].dropped  # the last arrival is never replaced
    assert all(r.output is None for r in dropped)
    with torch.no_grad():
        for r in results:
            if not r.dropped:
                assert torch.equal(r.output, small_model()(xs[r.index]))
    arrived = [r.offered_at for r in results]
    assert arrived == sorted(arrived) and all(r.latency >= 0 for r in results)
    assert not source_threads()


def test_a_failing_source_raises_its_error_and_its_thread_is_joined():
    def failing():
        yield from numbered(3)
        raise OSError("camera unplugged")

    with Pipeline(small_model(), [2, 1], executor="inline") as pipe:
        with pytest.raises(OSError, match="camera unplugged"):
            for _ in pipe.stream(failing(), when_behind="drop"):
                pass
    assert not source_threads()


def test_a_break_out_of_a_live_stream_joins_its_reader():
    def endless():
        while True:
            yield torch.zeros(2)

    with Pipeline(small_model(), [2, 1], executor="inline") as pipe:
        results = pipe.stream(endless(), when_behind="drop")
        for r in results:
            if r.index >= 5:
                break
        results.close()  # what leaving the loop does, once the generator is let go
    assert not source_threads()


def test_a_break_out_of_a_stalled_live_stream_returns_at_once_and_says_its_reader_is_blocked(caplog):
    stalled, released = threading.Event(), threading.Event()

    def stalling():
        yield from numbered(2)
        stalled.set()
        released.wait()  # a camera that stopped sending frames
        yield from numbered(2)

    try:
        with Pipeline(small_model(), 1, executor="inline") as pipe:
            results = pipe.stream(stalling(), when_behind="drop")
            with caplog.at_level("WARNING", logger="partime.pipeline.arrivals"):
                for r in results:
                    if r.index == 1:  # the last item before the source stalls
                        assert stalled.wait(5.0)
                        break
                start = time.monotonic()
                results.close()  # what leaving the loop does, once the generator is let go
                took = time.monotonic() - start
        assert took < 0.5
        [warning] = [r for r in caplog.records if r.name == "partime.pipeline.arrivals"]
        assert warning.levelname == "WARNING"
        assert re.search(
            r"thread reading its source \(generator .*stalling\) is still blocked in the source's iterator "
            r".*: it is a daemon thread, and it will end when the iterator yields",
            warning.getMessage(),
        )
    finally:
        released.set()
    for thread in source_threads():
        thread.join(5.0)
    assert not source_threads()


def test_an_unknown_policy_is_refused_at_once():
    with Pipeline(small_model(), 1, executor="inline") as pipe:
        with pytest.raises(ValueError, match=r"when_behind must be one of \('wait', 'drop'\), not 'skip'"):
            pipe.stream(numbered(2), when_behind="skip")


# -- arrival times everywhere ------------------------------------------------------------------


def test_step_and_a_recorded_stream_time_their_results_on_the_monotonic_clock():
    with Pipeline(small_model(), [2, 1], executor="inline") as pipe:
        before = time.monotonic()
        first = [pipe.step(x) for x in numbered(3)]
        rest = pipe.flush() + list(pipe.stream(numbered(3)))
        after = time.monotonic()
    results = [r for r in first if r is not None] + rest
    assert [r.index for r in results] == list(range(6))
    for r in results:
        assert before <= r.offered_at <= r.handed_at <= after and r.latency == r.handed_at - r.offered_at


def test_results_offered_before_a_checkpoint_was_loaded_have_no_latency():
    xs = numbered(6)
    with Pipeline(small_model(), [2, 1], executor="inline") as pipe:
        for x in xs[:4]:
            pipe.step(x)
        state = pipe.state_dict()
    with Pipeline(small_model(), [2, 1], executor="inline") as pipe:
        pipe.load_state_dict(state)
        results = pipe.flush()
    assert [r.index for r in results] == [3]
    assert results[0].latency != results[0].latency  # NaN: the arrival was not kept


def test_a_checkpoint_keeps_the_dropped_results_not_handed_out_yet():
    clock, xs = FakeClock(), numbered(8)
    with Pipeline(small_model(), [2, 1], executor="inline") as pipe:
        for r in pipe.stream(at_rate(xs, 8, clock=clock), when_behind="drop"):
            clock.advance(0 if r.dropped else 0.25)
            if r.index == 3:  # the trace above: 4 was dropped, 5 is in flight
                break
        state = pipe.state_dict()
    assert state["dropped"] == [4]
    with Pipeline(small_model(), [2, 1], executor="inline") as pipe:
        pipe.load_state_dict(state)
        rest = pipe.flush()
    assert [(r.index, r.dropped) for r in rest] == [(4, True), (5, False)]
    with torch.no_grad():
        assert torch.equal(rest[1].output, small_model()(xs[5]))
    state["dropped"] = [9]
    with pytest.raises(CheckpointError, match=r"dropped\[0\] is 9: .* before counters.next_index \(6\)"):
        Pipeline(small_model(), [2, 1], executor="inline").load_state_dict(state)


def test_at_rate_paces_in_real_time_and_refuses_a_bad_rate():
    start = time.monotonic()
    assert list(at_rate(range(5), 200)) == list(range(5))
    assert time.monotonic() - start >= 4 / 200
    for fps in (0, -1, float("inf"), float("nan"), "30", True, np.float64("nan"), np.int64(0), np.bool_(True)):
        with pytest.raises(ValueError, match="fps must be a finite number"):
            at_rate(range(3), fps)
    with pytest.raises(ValueError, match="a clock only moves on"):
        FakeClock().advance(-1)


@pytest.mark.parametrize(
    "fps", [Fraction(30000, 1001), np.float64(30.0), np.int64(30), np.float32(29.97), 30, 29.97], ids=repr
)
def test_at_rate_takes_any_real_number_of_items_per_second(fps):
    clock = FakeClock()
    source = at_rate(range(3), fps, clock=clock)
    assert source.fps == float(fps) and type(source.fps) is float
    assert [(item, clock.now()) for item in source] == [(k, k / float(fps)) for k in range(3)]


def test_newest_reads_a_live_source_as_drop_does_for_a_plain_loop():
    clock = FakeClock()
    seen = []
    for item, at, replaced in newest(at_rate(range(8), 8, clock=clock)):
        seen.append((item, at, replaced))
        clock.advance(0.25)
    # the source begins once the loop has done its work on item 0: item 1 arrives at 0.25 + 0.125
    assert seen == [(0, 0.0, 0), (1, 0.375, 0), (3, 0.625, 1), (5, 0.875, 1), (7, 1.125, 1)]
    assert MONOTONIC.now() == pytest.approx(time.monotonic(), abs=1.0)


def failing_after(n: int):
    """``numbered(n)``, then the error of a camera unplugged."""
    yield from numbered(n)
    raise OSError("camera unplugged")


@pytest.mark.parametrize(
    ("executor", "when_behind", "paced"),
    [
        ("inline", "drop", True),
        ("process", "drop", True),
        ("inline", "drop", False),
        ("thread", "drop", False),
        ("inline", "wait", True),
        ("inline", "wait", False),
    ],
)
def test_a_source_that_fails_gets_a_result_for_every_sample_it_gave_then_raises(executor, when_behind, paced):
    """A source that raises mid-stream: every sample it yielded before has its result, in order
    (with an output, or dropped), and then its error is raised; the indices are the samples'."""
    clock, model = FakeClock(), small_model()
    source = at_rate(failing_after(8), 8, clock=clock) if paced else failing_after(8)
    results = []
    with Pipeline(model, [2, 1], executor=executor) as pipe:
        with pytest.raises(OSError, match="camera unplugged"):
            for r in pipe.stream(source, when_behind=when_behind):
                results.append(r)
                if not r.dropped:
                    clock.advance(0.5)  # the caller's work: a paced take finds several items
        assert pipe.flush() == []  # nothing of the source's was left inside
        assert pipe.fed == 8
    assert [r.index for r in results] == list(range(8))
    assert not results[-1].dropped  # the last sample the source gave went in
    if when_behind == "wait":
        assert not any(r.dropped for r in results)
    with torch.no_grad():
        for r in results:
            assert (r.output is None) if r.dropped else torch.equal(r.output, model(numbered(8)[r.index]))
    assert not source_threads()


def dropout_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 512), nn.Dropout(0.5), nn.Linear(512, 512), nn.Dropout(0.5), nn.Linear(512, 3))


def drawn_as_read(made: list, n: int = 30):
    """``n`` samples drawn with ``torch.randn`` as they are read (kept in ``made``), at a pace of their own."""
    for _ in range(n):
        made.append(torch.randn(32, 6))
        yield made[-1]
        time.sleep(0.001)  # a source with a pace of its own: its draws fall among the stage's


@pytest.mark.parametrize(("executor", "balance"), [("inline", [5]), ("thread", [3, 2])])
def test_what_a_source_read_by_a_thread_draws_stays_out_of_the_stages_streams(executor, balance):
    """A plain source under "drop" is read by a thread of its own; it draws its samples with
    ``torch.randn`` while the stages draw their dropout masks (and while the pipeline starts, and
    while stage threads wait for the caller's turn). The samples are the seeded stream's, in order,
    and every output is the one the stages' own streams give for the samples that went in."""
    for seed in range(3):
        made: list = []
        model = dropout_model()
        torch.manual_seed(seed)
        origin = torch.get_rng_state()
        with Pipeline(model, balance, executor=executor) as pipe:
            results = [r for r in pipe.stream(drawn_as_read(made), when_behind="drop") if not r.dropped]
        torch.manual_seed(seed)
        assert all(torch.equal(x, torch.randn(32, 6)) for x in made)  # none drawn from a stage's stream
        # each stage's masks, sample by sample, from its own stream (stage 0 continues the caller's)
        streams, parts = [derived(origin, i) for i in range(len(balance))], split(model, balance)
        with torch.no_grad():
            for r in results:
                value = made[r.index]
                for i, part in enumerate(parts):
                    torch.set_rng_state(streams[i])
                    value = part(value)
                    streams[i] = torch.get_rng_state()
                assert torch.equal(r.output, value)

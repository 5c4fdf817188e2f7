"""What a pipeline owns and for how long: its own copy of the model, its workers (stopped when it is
dropped unclosed, untouched by a fork of its process), its workers' start-up failures, the index of
every sample offered, and each result's target."""

import gc
import logging
import math
import multiprocessing
import multiprocessing.util
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import psutil
import pytest
import torch
from models import classification_stream, mlp
from torch import nn

import partime
from partime.streams import moving_digits

EXECUTORS = ["inline", "process"]
SGD = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=lambda params: torch.optim.SGD(params, lr=0.5))


def losses(pipe, xs, ys):
    with pipe:
        return [r.loss for r in pipe.stream(xs, ys)]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_the_callers_model_is_left_as_it_was_and_a_second_pipeline_starts_afresh(executor):
    xs, ys = classification_stream(12)
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    pipe = partime.Pipeline(model, [3, 4], executor=executor, threads=1, **SGD)
    first = losses(pipe, xs, ys)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert not any(p.is_shared() for p in model.parameters())
    trained = pipe.module
    assert not all(torch.equal(p, q) for p, q in zip(trained.parameters(), before))  # it learnt
    assert losses(partime.Pipeline(model, [3, 4], executor=executor, threads=1, **SGD), xs, ys) == first
    model.load_state_dict(trained.state_dict())  # how to train the caller's model in place
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), trained.parameters()))


def test_editing_the_model_while_a_pipeline_runs_does_not_reach_its_stages():
    xs, ys = classification_stream(12)
    model = mlp()
    with partime.Pipeline(model, [3, 4], threads=1, **SGD) as pipe:
        first = [pipe.step(xs[i], ys[i]) for i in range(6)]
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1e6)
        rest = [pipe.step(xs[i], ys[i]) for i in range(6, 12)] + pipe.flush()
    reference = losses(partime.Pipeline(mlp(), [3, 4], executor="inline", **SGD), xs, ys)
    assert [r.loss for r in first + rest if r is not None] == reference


def test_a_pipeline_dropped_open_stops_its_workers_with_a_resource_warning():
    xs, _ = classification_stream(3)
    pipe = partime.Pipeline(mlp(), [3, 4], threads=1).open()
    pipe.step(xs[0])
    workers = [psutil.Process(p.pid) for p in multiprocessing.active_children() if p.name.startswith("partime-stage")]
    assert len(workers) == 1  # stage 0; the caller runs the last stage itself
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del pipe
        gc.collect()
    assert [w.category for w in caught] == [ResourceWarning]
    assert "garbage-collected" in str(caught[0].message) and "pipe.close()" in str(caught[0].message)
    _, alive = psutil.wait_procs(workers, timeout=5)
    assert alive == []


def test_a_forked_child_cannot_use_the_pipeline_and_leaves_the_parents_run_alone():
    xs, _ = classification_stream(12)
    reference = [r.output for r in partime.Pipeline(mlp(), [3, 4], executor="inline").open().stream(xs)]
    with partime.Pipeline(mlp(), [3, 4], threads=1) as pipe:
        results = [pipe.step(x) for x in xs[:5]]
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            try:
                pipe.step(xs[5])
                os.write(write, b"used it")
            except partime.PipelineClosedError as exc:
                os.write(write, str(exc).encode())
            finally:
                pipe.close()
                multiprocessing.util._exit_function()  # what the interpreter's exit runs (it stops daemon children)
                os._exit(0)
        os.close(write)
        os.waitpid(child, 0)
        said = os.read(read, 4096).decode()
        os.close(read)
        results += [pipe.step(x) for x in xs[5:]] + pipe.flush()
    assert "made from it by os.fork(), cannot use it" in said and "make a new Pipeline here" in said
    results = [r for r in results if r is not None]
    assert [r.index for r in results] == list(range(12))
    assert all(torch.equal(r.output, ref) for r, ref in zip(results, reference))


class Unwelcome(nn.Linear):
    """A layer that refuses to be rebuilt in another process."""

    def __setstate__(self, state):
        if state.get("home") != os.getpid():
            raise RuntimeError("this layer unpickles only where it was made")
        super().__setstate__(state)


def test_a_worker_that_cannot_rebuild_its_stage_reports_why():
    layer = Unwelcome(6, 8)
    layer.home = os.getpid()
    model = nn.Sequential(layer, nn.ReLU(), nn.Linear(8, 3))
    xs, _ = classification_stream(3)
    started = time.monotonic()
    with pytest.raises(partime.StageError) as info, partime.Pipeline(model, [1, 2], threads=1) as pipe:
        list(pipe.stream(xs))
    assert time.monotonic() - started < 30
    error = info.value
    assert type(error) is partime.StageError and (error.stage, error.sample, error.phase) == (0, None, "start")
    assert "RuntimeError: this layer unpickles only where it was made" in str(error)
    assert "__setstate__" in error.traceback


SCRIPT = """
import torch, partime
from torch import nn

class Block(nn.Module):  # defined in __main__, as in a notebook or python -c
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.act = lambda x: x.clamp(min=0)  # a layer holding a lambda

    def forward(self, x):
        return self.act(self.linear(x))

if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    xs = [torch.randn(4) for _ in range(5)]
    with partime.Pipeline(model, 2, threads=1) as pipe:
        outputs = [r.output for r in pipe.stream(xs)]
    with torch.no_grad():
        print(all(torch.equal(o, model(x)) for o, x in zip(outputs, xs)))
"""


def test_a_model_of_classes_from_main_holding_lambdas_runs_in_processes(tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_refused_sample_uses_up_its_index(executor):
    xs, _ = classification_stream(8)
    bad = xs[3].clone()
    bad[0] = math.nan
    wrong_shape = torch.randn(5)
    with partime.Pipeline(mlp(), [3, 4], executor=executor, threads=1) as pipe:
        results = []
        for i, x in enumerate(xs):
            offered = bad if i == 3 else wrong_shape if i == 5 else x
            try:
                results.append(pipe.step(offered))
            except ValueError:
                assert i in (3, 5)
        results = [r for r in results if r is not None] + pipe.flush()
        assert pipe.fed == 8
    assert [r.index for r in results] == [0, 1, 2, 4, 6, 7]
    model = mlp()
    with torch.no_grad():
        assert all(torch.equal(r.output, model(xs[r.index])) for r in results)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_each_result_carries_its_target_and_a_stream_of_pairs_needs_no_ys(executor):
    pairs = list(moving_digits(10, seed=1))
    model = nn.Sequential(nn.Flatten(0), nn.Linear(pairs[0][0].numel(), 16), nn.ReLU(), nn.Linear(16, 10))
    kw = dict(
        loss_fn=lambda out, y: nn.functional.cross_entropy(out[None], y.reshape(1)),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    with partime.Pipeline(model, [2, 2], executor=executor, threads=1, **kw) as pipe:
        from_pairs = list(pipe.stream(pairs))
    with partime.Pipeline(model, [2, 2], executor=executor, threads=1, **kw) as pipe:
        from_ys = list(pipe.stream([x for x, _ in pairs], [y for _, y in pairs]))
    assert [r.loss for r in from_pairs] == [r.loss for r in from_ys]
    assert all(torch.equal(r.target, y) for r, (_, y) in zip(from_pairs, pairs, strict=True))
    with (
        partime.Pipeline(model, [2, 2], executor=executor, threads=1, **kw) as pipe,
        pytest.raises(ValueError, match="every item of xs must be a pair"),
    ):
        list(pipe.stream(x for x, _ in pairs))


def test_a_target_is_copied_when_it_is_fed():
    xs, ys = classification_stream(4)
    buffer = torch.zeros_like(ys[0])
    with partime.Pipeline(mlp(), [3, 4], executor="inline", **SGD) as pipe:
        results = []
        for x, y in zip(xs, ys):
            buffer.copy_(y)
            results.append(pipe.step(x, buffer))
        results = [r for r in results if r is not None] + pipe.flush()
    assert all(torch.equal(r.target, y) for r, y in zip(results, ys, strict=True))


def test_a_run_that_skips_most_samples_says_so(caplog):
    xs, _ = classification_stream(260)
    kw = dict(loss_fn=lambda out: ((out - 1) ** 2).mean(), optimizer=lambda params: torch.optim.SGD(params, lr=50.0))
    with (
        caplog.at_level(logging.WARNING, logger="partime.pipeline.pipeline"),
        partime.Pipeline(mlp(), [3, 4], executor="inline", nonfinite="skip", **kw) as pipe,
    ):
        results = list(pipe.stream(xs))
    skipped = sum(r.skipped for r in results)
    assert skipped > 200  # it diverged
    warned = [r.getMessage() for r in caplog.records if "were skipped" in r.getMessage()]
    assert len(warned) == 1 and "of the last 100 samples" in warned[0] and "lower the learning rate" in warned[0]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_results_taken_after_a_checkpoint_still_carry_their_targets(executor, tmp_path):
    xs, ys = classification_stream(10)
    with partime.Pipeline(mlp(), [3, 4], executor=executor, threads=1, **SGD) as pipe:
        first = [pipe.step(xs[i], ys[i]) for i in range(5)]
        pipe.save(tmp_path / "run.pt")
    with partime.Pipeline(mlp(), [3, 4], executor=executor, threads=1, **SGD) as pipe:
        pipe.load(tmp_path / "run.pt")
        rest = [pipe.step(xs[i], ys[i]) for i in range(5, 10)] + pipe.flush()
    results = [r for r in first + rest if r is not None]
    assert [r.index for r in results] == list(range(10))
    assert all(torch.equal(r.target, ys[r.index]) for r in results)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_after_a_break_out_of_a_stream_the_results_in_flight_come_out_first(executor):
    xs, ys = classification_stream(10)
    with partime.Pipeline(mlp(), [3, 4], executor=executor, threads=1, **SGD) as pipe:
        first = []
        for r in pipe.stream(xs[:6], ys[:6]):
            first.append(r)
            if r.index == 2:
                break
        rest = list(pipe.stream(xs[6:], ys[6:]))
    # when result 2 was handed out, samples 0 to 4 had been fed (the stream runs a tick ahead): 3 and 4
    # come out of the next stream, first, and sample 5 was never offered
    reference = losses(
        partime.Pipeline(mlp(), [3, 4], executor="inline", **SGD), [*xs[:5], *xs[6:]], [*ys[:5], *ys[6:]]
    )
    assert [r.index for r in first + rest] == list(range(9))
    assert [r.loss for r in first + rest] == reference


ONE_CALLER = r"a pipeline is used by one caller at a time"


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_second_stream_or_a_step_while_a_stream_is_not_finished_is_refused(executor):
    xs = [torch.randn(2, 6) for _ in range(8)]
    with partime.Pipeline(mlp(), [3, 4], executor=executor, threads=1) as pipe:
        first, second = pipe.stream(xs[:4]), pipe.stream(xs[4:])
        assert next(first).index == 0
        with pytest.raises(
            RuntimeError, match=rf"stream\(\) was called while a stream\(\) .* not finished.*{ONE_CALLER}"
        ):
            next(second)
        with pytest.raises(RuntimeError, match=rf"stream\(\) was called .*{ONE_CALLER}.*close it"):
            pipe.stream(xs[4:])
        with pytest.raises(RuntimeError, match=rf"step\(\) was called while a stream\(\) .*{ONE_CALLER}"):
            pipe.step(xs[0])
        with pytest.raises(RuntimeError, match=rf"flush\(\) was called while .*{ONE_CALLER}"):
            pipe.flush()
        # nothing was fed by the refused calls: the first stream goes on as if they had not been made
        assert [r.index for r in first] == [1, 2, 3]
        assert [r.index for r in pipe.stream(xs[4:])] == [4, 5, 6, 7]
        # a stream closed before its end lets the next call in; the samples in flight come out first
        third = pipe.stream(xs)
        assert next(third).index == 8  # 9 and 10 went in (a pipeline of 2 stages, a tick ahead)
        third.close()
        assert pipe.step(xs[0]).index == 9
        assert [r.index for r in pipe.flush()] == [10, 11]


def test_a_stream_left_by_a_break_and_let_go_does_not_block_the_next_call():
    xs = [torch.randn(2, 6) for _ in range(8)]
    with partime.Pipeline(mlp(), [3, 4], executor="inline") as pipe:
        for r in pipe.stream(xs):
            if r.index == 1:
                break
        assert pipe.step(xs[0]).index == 2  # the stream let go at once: 2 was in flight
        results = pipe.stream(xs)
        assert next(results).index == 3
        del results  # let go: closed
        gc.collect()
        assert [r.index for r in pipe.flush()] == [4, 5]


GATE: dict = {}
"""The events of ``Gate``: kept out of the module, which the pipeline copies."""


class Gate(nn.Module):
    """Holds its first forward until ``GATE["release"]`` is set, having set ``GATE["entered"]``."""

    def forward(self, x):
        if not GATE["entered"].is_set():
            GATE["entered"].set()
            assert GATE["release"].wait(5.0)
        return x


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_step_from_two_threads_at_once_is_refused_in_the_second(executor):
    GATE.update(entered=threading.Event(), release=threading.Event())
    xs = [torch.randn(2, 6) for _ in range(2)]
    errors, handed = [], []

    def two_steps():  # the second waits for result 0, which waits for the gate
        try:
            handed.extend(pipe.step(x) for x in xs)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    with partime.Pipeline(nn.Sequential(Gate(), nn.Linear(6, 3)), [1, 1], executor=executor, threads=1) as pipe:
        other = threading.Thread(target=two_steps)
        other.start()
        try:
            assert GATE["entered"].wait(5.0)
            time.sleep(0.3)  # the other thread is inside a step now: blocked until the gate opens
            with pytest.raises(RuntimeError, match=rf"step\(\) was called while a step\(\) .*{ONE_CALLER}"):
                pipe.step(xs[0])
        finally:
            GATE["release"].set()
            other.join(5.0)
        assert not errors
        assert [r and r.index for r in handed] == [None, 0]
        assert [r.index for r in pipe.flush()] == [1]  # the refused step fed nothing, nor used up an index

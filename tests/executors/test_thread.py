"""The thread executor (one thread per stage, in the caller's process) against the inline reference.

(Learning in every grad mode with SGD and Adam at D = 1, 2, 3: test_process.py, for both executors.)"""

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from faulty import TripLoss, TripOptimizer, tagged_stream, tripping_model
from models import classification_stream, mlp, nonfinite_stream, scaled_loss
from test_process import BALANCES, OPTIMIZERS, assert_same, run
from torch import nn

import partime

TESTS = Path(__file__).parents[1]


def no_stage_thread_left():
    return [t.name for t in threading.enumerate() if t.name.startswith("partime")] == []


@pytest.mark.parametrize(
    "compensation",
    [
        "auto",
        ("delay-correction", "lr-scale"),
        ("weight-prediction",),
        ("optimizer-prediction", "long-momentum"),
        ("spike",),
    ],
)
def test_every_compensation_matches_inline(compensation):
    xs, ys = classification_stream(100)
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=OPTIMIZERS["sgd"], compensation=compensation)
    assert_same(run("inline", mlp(), BALANCES[3], xs, ys, **kw), run("thread", mlp(), BALANCES[3], xs, ys, **kw))


def test_inference_equals_the_model():
    model = mlp()
    xs, _ = classification_stream(100)
    results, _ = run("thread", model, BALANCES[3], xs)
    with torch.no_grad():
        assert all(torch.equal(r.output, model(x)) for r, x in zip(results, xs, strict=True))


@pytest.mark.parametrize("grad_mode", ["partime", "stash", "weight-stash", "graph-stash"])
def test_skipped_samples_match_inline(grad_mode):
    xs, ys = nonfinite_stream(30, holes=(0, 7, 8, 21, 29), infinite=(3, 8, 12, 13, 28))
    kw = dict(loss_fn=scaled_loss, optimizer=OPTIMIZERS["sgd"], grad_mode=grad_mode, nonfinite="skip")
    inline, threaded = (run(executor, mlp(), BALANCES[3], xs, ys, **kw) for executor in ("inline", "thread"))
    assert [r.skipped for r in inline[0]] == [r.skipped for r in threaded[0]] and sum(r.skipped for r in inline[0]) == 9
    for a, b in zip(inline[0], threaded[0], strict=True):
        assert a.loss == b.loss and ((a.output is None and b.output is None) or torch.equal(a.output, b.output))
    assert all(torch.equal(p, q) for p, q in zip(inline[1].parameters(), threaded[1].parameters(), strict=True))


def test_segments_and_module_reads_between_ticks_match_inline():
    xs, ys = classification_stream(40)
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=OPTIMIZERS["adam"], grad_mode="weight-stash")
    seen = {}
    for executor in ("inline", "thread"):
        trace = []
        with partime.Pipeline(mlp(), [2, 3, 2], executor=executor, threads=1, **kw) as pipe:
            for segment in (range(25), range(25, 40)):
                for i in segment:
                    r = pipe.step(xs[i], ys[i])
                    trace.append(None if r is None else (r.index, r.loss))
                    if i in (4, 17, 30):
                        trace.append([p.clone() for p in pipe.module.parameters()])
                trace.append([(r.index, r.loss) for r in pipe.flush()])
        seen[executor] = trace
    for a, b in zip(seen["inline"], seen["thread"], strict=True):
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        else:
            assert a == b


@pytest.mark.parametrize("into", ["thread", "inline", "process"])
@pytest.mark.parametrize("source", ["thread", "inline", "process"])
def test_checkpoints_move_between_thread_inline_and_process(tmp_path, source, into):
    if source == into == "process":
        pytest.skip("tested in test_checkpoint.py")
    xs, ys = classification_stream(30)
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=OPTIMIZERS["adam"], grad_mode="stash", threads=1)
    with partime.Pipeline(mlp(), BALANCES[3], executor="inline", **kw) as pipe:
        whole = list(pipe.stream(xs, ys))
        whole_model = pipe.module
    with partime.Pipeline(mlp(), BALANCES[3], executor=source, **kw) as pipe:
        first = [r for i in range(13) if (r := pipe.step(xs[i], ys[i])) is not None]
        pipe.save(tmp_path / "run.pt")
    with partime.Pipeline(mlp(seed=1), BALANCES[3], executor=into, **kw) as pipe:
        pipe.load(tmp_path / "run.pt")
        rest = list(pipe.stream(xs[pipe.fed :], ys[pipe.fed :]))
        model = pipe.module
    assert [(r.index, r.loss) for r in first + rest] == [(r.index, r.loss) for r in whole]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), whole_model.parameters(), strict=True))


@pytest.mark.parametrize("stage, phase", [(0, "forward"), (2, "forward"), (2, "loss"), (1, "backward"), (0, "step")])
def test_a_failing_stage_names_stage_sample_and_phase_and_leaves_no_thread(stage, phase):
    xs, ys = tagged_stream(20, 3)
    model = tripping_model(3, stage, 6, phase) if phase in ("forward", "backward") else tripping_model(3)
    loss = TripLoss(6 if phase == "loss" else -1)
    optimizer = TripOptimizer(stage, 6) if phase == "step" else TripOptimizer()
    with (
        pytest.raises(partime.StageError) as info,
        partime.Pipeline(model, [2, 2, 2], executor="thread", loss_fn=loss, optimizer=optimizer, threads=1) as pipe,
    ):
        for x, y in zip(xs, ys):
            pipe.step(x, y)
    error = info.value
    assert (error.stage, error.sample, error.phase) == (stage, 6, phase)
    assert type(error.__cause__).__name__ == "Tripped" and "faulty.py" in error.traceback
    assert no_stage_thread_left()


def test_ctrl_c_in_the_caller_stops_and_joins_every_thread():
    xs, _ = tagged_stream(200, 3)
    with pytest.raises(KeyboardInterrupt), partime.Pipeline(tripping_model(3), [2, 2, 2], executor="thread") as pipe:
        for i, x in enumerate(xs):
            pipe.step(x)
            if i == 50:
                raise KeyboardInterrupt  # as the signal does, in the caller's thread
    assert no_stage_thread_left()


def test_each_stage_runs_with_its_own_torch_thread_count_and_the_caller_gets_its_own_back():
    counts = []

    class Count(nn.Module):
        def forward(self, x):
            counts.append((threading.current_thread().name, torch.get_num_threads()))
            return x

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = nn.Sequential(Count(), Count())
        with partime.Pipeline(model, 2, executor="thread", threads=2, sample=torch.randn(3)) as pipe:
            pipe.step(torch.randn(3))  # the first sample: the caller learns each boundary's layout
            counts.clear()
            list(pipe.stream(torch.randn(3) for _ in range(4)))
            # stage 0 in a thread of its own, the last stage in the caller's, each with 2
            assert set(counts) == {("partime-stage-0", 2), ("MainThread", 2)}
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


SCRIPT = """
import torch, partime
from torch import nn

class Block(nn.Module):  # defined at the top of a script with no main guard
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).relu()

torch.manual_seed(0)
model = nn.Sequential(Block(), Block(), Block())
xs = [torch.randn(4) for _ in range(6)]
for executor in ("thread", "process"):
    with partime.Pipeline(model, 2, executor=executor, threads=1) as pipe:
        outputs = [r.output for r in pipe.stream(xs)]
    with torch.no_grad():
        print(executor, all(torch.equal(o, model(x)) for o, x in zip(outputs, xs)))
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_an_unguarded_script_with_its_own_classes_streams_through_threads_and_processes(tmp_path, how):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(SCRIPT))
    started = time.monotonic()
    if how == "file":
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    else:
        done = subprocess.run(
            [sys.executable, "-"], input=script.read_text(), capture_output=True, text=True, timeout=120, check=False
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["thread", "True", "process", "True"]  # and nothing ran twice
    assert time.monotonic() - started < 120

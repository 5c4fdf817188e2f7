"""Checkpoints: a run stopped at any tick and resumed gives the results of one that never stopped."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from models import classification_stream, mlp
from torch import nn

import partime
from partime import CheckpointError
from partime.checkpoint import files as checkpoint
from partime.executors import executor_class
from partime.executors.inline import InlineExecutor

BALANCES = {1: [7], 2: [3, 4], 3: [2, 3, 2]}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
}
ACTIONS = ["step"] * 8 + ["flush"] + ["step"] * 6 + ["flush"]
"""Two segments; a run is stopped after ``ACTIONS[:stop]`` for each of ``STOPS``."""
STOPS = {
    "before any sample": 0,
    "warm-up": 1,
    "steady state": 6,
    "just before a flush": 8,
    "right after a flush": 9,
    "second segment": 12,
}
XS, YS = classification_stream(len(ACTIONS))
TESTS = Path(__file__).parents[1]


def learning(grad_mode="partime", opt="sgd", compensation=()):
    return dict(
        loss_fn=nn.CrossEntropyLoss(), optimizer=OPTIMIZERS[opt], grad_mode=grad_mode, compensation=compensation
    )


def pipeline(executor, depth, seed=0, balance=None, model=mlp, **kw):
    """A pipeline on ``model(seed=seed)``; a resumed one gets another seed, so only loading makes it match."""
    return partime.Pipeline(model(seed=seed), balance or BALANCES[depth], executor=executor, threads=1, **kw)


def play(pipe, actions, ys=True):
    """Run ``actions`` from sample ``pipe.fed`` on; the results, in the order they came."""
    results = []
    for action in actions:
        if action == "flush":
            results.extend(pipe.flush())
            continue
        i = pipe.fed
        r = pipe.step(XS[i], YS[i] if ys else None)
        if r is not None:
            results.append(r)
    return results


def assert_same(a, b):
    (results_a, model_a), (results_b, model_b) = a, b
    assert [r.index for r in results_a] == [r.index for r in results_b]
    for ra, rb in zip(results_a, results_b):
        assert torch.equal(ra.output, rb.output), ra.index
        assert ra.loss == rb.loss, ra.index
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name


def uninterrupted(depth, ys=True, executor="inline", model=mlp, **kw):
    with pipeline(executor, depth, model=model, **kw) as pipe:
        return play(pipe, ACTIONS, ys), pipe.module


def resumed(depth, stop, path, ys=True, model=mlp, balance=None, **kw):
    """Stopped after ``ACTIONS[:stop]``, saved, loaded into a fresh pipeline (balance=D), finished."""
    with pipeline("inline", depth, model=model, balance=balance, **kw) as pipe:
        before = play(pipe, ACTIONS[:stop], ys)
        pipe.save(path)
    with pipeline("inline", depth, seed=1, balance=depth, model=model, **kw) as pipe:
        pipe.load(path)
        return before + play(pipe, ACTIONS[stop:], ys), pipe.module


@pytest.mark.parametrize(
    "compensation",
    [
        (),
        ("lr-scale",),
        ("weight-prediction",),
        ("delay-correction",),
        ("optimizer-prediction", "long-momentum"),
        ("spike",),
        "auto",
    ],
    ids=["plain", "lr-scale", "wp", "dc", "op+lm", "spike", "auto"],
)
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("grad_mode", ["partime", "stash", "weight-stash", "graph-stash"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_learning_resumes_exactly(tmp_path, depth, grad_mode, opt, compensation):
    kw = learning(grad_mode, opt, compensation)
    reference = uninterrupted(depth, **kw)
    assert not torch.equal(next(reference[1].parameters()), next(mlp().parameters()))  # it learnt
    for name, stop in STOPS.items():
        assert_same(reference, resumed(depth, stop, tmp_path / f"{stop}.pt", **kw)), name


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_inference_resumes_exactly(tmp_path, depth):
    reference = uninterrupted(depth, ys=False)
    for stop in STOPS.values():
        assert_same(reference, resumed(depth, stop, tmp_path / f"{stop}.pt", ys=False))


def batchnorm_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)
    )


@pytest.mark.parametrize("grad_mode", ["partime", "stash", "weight-stash", "graph-stash"])
def test_graphs_rebuilt_on_load_leave_batchnorm_statistics_alone(tmp_path, grad_mode):
    # In the warm-up the stages keep graphs of forwards that a later product reuses; loading builds
    # them again, which must not count as one more forward in the running statistics.
    kw = learning(grad_mode)
    reference = uninterrupted(2, model=batchnorm_mlp, balance=[3, 4], **kw)
    for stop in (1, 2, 6):
        got = resumed(2, stop, tmp_path / f"{stop}.pt", model=batchnorm_mlp, balance=[3, 4], **kw)
        assert_same(reference, got)


def test_a_checkpoint_inside_stream_holds_the_result_not_handed_out_yet():
    kw = learning("stash", "adam")
    with pipeline("inline", 3, **kw) as pipe:
        reference = list(pipe.stream(XS, YS))
    with pipeline("inline", 3, **kw) as pipe:
        results = []
        for r in pipe.stream(XS, YS):
            results.append(r)
            if r.index == 5:
                state = pipe.state_dict()
                fed = pipe.fed
    assert fed > 6  # the stream runs ahead of the result it hands out
    assert_same((reference, mlp()), (results, mlp()))  # taking the checkpoint changed nothing
    with pipeline("inline", 3, seed=1, **kw) as pipe:
        pipe.load_state_dict(state)
        assert pipe.fed == fed
        rest = list(pipe.stream(XS[fed:], YS[fed:]))
    assert_same((reference[6:], mlp()), (rest, mlp()))


def test_a_state_dict_is_a_copy_and_loads_twice():
    kw = learning("weight-stash", "adam", ("weight-prediction",))
    with pipeline("inline", 3, **kw) as pipe:
        play(pipe, ACTIONS[:6])
        state = pipe.state_dict()
        play(pipe, ACTIONS[6:])  # changes the pipeline, not the state taken
    runs = []
    for seed in (1, 2):
        with pipeline("inline", 3, seed=seed, **kw) as pipe:
            pipe.load_state_dict(state)
            runs.append((play(pipe, ACTIONS[6:]), pipe.module))
    assert_same(*runs)


def test_a_checkpoint_holds_tensors_and_plain_values_only(tmp_path):
    compensation = ("lr-scale", "weight-prediction", "delay-correction")
    with pipeline("inline", 3, **learning("weight-stash", "adam", compensation)) as pipe:
        play(pipe, ACTIONS[:6])
        state = pipe.state_dict()

    def walk(value, where):
        if isinstance(value, dict):
            for k, v in value.items():
                assert isinstance(k, (str, int)), where
                walk(v, f"{where}.{k}")
        elif isinstance(value, (list, tuple)):
            for k, v in enumerate(value):
                walk(v, f"{where}[{k}]")
        else:
            assert value is None or isinstance(value, (torch.Tensor, bool, int, float, str)), (where, type(value))

    walk(state, "state")
    assert state["transit"]["acts"][1] is not None and state["transit"]["grads"][1] is not None
    torch.save(state, tmp_path / "c.pt")
    torch.load(tmp_path / "c.pt", weights_only=True)


# -- the process executor and moving between executors -------------------------------------------


@pytest.mark.parametrize("learns", [True, False], ids=["learning", "inference"])
def test_checkpoints_move_between_executors(learns):
    # inline -> process (a pipeline not started yet: its workers start from the state, at a
    # flush with samples in flight) -> inline
    kw = learning("stash", "sgd", ("lr-scale", "delay-correction")) if learns else {}
    reference = uninterrupted(3, ys=learns, **kw)
    with pipeline("inline", 3, **kw) as pipe:
        results = play(pipe, ACTIONS[:8], learns)
        state = pipe.state_dict()
    with pipeline("process", 3, seed=1, balance=3, **kw) as pipe:
        pipe.load_state_dict(state)
        assert ACTIONS[8] == "flush"
        results += play(pipe, ACTIONS[8:12], learns)
        state = pipe.state_dict()
    with pipeline("inline", 3, seed=2, **kw) as pipe:
        pipe.load_state_dict(state)
        results += play(pipe, ACTIONS[12:], learns)
        assert_same(reference, (results, pipe.module))


def test_process_checkpoint_loads_into_running_workers():
    kw = learning("weight-stash", "adam", ("weight-prediction", "delay-correction"))
    reference = uninterrupted(3, **kw)
    with pipeline("process", 3, **kw) as pipe:
        results = play(pipe, ACTIONS[:5])
        state = pipe.state_dict()
        assert_same(reference, (results + play(pipe, ACTIONS[5:]), pipe.module))  # undisturbed
    with pipeline("process", 3, seed=1, **kw) as pipe:
        play(pipe, ACTIONS[:2])
        pipe.module  # its workers have run two ticks, on other weights
        pipe.load_state_dict(state)
        assert_same(reference, (results + play(pipe, ACTIONS[5:]), pipe.module))


# -- a fresh process ------------------------------------------------------------------------------

RESUME_SCRIPT = """
import sys
import torch
from torch import nn
import partime
from partime.executors import executor_class
from partime.executors.inline import InlineExecutor

from models import classification_stream, mlp

path, expected_path = sys.argv[1], sys.argv[2]
expected = torch.load(expected_path, weights_only=True)
xs, ys = classification_stream(len(expected["xs"]))
assert torch.equal(xs, expected["xs"])
pipe = partime.Pipeline(mlp(seed=7), 3, executor="inline", threads=1, loss_fn=nn.CrossEntropyLoss(),
                        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), grad_mode="stash")
with pipe:
    pipe.load(path)
    results = list(pipe.stream(xs[pipe.fed:], ys[pipe.fed:]))
    weights = pipe.module.state_dict()
assert [r.index for r in results] == expected["indices"], [r.index for r in results]
for r, output, loss in zip(results, expected["outputs"], expected["losses"]):
    assert torch.equal(r.output, output) and r.loss == loss, r.index
for name, w in expected["weights"].items():
    assert torch.equal(weights[name], w), name
print("resumed exactly")
"""


def test_resume_in_a_fresh_process(tmp_path):
    torch.set_num_threads(1)
    kw = learning("stash", "adam", "auto")  # the fresh process makes its pipeline with the defaults
    with pipeline("inline", 3, **kw) as pipe:
        play(pipe, ACTIONS[:6])
        pipe.save(tmp_path / "ckpt.pt")
        rest = play(pipe, ["step"] * (len(XS) - pipe.fed) + ["flush"])
        expected = {
            "xs": XS,
            "indices": [r.index for r in rest],
            "outputs": [r.output for r in rest],
            "losses": [r.loss for r in rest],
            "weights": pipe.module.state_dict(),
        }
    torch.save(expected, tmp_path / "expected.pt")
    (tmp_path / "resume.py").write_text(textwrap.dedent(RESUME_SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)]), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(tmp_path / "resume.py"), str(tmp_path / "ckpt.pt"), str(tmp_path / "expected.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "resumed exactly" in done.stdout


# -- atomic files ---------------------------------------------------------------------------------


def saved_pipeline(path, stop):
    with pipeline("inline", 2, **learning("weight-stash", "adam")) as pipe:
        play(pipe, ACTIONS[:stop])
        pipe.save(path)
        return pipe.state_dict()


def assert_states_equal(a, b, where="state"):
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_states_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            assert_states_equal(x, y, f"{where}[{k}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_a_save_leaves_one_file_and_replaces_the_previous(tmp_path):
    path = tmp_path / "ckpt.pt"
    saved_pipeline(path, 4)
    state = saved_pipeline(path, 6)
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert_states_equal(state, checkpoint.load(path))


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    old = saved_pipeline(path, 4)
    real_save = torch.save

    def dies_midway(obj, f):
        real_save(obj, f)
        f.seek(f.tell() // 2)
        f.truncate()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        saved_pipeline(path, 6)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # the half-written file was removed
    assert_states_equal(old, checkpoint.load(path))


KILLED_SAVE = """
import os, signal, sys
import torch
from partime.checkpoint import files as checkpoint

real_save = torch.save

def killed_midway(obj, f):
    real_save(obj, f)
    f.seek(f.tell() // 2)
    f.truncate()
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # the process dies in the middle of writing

torch.save = killed_midway
checkpoint.save({"anything": torch.ones(1000)}, sys.argv[1])
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    old = saved_pipeline(path, 4)
    script = tmp_path.parent / f"{tmp_path.name}-kill.py"
    script.write_text(textwrap.dedent(KILLED_SAVE))
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent / "src"))
    done = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt.pt.tmp"]  # the partial file is all that is left
    assert_states_equal(old, checkpoint.load(path))
    with pipeline("inline", 2, seed=1, **learning("weight-stash", "adam")) as pipe:
        pipe.load(path)  # the previous checkpoint loads
        play(pipe, ACTIONS[4:7])
        pipe.save(path)  # and the next save copes with the leftover
        state = pipe.state_dict()
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert_states_equal(state, checkpoint.load(path))


# -- what does not fit ----------------------------------------------------------------------------


def test_a_checkpoint_of_another_pipeline_is_refused_naming_both_values():
    with pipeline("inline", 2, **learning("stash")) as pipe:
        play(pipe, ACTIONS[:3])
        state = pipe.state_dict()
    with pipeline("inline", 2, **learning("partime")) as pipe:
        with pytest.raises(CheckpointError, match="grad_mode is 'stash', this pipeline's is 'partime'"):
            pipe.load_state_dict(state)
    with pipeline("inline", 3, **learning("stash")) as pipe:
        with pytest.raises(CheckpointError, match="depth is 2, this pipeline's is 3"):
            pipe.load_state_dict(state)
    with pipeline("inline", 2, balance=[4, 3], **learning("stash")) as pipe:
        with pytest.raises(CheckpointError, match=r"balance is \[3, 4\], this pipeline's is \[4, 3\]"):
            pipe.load_state_dict(state)
    with pipeline("inline", 2) as pipe:
        with pytest.raises(CheckpointError, match="learning is True, this pipeline's is False"):
            pipe.load_state_dict(state)
    with partime.Pipeline(mlp(width=5), [3, 4], executor="inline", **learning("stash")) as pipe:
        with pytest.raises(CheckpointError, match="weights of stage 0 do not fit"):
            pipe.load_state_dict(state)
    with pipeline("inline", 2, **learning("stash")) as pipe:
        with pytest.raises(CheckpointError, match="version 99"):
            pipe.load_state_dict(dict(state, version=99))
        with pytest.raises(CheckpointError, match="not a partime checkpoint"):
            pipe.load_state_dict({"weights": torch.ones(2)})


def refused_changes_nothing(make, state, message, executor="inline"):
    """A pipeline made by ``make(executor)`` refuses ``state`` with ``message`` after 4 samples, and
    then learns on exactly as one that was never given it: weights, counters, results."""
    with make(executor) as pipe:
        reference = play(pipe, ACTIONS[:8]), pipe.module
    with make(executor) as pipe:
        results = play(pipe, ACTIONS[:4])
        before = [p.detach().clone() for p in pipe.module.parameters()]
        with pytest.raises(CheckpointError, match=message):
            pipe.load_state_dict(state)
        assert all(torch.equal(p, q) for p, q in zip(pipe.module.parameters(), before, strict=True))
        assert pipe.fed == 4
        results += play(pipe, ACTIONS[4:8])
        assert_same((results, pipe.module), reference)


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_a_checkpoint_with_another_optimizer_is_refused_naming_both(executor):
    with pipeline("inline", 2, **learning("stash", "adam")) as pipe:
        play(pipe, ACTIONS[:3])
        state = pipe.state_dict()
    message = "the checkpoint is of another pipeline: its stage 0 learns with 'Adam', this pipeline's with 'SGD'"
    refused_changes_nothing(lambda ex: pipeline(ex, 2, **learning("stash", "sgd")), state, message, executor)


def test_a_checkpoint_that_kept_step_scales_in_the_lr_resumes_with_the_factory_lr():
    compensation = ("step-scale", "lr-scale")
    with pipeline("inline", 2, **learning("stash", compensation=compensation)) as pipe:
        play(pipe, ACTIONS[:5])
        state = pipe.state_dict()
        expected = play(pipe, ACTIONS[5:8]), pipe.module
    for stage in state["stages"]:  # as such a checkpoint was written: no lr_as_given, a scaled lr
        del stage["lr_as_given"]
        for group in stage["optimizer"]["param_groups"]:
            group["lr"] = group["lr"] / 3 * 0.9
    with pipeline("inline", 2, seed=1, **learning("stash", compensation=compensation)) as pipe:
        pipe.load_state_dict(state)
        assert_same((play(pipe, ACTIONS[5:8]), pipe.module), expected)


def two_widths(width=8, seed=0):
    """Stage 0 (``[2, 3]``) is alike for every ``width``; stage 1's weights are not."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_a_checkpoint_whose_later_stage_does_not_fit_changes_nothing(executor):
    with partime.Pipeline(two_widths(16, seed=1), [2, 3], executor="inline", **learning("stash")) as pipe:
        play(pipe, ACTIONS[:3])
        state = pipe.state_dict()

    def make(ex):
        return partime.Pipeline(two_widths(8), [2, 3], executor=ex, threads=1, **learning("stash"))

    refused_changes_nothing(make, state, "the weights of stage 1 do not fit this model", executor)


def test_an_optimizer_state_of_other_parameter_groups_is_refused_at_load():
    def grouped(named):  # the weights and the biases in two groups
        return torch.optim.SGD(
            [{"params": [p for _, p in named if p.dim() > 1]}, {"params": [p for _, p in named if p.dim() <= 1]}],
            lr=0.05,
        )

    with pipeline("inline", 2, **dict(learning("stash"), optimizer=grouped)) as pipe:
        play(pipe, ACTIONS[:3])
        state = pipe.state_dict()
    message = (
        "stage 0 of the checkpoint does not fit this pipeline: ValueError: loaded state dict has a different number"
    )
    refused_changes_nothing(lambda ex: pipeline(ex, 2, **learning("stash")), state, message)


class Weighted(nn.Module):
    """A loss with parameters: mean squared error of the classes' scores, one learnt weight each."""

    def __init__(self, classes=3):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(classes))

    def forward(self, output, target):
        return (self.weight[: output.shape[-1]] * (output - nn.functional.one_hot(target, 3)) ** 2).mean()


def test_a_loss_of_other_parameters_is_refused_at_load():
    with pipeline("inline", 2, **dict(learning("stash"), loss_fn=Weighted(4))) as pipe:
        play(pipe, ACTIONS[:3])
        state = pipe.state_dict()
    message = r"stage 1 of the checkpoint does not fit this pipeline: RuntimeError: (.|\n)*size mismatch for weight"
    refused_changes_nothing(lambda ex: pipeline(ex, 2, **dict(learning("stash"), loss_fn=Weighted(3))), state, message)


def test_an_executor_without_checkpoints_says_so(monkeypatch):
    assert all(executor_class(name).checkpoints for name in ("inline", "process", "distributed"))
    monkeypatch.setattr(InlineExecutor, "checkpoints", False)
    with pipeline("inline", 2) as pipe:
        with pytest.raises(NotImplementedError, match="InlineExecutor cannot take or load checkpoints"):
            pipe.state_dict()
        with pytest.raises(NotImplementedError, match="InlineExecutor cannot take or load checkpoints"):
            pipe.load_state_dict({})

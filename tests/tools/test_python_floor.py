"""The Python floor (``benchmarks/python_floor.py``): its results equal the plain model's (inference)
and partime's inline pipeline's in the same grad mode (learning), its workers leave nothing behind,
and the sweep runs it on the pipelines' cut or says why it leaves it out."""

import functools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner
from torch import nn

from partime import Pipeline
from partime_tools.bench import floor as bench_floor
from partime_tools.bench.floor import FLOOR_FILE, KIND, left_out, load_floor
from partime_tools.bench.models import conv3_net, resnet
from partime_tools.bench.runner import CLASSES, frames
from partime_tools.cli import main

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05),  # steps large enough to change the losses
    "adam": functools.partial(torch.optim.Adam, lr=1e-2),
}


@pytest.fixture(scope="module")
def floor():
    return load_floor()


def shared_memory_files():
    """The names in /dev/shm that a floor could leave: semaphores and torch's shared tensors."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("sem.mp-", "torch_"))}


def test_the_floor_is_the_repositorys_file_and_runs_on_a_sequential_model():
    assert FLOOR_FILE == Path(__file__).resolve().parents[2] / "benchmarks" / "python_floor.py"
    assert left_out(conv3_net(2, 4)) is None
    assert left_out(resnet(2, 4)) == f"{KIND}: left out, it cuts an nn.Sequential and this model (ResNet) is traced"


def test_inference_gives_the_models_own_outputs(floor):
    model = conv3_net(4, 6)
    xs, _ = frames(8, 9, seed=1)
    with torch.no_grad():
        expected = [model(x) for x in xs]
    before = shared_memory_files()
    with floor.PythonFloor(model, (2, 3), xs[0]) as pipe:
        for _ in range(2):  # a second stream starts where the first left the pipeline: empty
            outputs = list(pipe.stream(iter(xs)))
            assert len(outputs) == len(xs)
            for got, want in zip(outputs, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert mp.active_children() == []  # every worker stopped and joined
    assert shared_memory_files() - before == set()


@pytest.mark.parametrize(("optimizer", "balance"), [("sgd", (3, 3)), ("adam", (2, 2, 2))])
def test_learning_gives_the_losses_of_partimes_inline_pipeline(floor, optimizer, balance):
    # graph-stash without compensation: each sample's own graph, run back with the weights of
    # the tick its gradient comes back at, as the floor does
    model = conv3_net(4, 6, classes=CLASSES)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    xs, ys = frames(8, 10, seed=2)
    options = dict(executor="inline", grad_mode="graph-stash", compensation=(), threads=1)
    learning = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=OPTIMIZERS[optimizer])
    with Pipeline(model, list(balance), **options, **learning) as inline:
        expected = [r.loss for _ in range(2) for r in inline.stream(iter(xs), iter(ys))]
    with floor.PythonFloor(model, balance, xs[0], OPTIMIZERS[optimizer]) as pipe:
        losses = [float(loss) for _ in range(2) for loss in pipe.stream(iter(xs), iter(ys))]
    assert losses == expected  # to the bit, across two streams (each ends with every gradient applied)
    assert len(set(losses)) == len(losses)  # not one loss over and over
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # the floor learned on its own copies
    assert mp.active_children() == []


def test_an_error_in_the_caller_stops_and_joins_the_workers(floor):
    model = conv3_net(2, 4, classes=CLASSES)
    xs, ys = frames(8, 6, seed=3)
    before = shared_memory_files()
    with pytest.raises(KeyError, match="stop here"):
        with floor.PythonFloor(model, (2, 2), xs[0], OPTIMIZERS["sgd"]) as pipe:
            next(pipe.stream(iter(xs), iter(ys)))  # a stream left half-way, gradients in flight
            raise KeyError("stop here")
    assert mp.active_children() == []
    assert shared_memory_files() - before == set()


def test_a_floor_needs_two_stages_of_the_whole_model(floor):
    model = conv3_net(2, 4)
    with pytest.raises(ValueError, match=r"need 2 stages or more of the model's 3 layers, got balance \[3\]"):
        floor.PythonFloor(model, (3,), torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match=r"model's 3 layers, got balance \[1, 1\]"):
        floor.PythonFloor(model, (1, 1), torch.zeros(1, 3, 8, 8))


def test_a_sweep_without_the_file_leaves_the_floor_out_and_says_so(tmp_path, monkeypatch):
    absent = tmp_path / "benchmarks" / "python_floor.py"
    monkeypatch.setattr(bench_floor, "FLOOR_FILE", absent)
    path = tmp_path / "sweep.json"
    args = ["bench", "--sizes", "8", "--samples", "5", "--rounds", "1", "--infer", "--executor", "thread"]
    result = CliRunner().invoke(main, [*args, "--json", str(path)])
    assert result.exit_code == 0, result.output
    note = f"{KIND}: left out, {absent} is not here (an installed package has no benchmarks/ folder)"
    assert note in " ".join(result.output.split())
    rows = json.loads(path.read_text())
    assert {r["floor_left_out"] for r in rows} == {note}
    assert not [r for r in rows if r["kind"] == KIND]
    pipe = next(r for r in rows if r["contender"] == "thread D=2")
    assert pipe["floor"] is None and pipe["floor_ms"] is None and pipe["ms_over_floor"] is None

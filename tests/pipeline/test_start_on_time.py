"""A pipeline that knows its sample before the stream (``sample=``, ``start(sample)``) starts its
stages, warm, when it opens: a live source loses nothing to the start, and every result, loss and
weight is, to the bit, that of a pipeline started at its first sample."""

import multiprocessing
import threading
import time

import pytest
import torch
from models import classification_stream, mlp
from torch import nn

import partime
from partime import PipelineClosedError
from partime.sources import at_rate

N = 12
BALANCES = {2: [2, 3], 3: [1, 2, 2]}
LEARN = {"loss_fn": lambda out: out.pow(2).mean(), "optimizer": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)}


def model(seed=0):
    """Dropout (random streams) and batch normalisation (buffers) between linear layers, for (4, 6) samples."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 3))


def sample():
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(7))


def stage_processes():
    return sorted(p.name for p in multiprocessing.active_children() if p.name.startswith("partime-stage-"))


def stage_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("partime-stage-"))


def run(executor, depth, learning, how):
    """Results, weights and the caller's next random number of a pipeline streamed ``N`` samples
    drawn lazily from the caller's seeded stream; ``how`` it starts: at its first sample (None),
    in ``with`` from ``sample=``, or at ``start(sample)``."""
    torch.manual_seed(0)
    kw = {"sample": sample()} if how == "sample=" else {}
    pipe = partime.Pipeline(model(), BALANCES[depth], executor=executor, threads=1, **kw, **(LEARN if learning else {}))
    torch.manual_seed(1)
    with pipe:
        if how == "start()":
            pipe.start(sample())
        results = list(pipe.stream(torch.randn(4, 6) for _ in range(N)))
        weights = pipe.module.state_dict()
    return results, weights, torch.rand(())


@pytest.mark.parametrize(("executor", "depth"), [("inline", 2), ("thread", 2), ("process", 2), ("thread", 3)])
@pytest.mark.parametrize("learning", [False, True])
@pytest.mark.parametrize("how", ["sample=", "start()"])
def test_a_pipeline_started_ahead_computes_what_one_started_at_its_first_sample_does(executor, depth, learning, how):
    results, weights, drawn = run(executor, depth, learning, how)
    results0, weights0, drawn0 = run(executor, depth, learning, None)
    assert [r.index for r in results] == [r.index for r in results0] == list(range(N))
    for r, r0 in zip(results, results0):
        assert torch.equal(r.output, r0.output), r.index
        assert r.loss == r0.loss, r.index
    assert weights.keys() == weights0.keys()
    for name in weights:
        assert torch.equal(weights[name], weights0[name]), name
    assert torch.equal(drawn, drawn0)  # the caller's random stream as it was


def test_a_supervised_pipeline_starts_with_a_target_and_computes_the_same():
    xs, ys = classification_stream(N)
    learn = {"loss_fn": nn.CrossEntropyLoss(), "optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}
    outs = []
    for ahead in (True, False):
        with partime.Pipeline(mlp(), [3, 4], executor="process", threads=1, sample=xs[0], **learn) as pipe:
            assert stage_processes() == []  # its loss takes a target: `with` does not start it
            if ahead:
                with pytest.raises(ValueError, match=r"needs a target"):
                    pipe.start()
                pipe.start(xs[0], ys[0])
                assert stage_processes() == ["partime-stage-0"]
            outs.append(([r.loss for r in pipe.stream(xs, ys)], pipe.module.state_dict()))
    (losses, weights), (losses0, weights0) = outs
    assert losses == losses0 and len(losses) == N
    assert all(torch.equal(weights[k], weights0[k]) for k in weights0)


@pytest.mark.parametrize("depth", [2, 3])
def test_with_starts_the_stage_processes_of_a_pipeline_given_sample_before_any_sample(depth):
    with partime.Pipeline(model(), BALANCES[depth], executor="process", threads=1, sample=sample()) as pipe:
        assert stage_processes() == [f"partime-stage-{i}" for i in range(depth - 1)]
        assert pipe.fed == 0
        assert pipe.step(sample()) is None
    assert stage_processes() == []
    with partime.Pipeline(model(), BALANCES[depth], executor="process", threads=1) as pipe:
        assert stage_processes() == []  # no sample=: the first sample starts them, as before
        pipe.step(sample())
        assert stage_processes() == [f"partime-stage-{i}" for i in range(depth - 1)]


def test_with_starts_the_stage_threads_of_a_pipeline_given_sample():
    with partime.Pipeline(model(), BALANCES[3], executor="thread", threads=1, sample=sample()):
        assert stage_threads() == ["partime-stage-0", "partime-stage-1"]


def test_start_twice_is_one_start_and_start_after_close_raises():
    pipe = partime.Pipeline(model(), BALANCES[2], executor="process", threads=1)
    with pytest.raises(PipelineClosedError, match="not open"):
        pipe.start(sample())
    with pipe:
        with pytest.raises(ValueError, match=r"start\(\) needs a sample"):
            pipe.start()
        pipe.start(sample())
        (first,) = [p.pid for p in multiprocessing.active_children() if p.name == "partime-stage-0"]
        pipe.start(sample())
        pipe.start()
        assert [p.pid for p in multiprocessing.active_children() if p.name.startswith("partime-")] == [first]
    with pytest.raises(PipelineClosedError, match="closed"):
        pipe.start()


NOTES: list[bool] = []
"""What ``Noted``'s forwards note (whether gradients are on): a side effect outside the model."""


class Noted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        NOTES.append(torch.is_grad_enabled())
        return self.linear(x)


@pytest.mark.parametrize("executor", ["inline", "thread"])
@pytest.mark.parametrize("learning", [False, True])
def test_the_first_samples_layout_forward_runs_once_at_the_start(executor, learning):
    NOTES.clear()
    xs = [torch.randn(6) for _ in range(N)]
    net = nn.Sequential(Noted(), nn.ReLU(), nn.Linear(6, 2))
    with partime.Pipeline(net, [1, 2], executor=executor, sample=xs[0], **(LEARN if learning else {})) as pipe:
        assert NOTES == [False]  # the layout's forward, without gradients, at the start
        pipe.start()
        results = list(pipe.stream(xs))
    assert len(results) == N
    assert NOTES == [False] + [learning] * N  # and not again at the first sample


def test_a_first_sample_of_another_layout_starts_the_stages_again_from_it():
    NOTES.clear()
    net = nn.Sequential(Noted(), nn.ReLU(), nn.Linear(6, 2))
    xs = [torch.randn(3, 6) for _ in range(4)]
    with partime.Pipeline(net, [1, 2], executor="thread", threads=1, sample=torch.randn(6)) as pipe:
        outputs = [r.output for r in pipe.stream(xs)]
    assert [o.shape for o in outputs] == [torch.Size([3, 2])] * 4
    assert NOTES == [False, False] + [False] * 4  # the layout's forward on sample=, then on sample 0


# -- checkpoints -------------------------------------------------------------------------------

XS = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(N)]


def same(a, b):
    """Whether two checkpoints (or parts) are equal: their tensors to the bit, the rest by ``==``."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def learner(executor, seed=0, **kw):
    return partime.Pipeline(mlp(seed=seed), [2, 3, 2], executor=executor, threads=1, **LEARN, **kw)


def steps(pipe, n):
    """Step samples ``pipe.fed`` to ``pipe.fed + n``, then flush; every result, in order."""
    results = [pipe.step(XS[pipe.fed]) for _ in range(n)]
    return [r for r in results if r is not None] + pipe.flush()


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_a_started_pipeline_that_fed_nothing_checkpoints_as_one_not_started(executor):
    with learner(executor, sample=XS[0]) as started, learner(executor) as unstarted:
        assert same(started.state_dict(), unstarted.state_dict())
        assert started.state_dict()["layout"] is None


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_a_checkpoint_loads_into_a_started_pipeline_which_starts_again_and_goes_on_exactly(executor):
    with learner("inline") as pipe:
        before = pipe.state_dict()  # taken before any sample: nothing started
        reference = steps(pipe, 5)
        middle = pipe.state_dict()
        reference += steps(pipe, 5)
        weights = pipe.module.state_dict()
    for state, done in ((before, 0), (middle, 5)):
        with learner(executor, seed=1, sample=XS[0]) as pipe, learner(executor, seed=1) as plain:
            pipe.load_state_dict(state)
            if executor == "process":  # started again at once, from the checkpoint
                assert stage_processes() == ["partime-stage-0", "partime-stage-1"]
            plain.load_state_dict(state)  # not started: it starts at its first sample
            assert same(pipe.state_dict(), plain.state_dict())
            results = steps(pipe, 5) if done == 0 else []
            results += steps(pipe, 5)  # the segments of the reference
            assert [r.index for r in results] == [r.index for r in reference[done:]]
            for r, r0 in zip(results, reference[done:]):
                assert torch.equal(r.output, r0.output) and r.loss == r0.loss, r.index
            assert same(pipe.module.state_dict(), weights)


# -- a camera from the first frame ------------------------------------------------------------


FIRST_FORWARD_S = 0.5
_started = False  # in this process: a fresh stage process imports this module anew


class SlowToStart(nn.Module):
    """A layer whose first forward in a process takes ``FIRST_FORWARD_S`` longer (what a model
    does once per process: kernels chosen and compiled, caches filled, memory mapped)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global _started
        if not _started:
            time.sleep(FIRST_FORWARD_S)
            _started = True
        return x


def camera_model():
    torch.manual_seed(0)
    return nn.Sequential(SlowToStart(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def camera(frames, fps):
    """A source with a pace of its own, as a camera is: read by a thread, it does not wait for the pipeline."""
    yield from at_rate(frames, fps)


# The contrast, measured once on a 2-core machine (not asserted: it is the machine's start time).
# Without sample= the stages start at the first frame, in about 2 s: the camera (a source that does
# not wait) dropped 29 of its first 30 frames (57 of 60), its first frame's latency 1.96 s; at_rate,
# which begins once the first sample went in, dropped none, but that frame waited 1.99 s. With
# sample=, `with` took those 2.6 s before the stream: no frame dropped, worst latency 37 ms.
@pytest.mark.parametrize("source", [at_rate, camera])
def test_a_camera_loses_nothing_in_its_first_second_when_the_pipeline_is_given_sample(source):
    frames = [torch.randn(16) for _ in range(30)]  # one second at 30 fps
    with partime.Pipeline(camera_model(), [2, 2], executor="process", threads=1, sample=frames[0]) as pipe:
        results = list(pipe.stream(source(frames, 30), when_behind="drop"))
    assert [r.index for r in results] == list(range(30))
    assert [r.index for r in results if r.dropped] == []
    assert max(r.latency for r in results) < FIRST_FORWARD_S

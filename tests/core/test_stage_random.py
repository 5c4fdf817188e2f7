"""Random and stateful layers: each stage's own random stream, and a forward run again that is the
same forward (SPEC.md, "Random and stateful layers")."""

import copy

import pytest
import torch
from torch import nn

import partime

MODES = ["stash", "weight-stash", "graph-stash"]  # partime mode's product is of another sample's forward
EXECUTORS = ["inline", "thread", "process"]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def dropout_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Dropout(0.5), nn.Linear(12, 12), nn.Dropout(0.3), nn.Linear(12, 3)
    )


def stream(n=24, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 6, generator=gen) for _ in range(n)], [
        torch.randint(0, 3, (2,), generator=gen) for _ in range(n)
    ]


def learn(executor, mode, seed=0, balance=(3, 3), compensation="auto", xs_ys=None):
    xs, ys = xs_ys or stream()
    model = dropout_model(seed)
    torch.manual_seed(100 + seed)  # the pipeline's random state: what its dropout masks come from
    with partime.Pipeline(
        model,
        list(balance),
        executor=executor,
        loss_fn=nn.CrossEntropyLoss(),
        optimizer=sgd,
        grad_mode=mode,
        compensation=compensation,
    ) as pipe:
        losses = [r.loss for r in pipe.stream(xs, ys)]
        return losses, [p.detach().clone() for p in pipe.module.parameters()]


def assert_same(a, b):
    assert a[0] == b[0]
    assert all(torch.equal(p, q) for p, q in zip(a[1], b[1], strict=True))


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_run_again_draws_the_dropout_mask_of_the_samples_own(mode):
    torch.manual_seed(0)
    first, mirror = nn.Linear(4, 16), nn.Linear(16, 16)
    with torch.no_grad():  # the last stage shows stage 0's output as it is: zeros where dropped
        mirror.weight.copy_(torch.eye(16))
        mirror.bias.zero_()
    before = first.weight.detach().clone()
    with partime.Pipeline(
        nn.Sequential(first, nn.Dropout(0.5), mirror),
        [2, 1],
        executor="inline",
        loss_fn=lambda out: out.sum(),
        optimizer=sgd,
        grad_mode=mode,
        compensation=("step-scale", "delay-correction"),
    ) as pipe:
        (result,) = pipe.stream([torch.ones(1, 4)])
        after = pipe.module[0].weight.detach()
    dropped = result.output[0] == 0
    assert 0 < int(dropped.sum()) < 16
    assert torch.equal(after[dropped], before[dropped])  # no gradient through a unit the loss never saw
    assert not (after[~dropped] == before[~dropped]).any()


class CountsItsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return x


def batchnorm_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(4), CountsItsCalls(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("mode", ["partime", *MODES])
def test_every_grad_mode_leaves_the_buffers_a_plain_loop_leaves(mode):
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(5, 4, generator=gen) + 1 for _ in range(6)]
    ys = [torch.randn(5, 2, generator=gen) for _ in range(6)]
    plain = batchnorm_model()
    for x in xs:  # BatchNorm sees the inputs alone: its statistics do not depend on the weights
        plain(x)
    with partime.Pipeline(
        batchnorm_model(),
        [2, 3],
        executor="inline",
        loss_fn=nn.MSELoss(),
        optimizer=sgd,
        grad_mode=mode,
    ) as pipe:
        list(pipe.stream(xs, ys))
        buffers = dict(pipe.module.named_buffers())
    assert int(buffers["0.num_batches_tracked"]) == 6
    assert int(buffers["1.calls"]) == 6
    assert torch.allclose(buffers["0.running_mean"], plain[0].running_mean)
    assert torch.allclose(buffers["0.running_var"], plain[0].running_var)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("mode", MODES)
def test_a_seeded_dropout_model_learns_to_the_bit_in_every_run_and_executor(executor, mode):
    reference = learn("inline", mode)
    assert_same(learn(executor, mode), reference)
    assert_same(learn(executor, mode), reference)
    assert learn("inline", mode, seed=1)[0] != reference[0]  # the seed decides


@pytest.mark.parametrize("executor", ["inline", "process"])
@pytest.mark.parametrize("mode", MODES)
def test_at_depth_one_a_pipeline_made_after_a_seed_learns_as_the_plain_loop(executor, mode):
    xs, ys = stream()
    model = dropout_model()
    plain = copy.deepcopy(model)
    optimizer, loss_fn = sgd(plain.parameters()), nn.CrossEntropyLoss()
    torch.manual_seed(7)
    expected = []
    for x, y in zip(xs, ys):
        loss = loss_fn(plain(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    torch.manual_seed(7)
    with partime.Pipeline(
        model, [6], sample=xs[0], executor=executor, loss_fn=loss_fn, optimizer=sgd, grad_mode=mode
    ) as pipe:
        assert [r.loss for r in pipe.stream(xs, ys)] == expected
        trained = pipe.module
    assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), plain.parameters(), strict=True))


def test_making_a_pipeline_draws_nothing_from_the_callers_stream():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    model = dropout_model()
    torch.manual_seed(3)
    partime.Pipeline(model, 2, sample=stream()[0][0], loss_fn=nn.CrossEntropyLoss(), optimizer=sgd).close()
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_of_a_dropout_model_resumes_to_the_bit(tmp_path, mode):
    xs, ys = stream()
    reference = learn("inline", mode, xs_ys=(xs, ys))
    path, stop = tmp_path / "c.pt", 9

    def stepped(pipe, pairs):
        return [r.loss for r in (pipe.step(x, y) for x, y in pairs) if r is not None]

    model = dropout_model()
    torch.manual_seed(100)
    with partime.Pipeline(
        model, [3, 3], executor="process", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, grad_mode=mode
    ) as pipe:
        losses = stepped(pipe, zip(xs[:stop], ys[:stop]))
        pipe.save(path)  # samples in flight: kept forwards, their random states, the stages' streams
    model = dropout_model(1)
    torch.manual_seed(5)  # another random state: only the checkpoint makes it match
    with partime.Pipeline(
        model, [3, 3], executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, grad_mode=mode
    ) as pipe:
        pipe.load(path)
        losses += stepped(pipe, zip(xs[stop:], ys[stop:])) + [r.loss for r in pipe.flush()]
        weights = [p.detach().clone() for p in pipe.module.parameters()]
    assert_same((losses, weights), reference)


SEEN_THREADS = []


class ReportsItsThreads(nn.Module):
    def forward(self, x):
        SEEN_THREADS.append(torch.get_num_threads())
        return x


def test_the_inline_executor_runs_at_the_stages_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        SEEN_THREADS.clear()
        with partime.Pipeline(
            nn.Sequential(nn.Linear(3, 3), ReportsItsThreads()), [1, 1], executor="inline", threads=1
        ) as p:
            list(p.stream([torch.ones(1, 3)] * 3))
        assert SEEN_THREADS[-3:] == [1, 1, 1]  # the three ticks (before them, the layout's probe)
        assert torch.get_num_threads() == 2  # closing gives the caller its own back
    finally:
        torch.set_num_threads(before)

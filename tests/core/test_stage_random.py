"""Random and stateful layers: each stage's own random stream, and a forward run again that is the
same forward (SPEC.md, "Random and stateful layers")."""

import copy
import threading

import pytest
import torch
from torch import nn

import partime
from partime.core import random_turns
from partime.core.stage import random_stream as stage_random

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


def wide_dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 512), nn.Dropout(0.5), nn.Linear(512, 512), nn.Dropout(0.3), nn.Linear(512, 8), nn.Linear(8, 3)
    )


def drawn_lazily(executor, seed, depth, learning, steps=False):
    """What a stream of samples drawn with ``torch.randn`` as the pipeline asks for them gives,
    the caller drawing too between results: the samples, outputs, losses and trained weights."""
    balance = {2: [3, 3], 3: [2, 2, 2]}[depth]
    options = dict(loss_fn=lambda out: out.pow(2).mean(), optimizer=sgd, grad_mode="stash") if learning else {}
    torch.manual_seed(seed)
    samples, results = [], []

    def lazily():
        for _ in range(12):
            samples.append(torch.randn(32, 6))
            yield samples[-1]

    with partime.Pipeline(wide_dropout_model(), balance, executor=executor, **options) as pipe:
        if steps:
            for x in lazily():
                results.append(pipe.step(x))
                torch.rand(500)  # the caller's own draws, between two steps
            results += pipe.flush()
        else:
            for r in pipe.stream(lazily()):
                results.append(r)
                for _ in range(20):  # the caller's own draws, while the stream holds a result out
                    torch.rand(50)
        weights = [p.detach().clone() for p in pipe.module.parameters()]
    results = [r for r in results if r is not None]
    return samples, [r.output for r in results], [r.loss for r in results], weights, torch.rand(3)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("learning", [False, True], ids=["inference", "learning"])
def test_with_the_thread_executor_the_callers_draws_and_the_stages_are_the_inline_executors(depth, learning):
    """The caller draws its samples (and more) from torch's generator while stage threads run
    dropout: the samples, outputs, losses, weights and the caller's next draws are inline's, in
    every one of several seeded runs (the threads' timing differs from run to run)."""
    for seed in range(5):
        inline = drawn_lazily("inline", seed, depth, learning)
        assert_same_run(drawn_lazily("thread", seed, depth, learning), inline)
    no_dropout = wide_dropout_model().eval()
    with torch.no_grad():  # the stages did draw: dropout left its mark on the outputs
        assert not torch.equal(inline[1][0], no_dropout(inline[0][0]))


def test_a_caller_that_steps_keeps_its_draws_apart_from_the_stage_threads():
    for seed in range(3):
        assert_same_run(
            drawn_lazily("thread", seed, 3, True, steps=True), drawn_lazily("inline", seed, 3, True, steps=True)
        )


def assert_same_run(got, expected):
    samples, outputs, losses, weights, after = got
    assert all(torch.equal(a, b) for a, b in zip(samples, expected[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected[1], strict=True))
    assert losses == expected[2]
    assert all(torch.equal(a, b) for a, b in zip(weights, expected[3], strict=True))
    assert torch.equal(after, expected[4])


def test_two_thread_pipelines_in_one_thread_keep_the_callers_draws_apart():
    """A stream fed by another stream, both through stage threads that draw: the caller's thread
    waits inside one pipeline while the other's stages draw, and gets the inline executor's values."""

    def chained(executor):
        first, second = wide_dropout_model(), wide_dropout_model()
        second[0] = nn.Linear(3, 512)
        torch.manual_seed(4)
        made = []

        def lazily():
            for _ in range(10):
                made.append(torch.randn(8, 6))
                yield made[-1]

        with (
            partime.Pipeline(first, [3, 3], executor=executor) as one,
            partime.Pipeline(second, [2, 2, 2], executor=executor) as two,
        ):
            outputs = []
            for r in two.stream(r.output for r in one.stream(lazily())):
                outputs.append(r.output)
                torch.rand(50)
        return made, outputs, torch.rand(3)

    for _ in range(2):
        got, expected = chained("thread"), chained("inline")
        assert all(torch.equal(a, b) for a, b in zip(got[0], expected[0], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
        assert torch.equal(got[2], expected[2])


def stage_threads():
    return [t for t in threading.enumerate() if t.name.startswith("partime-stage-")]


@pytest.mark.parametrize("how", ["another thread", "garbage collector"])
def test_a_pipeline_whose_stages_wait_for_the_callers_turn_closes_at_once(how):
    """Stage threads that wait for the caller to hand its turn back (the caller runs its own code)
    leave at once when the pipeline is closed from another thread, or collected unclosed."""
    pipe = partime.Pipeline(wide_dropout_model(), [2, 2, 2], executor="thread", timeout=30).__enter__()
    for _ in range(4):
        pipe.step(torch.randn(4, 6))  # the stages have ticks to run: they wait for the caller's turn
    if how == "another thread":
        closer = threading.Thread(target=pipe.close)
        closer.start()
        closer.join(10)
        assert not closer.is_alive()
    else:
        with pytest.warns(ResourceWarning, match="garbage-collected"):
            pipe.__del__()  # what the collector runs, in whatever thread it runs in
    assert not stage_threads()  # joined by close: none was left blocked on the turn
    with random_turns.TURNS.swapping():  # the turn is free: nothing of the pipeline holds it
        torch.rand(3)


def test_turns_keep_a_stage_thread_from_drawing_while_its_caller_runs_the_users_code():
    turns = random_turns.Turns()
    caller = turns.call(drawers=1)
    swapped, leave = threading.Event(), threading.Event()

    def stage():
        with turns.serving(caller, lambda: None), turns.swapping():
            swapped.set()
            leave.wait(10)

    thread = threading.Thread(target=stage)
    thread.start()
    assert not swapped.wait(0.2)  # the caller runs the user's code: the stage waits
    with turns.waiting(caller, timeout=10):
        assert swapped.wait(10)  # inside partime's wait, the stage draws
        leave.set()
    thread.join(10)  # and the caller came out only once it was done: it holds the turn again
    assert not thread.is_alive()
    assert caller.drawers == 0  # its one stage thread ended: the caller holds nothing any more


def test_turns_let_a_waiting_stage_thread_leave_when_its_pipeline_closes():
    turns = random_turns.Turns()
    caller = turns.call(drawers=1)
    stop, left = threading.Event(), []

    def check():
        if stop.is_set():
            raise RuntimeError("stopped")

    def stage():
        try:
            with turns.serving(caller, check), turns.swapping():
                left.append("drew")
        except RuntimeError as exc:
            left.append(str(exc))

    thread = threading.Thread(target=stage)
    thread.start()
    stop.set()
    thread.join(10)
    assert left == ["stopped"]  # its check was asked while it waited: it did not draw


def test_a_stage_thread_whose_first_forward_draws_nothing_frees_its_caller():
    """No dropout: after its first forward the stage thread needs no turn, and its caller holds none."""
    caller, seen = random_turns.TURNS.call(drawers=1), []
    stream = stage_random.RandomStream(1, torch.get_rng_state())

    def stage():
        with random_turns.TURNS.serving(caller, lambda: None):
            with stream.drawing():
                torch.zeros(3).exp()  # draws nothing
            seen.append(caller.drawers)

    with random_turns.TURNS.waiting(caller, timeout=10):
        thread = threading.Thread(target=stage)
        thread.start()
        thread.join(10)
    random_turns.TURNS.close(caller)
    assert seen == [0] and stream.draws is False

"""Bad input gets a clear error that carries the values, never a hang."""

import multiprocessing

import pytest
import torch
from models import classification_stream, mlp
from torch import nn

import partime


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_model_must_be_sequential():
    with pytest.raises(TypeError, match="nn.Sequential, got Linear"):
        partime.Pipeline(nn.Linear(2, 2), 1)


@pytest.mark.parametrize(
    "balance, message",
    [
        ([3, 3], r"layers: 7, sum of balance: 6"),
        (8, r"7 layers into 8 stages"),
        ([7, 0], r"balance"),
        (0, r"balance"),
    ],
)
def test_balance_must_cut_the_model(balance, message):
    with pytest.raises(ValueError, match=message):
        partime.Pipeline(mlp(), balance)


def test_balance_by_number_needs_a_sample_at_the_latest_at_the_first_step():
    pipe = partime.Pipeline(mlp(), 2, executor="inline")
    assert pipe.partition is None
    with pipe:
        pipe.step(torch.randn(2, 6))
        assert pipe.partition.depth == 2 and sum(pipe.partition.balance) == 7
        assert len(pipe.partition.stage_times) == 2


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(executor="gpu"), ValueError, "unknown executor 'gpu'; choose one of inline, process"),
        (dict(grad_mode="exact"), ValueError, "unknown grad_mode 'exact'"),
        (dict(loss_fn=nn.MSELoss()), ValueError, "loss_fn was given without optimizer"),
        (dict(optimizer=sgd), ValueError, "optimizer was given without loss_fn"),
        (dict(devices=["cpu"]), ValueError, r"stages: 2, devices: 1"),
        (dict(devices=["cpu", "meta"]), ValueError, "process executor runs stages on the CPU only"),
        (dict(threads=0), ValueError, "threads must be"),
    ],
)
def test_arguments_are_checked_when_the_pipeline_is_made(kwargs, error, message):
    with pytest.raises(error, match=message):
        partime.Pipeline(mlp(), [3, 4], **kwargs)


def test_use_before_open_and_after_close():
    pipe = partime.Pipeline(mlp(), [3, 4], executor="inline")
    with pytest.raises(partime.PipelineClosedError, match="not open"):
        pipe.step(torch.randn(2, 6))
    with pipe:
        pipe.step(torch.randn(2, 6))
    with pytest.raises(partime.PipelineClosedError, match="closed"):
        pipe.step(torch.randn(2, 6))
    with pytest.raises(partime.PipelineClosedError, match="closed"):
        pipe.flush()
    with pytest.raises(partime.PipelineClosedError, match="already"):
        pipe.open()


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_a_sample_unlike_the_first(executor):
    with partime.Pipeline(mlp(), [3, 4], executor=executor) as pipe:
        pipe.step(torch.randn(2, 6))
        with pytest.raises(ValueError, match=r"sample 1 is \(2, 7\) float32, but the first one was \(2, 6\) float32"):
            pipe.step(torch.randn(2, 7))
        with pytest.raises(ValueError, match=r"sample 2 is \(2, 6\) float64"):
            pipe.step(torch.randn(2, 6, dtype=torch.float64))
        with pytest.raises(TypeError, match="sample 3 must be a tensor or a flat tuple of tensors, got list"):
            pipe.step([[1.0] * 6])
        # the pipeline is still usable after input that was refused; a refused sample used up its index
        assert pipe.step(torch.randn(2, 6)).index == 0
        assert [r.index for r in pipe.flush()] == [4]
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_targets_of_a_supervised_loss(executor):
    xs, ys = classification_stream(5)
    with partime.Pipeline(mlp(), [3, 4], executor=executor, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd) as pipe:
        with pytest.raises(ValueError, match="loss_fn takes a target, but sample 0 came without one"):
            pipe.step(xs[0])
        pipe.step(xs[0], ys[0])
        with pytest.raises(ValueError, match=r"target of sample 2 is \(3,\) int64, but the first one was \(2,\) int64"):
            pipe.step(xs[1], torch.zeros(3, dtype=torch.long))
        with pytest.raises(ValueError, match="ys ended before xs: there is no target for sample 3"):
            list(pipe.stream(xs[1:], ys[1:2][:0]))


def test_a_target_for_a_pipeline_without_a_loss():
    with partime.Pipeline(mlp(), [3, 4], executor="inline") as pipe:
        with pytest.raises(ValueError, match="sample 0 came with a target, but this pipeline has no loss"):
            pipe.step(torch.randn(2, 6), torch.zeros(2))


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_a_loss_that_is_not_a_scalar(executor):
    def per_row(out, y):
        return nn.functional.cross_entropy(out, y, reduction="none")

    xs, ys = classification_stream(5)
    with pytest.raises(
        partime.StageError,
        match=r"stage 1, sample 0, loss: ValueError: loss_fn must return a scalar tensor, got \(2,\)",
    ):
        with partime.Pipeline(mlp(), [3, 4], executor=executor, loss_fn=per_row, optimizer=sgd) as pipe:
            list(pipe.stream(xs, ys))
    assert multiprocessing.active_children() == []


def scaled_loss(out, target):
    """Cross-entropy times a scale that comes with the target (infinite where a test wants it)."""
    y, scale = target
    return nn.functional.cross_entropy(out, y) * scale.sum()


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_a_non_finite_loss_raises_by_default(executor):
    xs, ys = classification_stream(8)
    scales = torch.ones(8, 1)
    scales[5] = float("inf")
    targets = list(zip(ys, scales))
    with partime.Pipeline(mlp(), [3, 4], executor=executor, loss_fn=scaled_loss, optimizer=sgd) as pipe:
        with pytest.raises(
            partime.StageError, match="sample 5, loss: FloatingPointError: the loss of sample 5 is not finite: inf"
        ):
            list(pipe.stream(xs, targets))
        # after a failure nothing more is fed
        with pytest.raises(partime.PipelineClosedError, match="stopped after an error: stage 1, sample 5"):
            pipe.step(xs[6], targets[6])


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_a_non_finite_input_is_refused_by_default_and_the_pipeline_goes_on(executor):
    xs, ys = classification_stream(4)
    bad = xs[1].clone()
    bad[1, 3], bad[0, 4] = float("nan"), float("-inf")
    with partime.Pipeline(mlp(), [3, 4], executor=executor, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd) as pipe:
        pipe.step(xs[0], ys[0])
        with pytest.raises(
            ValueError,
            match=r"sample 1 is not finite: it has 2 non-finite values, the first -inf at "
            r"index \(0, 4\); pass nonfinite='skip'",
        ):
            pipe.step(bad, ys[1])
        rest = [pipe.step(x, y) for x, y in zip(xs[1:], ys[1:])] + pipe.flush()
    assert [r.index for r in rest if r is not None] == [0, 2, 3, 4]  # the refused sample used up index 1
    with partime.Pipeline(nn.Sequential(nn.Identity()), 1, executor="inline") as pipe:
        with pytest.raises(ValueError, match=r"sample 0 is not finite: tensor 1 has 1 non-finite value, the first nan"):
            pipe.step((torch.ones(2), torch.tensor([1.0, float("nan")]), torch.ones(2, dtype=torch.long)))
    with pytest.raises(ValueError, match="unknown nonfinite policy 'ignore'; choose one of raise, skip"):
        partime.Pipeline(mlp(), [3, 4], nonfinite="ignore")


@pytest.mark.parametrize("executor", ["inline", "process"])
@pytest.mark.parametrize("learning", [False, True], ids=["inference", "learning"])
def test_an_empty_stream_and_streams_shorter_than_the_pipeline(executor, learning):
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=sgd) if learning else {}
    xs, ys = classification_stream(2)
    with partime.Pipeline(mlp(), [2, 3, 2], executor=executor, **kw) as pipe:
        assert list(pipe.stream([], [] if learning else None)) == []
        assert pipe.flush() == []
        short = list(pipe.stream(xs, ys if learning else None))  # 2 samples, 3 stages
        assert pipe.step(xs[0], ys[0] if learning else None) is None
        one = pipe.flush()
        trained = pipe.module
    with partime.Pipeline(mlp(), [7], executor="inline", **kw) as plain:
        expected = list(plain.stream([*xs, xs[0]], [*ys, ys[0]] if learning else None))
    assert [r.index for r in short + one] == [0, 1, 2]
    for got, want in zip(short + one, expected, strict=True):
        if not learning:
            assert torch.equal(got.output, want.output)
        assert (got.loss is None) == (not learning)
    if not learning:  # inference leaves the weights alone
        assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), mlp().parameters()))


def test_ys_longer_than_xs_and_a_target_that_is_not_a_tensor():
    xs, ys = classification_stream(3)
    with partime.Pipeline(mlp(), [3, 4], executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd) as pipe:
        with pytest.raises(ValueError, match="ys is longer than xs: xs ended after 2 samples"):
            list(pipe.stream(xs[:2], ys))
    with partime.Pipeline(mlp(), [3, 4], executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd) as pipe:
        with pytest.raises(TypeError, match="target of sample 0 must be a tensor or a flat tuple of tensors, got list"):
            pipe.step(xs[0], [0, 1])


def test_a_model_that_does_not_fit_its_sample_names_the_stage_and_shapes():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(9, 3))
    with partime.Pipeline(model, [2, 1], executor="process") as pipe:
        with pytest.raises(partime.StageError, match=r"stage 1, sample 0, forward: RuntimeError: .*2x8 and 9x3"):
            pipe.step(torch.randn(2, 6))


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_one_device_puts_every_stage_on_it(device, executor):
    xs = torch.randn(4, 2, 6)
    with partime.Pipeline(mlp(), [3, 4], executor=executor, devices=device) as pipe:
        assert pipe._devices == ["cpu", "cpu"]
        outputs = [r.output for r in pipe.stream(xs)]
    with torch.no_grad():
        assert all(torch.equal(out, mlp()(x)) for out, x in zip(outputs, xs))


def test_a_device_this_machine_does_not_have_is_refused_when_the_pipeline_is_made():
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last: no machine has it
    with pytest.raises(ValueError, match=rf"stage 1 is on device {missing!r}, which this machine does not have: .*"):
        partime.Pipeline(mlp(), [3, 4], executor="inline", devices=["cpu", missing])
    with pytest.raises(ValueError, match=rf"stage 0 is on device {missing!r}.*devices this machine has: cpu"):
        partime.Pipeline(mlp(), [3, 4], executor="inline", devices=missing)
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match=r"stage 0 is on device 'mps'.*torch.backends.mps.is_available\(\)"):
            partime.Pipeline(mlp(), [3, 4], executor="inline", devices="mps")
    with pytest.raises(ValueError, match=r"devices\[1\] is 'gpu', which is no device torch knows"):
        partime.Pipeline(mlp(), [3, 4], executor="inline", devices=["cpu", "gpu"])
    with pytest.raises(ValueError, match=r"devices is 'c:0', which is no device torch knows"):
        partime.Pipeline(mlp(), [3, 4], executor="inline", devices="c:0")
    with pytest.raises(
        ValueError, match=rf"puts every stage on the CPU, so it takes no other device \(got {missing!r}\)"
    ):
        partime.Pipeline(mlp(), "auto", executor="inline", devices=missing, sample=torch.randn(2, 6))
    with pytest.raises(ValueError, match=r"leave devices=None, got \['cpu', 'cpu'\]"):
        partime.Pipeline(mlp(), [3, 4], executor="distributed", devices="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_refused_with_what_it_has():
    with pytest.raises(
        ValueError,
        match=r"stage 1 is on device 'cuda:0', which this machine does not have: "
        r"torch.cuda.is_available\(\) is False .*; devices this machine has: cpu",
    ):
        partime.Pipeline(mlp(), [3, 4], executor="inline", devices=["cpu", "cuda:0"])

"""Mixed precision: ``Pipeline(autocast=dtype)`` runs every stage's forward and the loss under
``torch.autocast``; at D = 1 that is a plain loop with autocast around forward and loss, to the
bit; every executor computes what inline does; the caller's own autocast is refused with the fix
(a compiled model and autocast compiled: test_compile)."""

import pytest
import torch
from models import mlp
from torch import nn

import partime

MSE = nn.MSELoss()
BF16 = torch.bfloat16
BALANCES = {1: [7], 2: [3, 4], 3: [2, 3, 2]}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def stream(n=10, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, generator=gen), torch.randn(n, 2, 3, generator=gen)


XS, YS = stream()


def pipeline(depth=1, executor="inline", **kw):
    return partime.Pipeline(mlp(), BALANCES[depth], executor=executor, threads=1, autocast=BF16, **kw)


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def plain_inference():
    model = mlp()
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        return [model(x) for x in XS]


def plain_learning(optimizer):
    """Forward and loss under autocast, backward and step outside it, per sample."""
    model = mlp()
    opt = optimizer(model.parameters())
    outputs, losses = [], []
    for x, y in zip(XS, YS):
        with torch.autocast("cpu", dtype=BF16):
            out = model(x)
            loss = MSE(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        outputs.append(out.detach())
        losses.append(loss.item())
    return outputs, losses, weights(model)


def piped(depth=1, executor="inline", **kw):
    with pipeline(depth, executor, **kw) as pipe:
        results = list(pipe.stream(XS, YS) if "loss_fn" in kw else pipe.stream(XS))
        return [r.output for r in results], [r.loss for r in results], weights(pipe.module)


def test_inference_at_depth_one_is_the_plain_autocast_forward_to_the_bit():
    outputs, _, _ = piped()
    expected = plain_inference()
    assert outputs[0].dtype == BF16  # a Linear's output under bf16 autocast
    assert same(outputs, expected)
    with torch.no_grad():
        full = [mlp()(x) for x in XS]
    assert not same([o.float() for o in outputs], full)  # autocast changed what was computed


@pytest.mark.parametrize("optimizer", [sgd, adam])
def test_learning_at_depth_one_is_the_plain_autocast_loop_to_the_bit(optimizer):
    outputs, losses, learnt = piped(loss_fn=MSE, optimizer=optimizer)
    expected_outputs, expected_losses, expected_weights = plain_learning(optimizer)
    assert outputs[0].dtype == BF16
    assert learnt[0].dtype == torch.float32  # the weights stay in full precision
    assert same(outputs, expected_outputs)
    assert losses == expected_losses
    assert same(learnt, expected_weights)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize("learning", [False, True])
def test_every_executor_computes_what_inline_does(depth, executor, learning):
    kw = dict(loss_fn=MSE, optimizer=adam) if learning else {}
    reference = piped(depth, **kw)
    assert reference[0][0].dtype == BF16
    got = piped(depth, executor, **kw)
    assert same(got[0], reference[0])
    assert got[1] == reference[1]
    assert same(got[2], reference[2])


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
@pytest.mark.parametrize("learning", [False, True])
def test_the_callers_own_autocast_is_refused_before_anything_is_fed(executor, learning):
    kw = dict(loss_fn=MSE, optimizer=adam) if learning else {}
    with pipeline(2, executor, **kw) as pipe:
        pipe.step(XS[0], YS[0] if learning else None)
        with torch.autocast("cpu", dtype=BF16):
            with pytest.raises(
                RuntimeError, match=r"step\(\) was called under torch.autocast.*autocast=torch.bfloat16"
            ):
                pipe.step(XS[1], YS[1] if learning else None)
            assert pipe.fed == 1
            with pytest.raises(RuntimeError, match=r"stream\(\) was called under torch.autocast.*nothing was fed"):
                next(iter(pipe.stream(XS[1:3], YS[1:3] if learning else None)))
            assert pipe.fed == 1
        assert len(pipe.flush()) == 1  # the pipeline stays usable outside it


@pytest.mark.parametrize("value", ["bf16", torch.int8, 16, True])
def test_autocast_must_be_a_floating_dtype(value):
    with pytest.raises(ValueError, match=r"autocast must be None .* or a floating torch.dtype.*got " + repr(value)[:4]):
        partime.Pipeline(mlp(), 2, executor="inline", autocast=value)


def test_a_dtype_torch_cannot_autocast_to_on_the_device_is_refused():
    with pytest.raises(ValueError, match=r"cannot autocast to torch.float64 on cpu"):
        partime.Pipeline(mlp(), 2, executor="inline", autocast=torch.float64)


def test_float16_on_the_cpu_runs_where_torch_supports_it():
    with torch.autocast("cpu", dtype=torch.float16):
        supported = torch.is_autocast_enabled("cpu")
    if not supported:
        with pytest.raises(ValueError, match="cannot autocast to torch.float16 on cpu"):
            partime.Pipeline(mlp(), 2, executor="inline", autocast=torch.float16)
        return
    with partime.Pipeline(mlp(), 2, executor="inline", autocast=torch.float16) as pipe:
        outputs = [r.output for r in pipe.stream(XS[:3])]
    assert [o.dtype for o in outputs] == [torch.float16] * 3


def test_a_checkpoint_with_autocast_continues_exactly(tmp_path):
    kw = dict(loss_fn=MSE, optimizer=adam)
    with pipeline(3, **kw) as pipe:
        reference = [r.loss for r in pipe.stream(XS, YS)]
        expected = weights(pipe.module)
    with pipeline(3, **kw) as pipe:
        before = [r.loss for r in (pipe.step(XS[k], YS[k]) for k in range(6)) if r is not None]
        pipe.save(tmp_path / "mid.pt")
    with pipeline(3, **kw) as pipe:
        pipe.load(tmp_path / "mid.pt")
        after = [r.loss for r in (pipe.step(XS[k], YS[k]) for k in range(6, len(XS))) if r is not None]
        after += [r.loss for r in pipe.flush()]
        assert before + after == reference
        assert same(weights(pipe.module), expected)

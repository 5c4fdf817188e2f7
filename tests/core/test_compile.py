"""``Pipeline(compile=...)``: each stage's forward runs through ``torch.compile`` in its worker.

At D = 1 it is the plain loop over ``torch.compile(model)``, to the bit; at D = 2 every executor,
grad mode, weight prediction, autocast and inference compute what the uncompiled pipeline does
within float rounding; each stage compiles once (one graph per stage) and no tick compiles again;
a model compiled already, and arguments ``torch.compile`` does not take, are refused with the fix.

Most cases compile with ``backend="aot_eager"``: dynamo and AOTAutograd as ``compile=True`` runs
them (guards, graphs, saved tensors), without inductor's seconds of code generation per stage; the
tests that say ``compile=True`` run inductor itself.
"""

import os
import subprocess
import sys

import pytest
import torch
from models import mlp
from torch import nn
from torch._dynamo.utils import counters

import partime
from partime.pipeline.argument_checks import check_no_cuda_graphs

MSE = nn.MSELoss()
AOT = {"backend": "aot_eager"}
BALANCES = {1: [7], 2: [3, 4]}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh: dynamo's cache (and its recompile limit) is per process, shared
    by every test that compiles a ``nn.Sequential``."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graphs():
    """How many graphs dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def stream(n=8, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, generator=gen), torch.randn(n, 2, 3, generator=gen)


XS, YS = stream()


def run(compile, depth=2, executor="inline", grad_mode=None, model=None, **kw):
    """Outputs, losses and final weights of a pipeline over ``XS`` (learning unless ``grad_mode`` is None)."""
    learning = grad_mode is not None
    learn = dict(loss_fn=MSE, optimizer=sgd, grad_mode=grad_mode) if learning else {}
    pipe = partime.Pipeline(
        mlp() if model is None else model,
        BALANCES[depth],
        executor=executor,
        threads=1,
        compile=compile,
        **learn,
        **kw,
    )
    with pipe:
        results = list(pipe.stream(XS, YS if learning else None))
        weights = [p.detach().clone() for p in pipe.module.parameters()]
    return [r.output for r in results], [r.loss for r in results], weights


def close(a, b, atol=1e-6):
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=1e-5, atol=atol) for x, y in zip(a, b, strict=True))


def test_a_compiled_model_is_refused_naming_compile():
    compiled = torch.compile(mlp())
    with pytest.raises(TypeError, match=r"torch.compile'd module .*model._orig_mod\) and compile=True"):
        partime.Pipeline(compiled, 2, executor="inline")
    in_place = mlp()
    in_place.compile()
    with pytest.raises(TypeError, match=r"model.compile\(\) was called .* and compile=True"):
        partime.Pipeline(in_place, 2, executor="inline")
    with partime.Pipeline(compiled._orig_mod, 2, executor="inline", compile=AOT) as pipe:  # the fix works
        assert pipe.step(XS[0]) is None
        assert torch.allclose(pipe.step(XS[1]).output, compiled._orig_mod(XS[0]))


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("yes", TypeError, r"compile must be True, False or a dict of torch.compile's keyword arguments.*got str"),
        ({"model": nn.Identity()}, ValueError, r"'model' is none of them .*each stage compiles its own forward"),
        ({"modes": "max-autotune"}, ValueError, r"torch.compile's keyword arguments \(fullgraph, dynamic, .*'modes'"),
        ({"mode": "fastest"}, ValueError, r"torch.compile refuses compile=\{'mode': 'fastest'\}: .*fastest"),
        ({"backend": "no-such-backend"}, ValueError, r"torch.compile refuses .*no-such-backend"),
    ],
)
def test_compile_takes_true_or_torch_compile_s_keywords(value, error, message):
    with pytest.raises(error, match=message):
        partime.Pipeline(mlp(), 2, executor="inline", compile=value)


def test_at_one_stage_it_is_the_plain_loop_over_the_compiled_model_to_the_bit():
    model = mlp()
    compiled = torch.compile(model, dynamic=False)
    opt = sgd(model.parameters())
    outputs, losses = [], []
    for x, y in zip(XS, YS):
        out = compiled(x)
        loss = MSE(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        outputs.append(out.detach())
        losses.append(loss.item())
    got_outputs, got_losses, got_weights = run(True, depth=1, grad_mode="graph-stash")
    assert all(torch.equal(a, b) for a, b in zip(got_outputs, outputs, strict=True))
    assert got_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(got_weights, model.parameters(), strict=True))


CASES = [
    ("inline", 1, None),
    ("inline", 2, None),
    ("inline", 2, "graph-stash"),
    ("inline", 2, "stash"),
    ("inline", 2, "weight-stash"),
    ("inline", 2, "partime"),
    ("thread", 2, "graph-stash"),
    ("process", 2, "graph-stash"),
]


@pytest.mark.parametrize(("executor", "depth", "grad_mode"), CASES)
def test_compiled_equals_uncompiled(executor, depth, grad_mode):
    expected = run(False, depth, executor, grad_mode)
    before = graphs()
    got = run(AOT, depth, executor, grad_mode)
    if executor != "process":  # the stages compiled here (a process's stages compile there)
        assert graphs() - before == depth
    outputs, losses, weights = got
    assert close(outputs, expected[0]) and close(weights, expected[2])
    assert losses == (expected[1] if grad_mode is None else pytest.approx(expected[1], rel=1e-6))


@pytest.mark.parametrize(
    "options",
    [dict(autocast=torch.bfloat16), dict(compensation="weight-prediction")],
    ids=["autocast", "weight-prediction"],
)
def test_autocast_and_swapped_weights_compile_too(options):
    expected = run(False, 2, "inline", "graph-stash", **options)
    before = graphs()
    got = run(AOT, 2, "inline", "graph-stash", **options)
    assert graphs() - before == 2
    assert close(got[0], expected[0], atol=1e-2) and close(got[2], expected[2], atol=1e-3)


def test_eval_mode_inference_with_normalisation_and_dropout():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 3)).eval()

    inputs = XS.reshape(4, 4, 6)
    outputs = []
    for compile in (False, AOT):
        with partime.Pipeline(model(), [3, 2], executor="inline", threads=1, compile=compile) as pipe:
            outputs.append([r.output for r in pipe.stream(inputs)])
    expected = model()(inputs.reshape(16, 6)).reshape(4, 4, 3)
    assert close(outputs[1], outputs[0]) and close(outputs[1], list(expected))


@pytest.mark.parametrize(
    ("executor", "grad_mode", "compile"), [("inline", "stash", AOT), ("thread", "graph-stash", True)]
)
def test_no_tick_compiles_again(executor, grad_mode, compile):
    """One graph per stage, compiled at its first forward; the ticks after it, forwards again for a
    late gradient (stash) and the caller's own thread count included, compile nothing."""
    torch.set_num_threads(2)  # the caller's count is not the stages' (threads=1)
    xs, ys = stream(n=12, seed=2)
    model = mlp()
    with partime.Pipeline(
        model, [3, 4], executor=executor, loss_fn=MSE, optimizer=sgd, grad_mode=grad_mode, threads=1, compile=compile
    ) as pipe:
        before = graphs()
        for k, (x, y) in enumerate(zip(xs, ys)):
            pipe.step(x, y)
            if k == 3:  # every stage has run its forward and its product
                compiled = graphs() - before
        pipe.flush()
        assert compiled == 2
        assert graphs() - before == compiled
    if compile is True:  # inductor's kernels compute what the uncompiled stages do, within rounding
        expected = run(False, 2, executor, grad_mode)
        got = run(True, 2, executor, grad_mode)
        assert close(got[0], expected[0], atol=1e-5) and close(got[2], expected[2], atol=1e-5)


def test_a_checkpoint_of_compiled_stages_goes_on_as_they_would():
    def pipeline():
        return partime.Pipeline(mlp(), [3, 4], executor="inline", loss_fn=MSE, optimizer=sgd, threads=1, compile=AOT)

    with pipeline() as whole:
        expected = [r.loss for r in whole.stream(XS, YS)]
    with pipeline() as first:
        losses = [r.loss for r in (first.step(x, y) for x, y in zip(XS[:5], YS[:5])) if r is not None]
        state = first.state_dict()
    with pipeline() as second:
        second.load_state_dict(state)
        losses += [r.loss for r in second.stream(XS[5:], YS[5:])]
    assert losses == pytest.approx(expected, rel=1e-6)


def test_more_stages_than_dynamo_keeps_in_one_process_warn(caplog):
    deep = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    limit = torch._dynamo.config.recompile_limit
    with caplog.at_level("WARNING", logger="partime"):
        partime.Pipeline(deep, limit + 1, executor="inline", compile=AOT)
        partime.Pipeline(deep, limit + 1, executor="process", compile=AOT)  # a process per stage
    warned = [r.getMessage() for r in caplog.records if "recompile_limit" in r.getMessage()]
    assert len(warned) == 1 and f"compile= with {limit + 1} stages in one process (inline executor)" in warned[0]


@pytest.mark.parametrize("options", [{"mode": "reduce-overhead"}, {"options": {"triton.cudagraphs": True}}])
def test_cuda_graphs_are_refused_on_cuda_and_taken_on_the_cpu(options):
    with pytest.raises(ValueError, match=r"replays CUDA graphs .* compile=\{'mode': 'max-autotune-no-cudagraphs'\}"):
        check_no_cuda_graphs({**options, "dynamic": False}, ["cpu", "cuda:0"])
    check_no_cuda_graphs(options, ["cpu", "cpu"])  # inductor replays none on the CPU
    assert partime.Pipeline(mlp(), 2, executor="inline", compile=options).depth == 2


LEAK_CHECK = """
import torch, partime
from torch import nn

if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    xs = torch.randn(6, 1, 3, 12, 12)
    with partime.Pipeline(model, 2, executor="process", threads=1, compile=True, sample=xs[0]) as pipe:
        print(len(list(pipe.stream(xs))))
"""


def test_a_stage_process_compiling_from_inductor_s_cache_leaves_no_semaphore_behind(tmp_path):
    script = tmp_path / "leak_check.py"
    script.write_text(LEAK_CHECK)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    for run in ("cold", "warm"):  # the first run fills the cache; the second compiles from it
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["6"]
    # the resource tracker's warning at shutdown (a cold cache still leaves one: not yet found where)
    assert "leaked" not in done.stderr, done.stderr

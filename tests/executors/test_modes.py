"""Every stage keeps the mode of every module it holds (``train()`` or ``eval()``, module by module)
wherever it runs: in the caller, a thread, a worker process, another rank, after a checkpoint is
loaded. In eval mode a pipeline without a loss gives ``model(x)`` to the bit; in train mode (Dropout
drawing, BatchNorm on batch statistics) it gives what the inline executor gives."""

import copy
import os
import pickle
import sys
import time
from pathlib import Path

import pytest
import torch
import traced_models
from test_distributed import join_on_localhost, reap, start_ranks
from torch import nn

import partime
from partime.executors.spawning import ByValue
from partime.planning.partition import split
from partime.traced.tracing import layers_of

EXECUTORS = ["inline", "thread", "process"]
SAMPLES = 5
POPULAR = {
    "resnet": traced_models.ResNet,
    "mobilenet_v2": traced_models.MobileNetV2Like,
    "efficientnet": traced_models.EfficientNetLike,
    "vit": traced_models.ViTLike,
    "densenet": traced_models.DenseNetLike,
}


def drop_norm(kind, seed=0):
    """A model with Dropout and BatchNorm (running statistics of its own): traced, or an nn.Sequential."""
    torch.manual_seed(seed)
    model = traced_models.DropNorm() if kind == "traced" else traced_models.drop_norm_sequential()
    return traced_models.with_statistics(model, seed)


def popular(name, seed=0):
    torch.manual_seed(seed)
    return traced_models.with_statistics(POPULAR[name](), seed)


def rows(n=SAMPLES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 8, generator=gen) for _ in range(n)]


def images(n=SAMPLES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 8, 8, generator=gen) for _ in range(n)]


def even(model, depth, sample):
    """``depth`` stages of as even a number of layers as can be (no timing: the same cut every run)."""
    n = len(layers_of(copy.deepcopy(model), sample))
    return [n // depth + (1 if i < n % depth else 0) for i in range(depth)]


def plain(model, x):
    """``model(x)`` as a pipeline without a loss computes it: under ``torch.no_grad()`` (where
    nn.MultiheadAttention in eval() takes its fast path, of other bits)."""
    with torch.no_grad():
        return model(x)


def modes(model):
    return {name: module.training for name, module in model.named_modules()}


def run(model, depth, xs, executor):
    """The outputs of ``xs`` through a pipeline of ``model`` cut into ``depth`` stages, and its ``module``."""
    with partime.Pipeline(model, even(model, depth, xs[0]), executor=executor, threads=1, sample=xs[0]) as pipe:
        outputs = [r.output for r in pipe.stream(xs)]
        return outputs, pipe.module


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("kind", ["traced", "sequential"])
def test_in_eval_mode_every_executor_gives_the_models_own_outputs(kind, executor, depth):
    model = drop_norm(kind).eval()
    xs = rows()
    outputs, module = run(model, depth, xs, executor)
    for s, (out, x) in enumerate(zip(outputs, xs)):
        assert torch.equal(out, plain(model, x)), (s, (out - plain(model, x)).abs().max().item())
    assert modes(module) == modes(model)
    for name, buffer in model.named_buffers():  # BatchNorm in eval() counts nothing
        assert torch.equal(module.get_buffer(name), buffer), name


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("executor", EXECUTORS[1:])
@pytest.mark.parametrize("kind", ["traced", "sequential"])
def test_in_train_mode_every_executor_gives_what_inline_gives(kind, executor, depth):
    model = drop_norm(kind).train()
    xs = rows()
    inline_outputs, inline_module = run(model, depth, xs, "inline")
    outputs, module = run(model, depth, xs, executor)
    for s, (out, expected) in enumerate(zip(outputs, inline_outputs)):
        assert torch.equal(out, expected), s
    evaluated = copy.deepcopy(model).eval()(xs[0])
    assert not torch.equal(inline_outputs[0], evaluated)  # Dropout drew, BatchNorm took the batch's statistics
    assert modes(module) == modes(model)
    for name, buffer in inline_module.named_buffers():  # every sample counted once, as inline counts it
        assert torch.equal(module.get_buffer(name), buffer), name


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("kind", ["traced", "sequential"])
def test_a_model_in_train_mode_with_its_batchnorm_in_eval_keeps_both(kind, executor):
    """Fine-tuning with frozen BatchNorm: the model in train(), its BatchNorm in eval()."""
    model = drop_norm(kind).train()
    norm = next(m for m in model.modules() if isinstance(m, nn.BatchNorm1d))
    norm.eval()
    xs = rows()
    outputs, module = run(model, 2, xs, executor)
    inline_outputs, _ = run(model, 2, xs, "inline")
    for s, (out, expected) in enumerate(zip(outputs, inline_outputs)):
        assert torch.equal(out, expected), s
    assert modes(module) == modes(model)
    for name, buffer in model.named_buffers():  # the BatchNorm in eval() counted nothing
        assert torch.equal(module.get_buffer(name), buffer), name


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", list(POPULAR))
def test_popular_models_in_eval_mode_give_their_own_outputs(name, executor):
    model = popular(name).eval()
    xs = images(3)
    outputs, module = run(model, 3, xs, executor)
    for s, (out, x) in enumerate(zip(outputs, xs)):
        assert torch.equal(out, plain(model, x)), (s, (out - plain(model, x)).abs().max().item())
    assert modes(module) == modes(model)


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_an_eval_pipeline_resumed_from_a_checkpoint_stays_in_eval(executor, tmp_path):
    model = drop_norm("traced").eval()
    xs = rows()
    balance = even(model, 2, xs[0])
    with partime.Pipeline(model, balance, executor="inline", threads=1) as pipe:
        first = [pipe.step(x) for x in xs[:2]]
        pipe.save(tmp_path / "eval.pt")
    with partime.Pipeline(model, balance, executor=executor, threads=1) as pipe:
        pipe.load(tmp_path / "eval.pt")
        rest = [pipe.step(x) for x in xs[2:]] + pipe.flush()
        module = pipe.module
    outputs = [r.output for r in first + rest if r is not None]
    assert len(outputs) == SAMPLES
    for s, (out, x) in enumerate(zip(outputs, xs)):
        assert torch.equal(out, plain(model, x)), s
    assert modes(module) == modes(model)


@pytest.mark.parametrize("travel", ["deepcopy", "pickle"])
def test_a_fused_stage_travels_with_the_mode_of_every_module_it_holds(travel):
    """What a worker process or a copy rebuilds: each module with its own flag, not the stage's."""
    model = drop_norm("traced").train()
    model.norm.eval()
    stage = split(layers_of(model), [7])[0]
    moved = copy.deepcopy(stage) if travel == "deepcopy" else pickle.loads(pickle.dumps(ByValue(stage))).load()
    assert modes(moved) == modes(stage)
    assert moved.graph_module.norm.training is False and moved.graph_module.drop.training is True


def channels_last_net(seed=0):
    """Convolutions, BatchNorm, GroupNorm and pooling, whose activations are channels_last where the
    model is: a GroupNorm or a global pooling sums them in another order on a contiguous copy."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 3),
    )
    return traced_models.with_statistics(model, seed).eval().to(memory_format=torch.channels_last)


def channels_last_images(n=SAMPLES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 8, 8, generator=gen).to(memory_format=torch.channels_last) for _ in range(n)]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_channels_last_activation_crosses_a_cut_in_its_own_strides(executor):
    model = channels_last_net()
    xs = channels_last_images()
    with partime.Pipeline(model, [4, 4], executor=executor, threads=1) as pipe:  # the cut before the GroupNorm
        outputs = [r.output for r in pipe.stream(xs)]
    for s, (out, x) in enumerate(zip(outputs, xs)):
        assert torch.equal(out, plain(model, x)), (s, (out - plain(model, x)).abs().max().item())
    assert model[:4](xs[0]).is_contiguous(memory_format=torch.channels_last)  # what crosses the cut


class Doubled(nn.Module):
    """A parametrization: the weight used is twice the one stored."""

    def forward(self, weight):
        return 2 * weight


@pytest.mark.parametrize("depth", [2, 3])
def test_a_parametrized_module_that_cannot_travel_to_a_worker_process_is_refused_by_name(depth):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    torch.nn.utils.parametrize.register_parametrization(model[2], "weight", Doubled())
    balance = [3, 1] if depth == 2 else [1, 2, 1]
    xs = [torch.randn(2, 4) for _ in range(3)]
    with pytest.raises(TypeError, match=r"holds parametrized modules \(2: .*executor='thread'"):
        with partime.Pipeline(model, balance, threads=1) as pipe:
            list(pipe.stream(xs))
    with partime.Pipeline(model, balance, executor="thread", threads=1) as pipe:  # the way out it names
        outputs = [r.output for r in pipe.stream(xs)]
    assert all(torch.equal(out, plain(model, x)) for out, x in zip(outputs, xs))


def hooked(where):
    model = drop_norm("traced" if where != "sequential" else "sequential").eval()
    if where == "sequential":
        model.register_forward_hook(traced_models.add_one)
    elif where == "root":
        model.register_forward_pre_hook(traced_models.doubled_input)
    return model


@pytest.mark.parametrize("where", ["sequential", "root"])
def test_hooks_on_a_module_whose_forward_the_pipeline_never_calls_are_refused_by_name(where):
    with pytest.raises(TypeError, match=r"hooks on (Sequential|DropNorm) itself, which would never run"):
        partime.Pipeline(hooked(where), 2, executor="inline", sample=rows(1)[0])


def test_hooks_on_a_block_the_trace_goes_through_are_refused_by_name():
    model = popular("resnet").eval()
    model.layer1.register_forward_hook(traced_models.add_one)
    with pytest.raises(TypeError, match=r"forward hooks on its module layer1 \(BasicBlock\), which would never run"):
        partime.Pipeline(model, 2, executor="inline", sample=images(1)[0])


def test_hooks_that_the_pipelines_copy_of_the_model_would_lose_are_refused_by_name():
    """torch.fx.GraphModule's deep copy drops its own forward hooks (fx names its class after the traced one)."""
    torch.manual_seed(0)
    graph = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    graph.register_forward_hook(traced_models.add_one)
    model = nn.Sequential(nn.Linear(8, 8), graph, nn.Linear(8, 4))
    with pytest.raises(TypeError, match=r"module 1 \(Sequential\) loses its forward hooks when copied"):
        partime.Pipeline(model, [2, 1], executor="inline")


@pytest.mark.parametrize("executor", EXECUTORS)
def test_hooks_on_the_layers_run_in_every_executor(executor):
    model = popular("resnet").eval()
    model.layer1.bn1.register_forward_hook(traced_models.add_one)
    model.fc.register_forward_pre_hook(traced_models.doubled_input)
    xs = images(3)
    outputs, _ = run(model, 3, xs, executor)
    for s, (out, x) in enumerate(zip(outputs, xs)):
        assert torch.equal(out, plain(model, x)), s
    unhooked = popular("resnet").eval()
    assert not torch.equal(outputs[0], plain(unhooked, xs[0]))


# -- the distributed executor: ranks started as processes running this file (as test_distributed's) ----


def rank_main(out):
    """On every rank: the traced drop_norm model in eval() and in train(), then the sequential one in
    eval() on rank 0 and train() on the others (rank 0's mode is the pipeline's); rank 0 saves the outputs."""
    depth, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    join_on_localhost(depth, rank)
    torch.set_num_threads(1)
    xs, seen = rows(), {}
    for mode in ("eval", "train"):
        seen[mode] = run(drop_norm("traced").train(mode == "train"), depth, xs, "distributed")[0]
    model = drop_norm("sequential").train(rank != 0)  # in eval() on rank 0 only; the last stage has a Dropout
    seen["rank 0's mode"] = run(model, depth, xs, "distributed")[0]
    seen["channels_last"] = run(channels_last_net(), depth, channels_last_images(), "distributed")[0]
    if rank == 0:
        torch.save(seen, Path(out, "seen.pt"))


def launch_ranks(out, depth, timeout=90.0):
    """Run ``rank_main`` on ``depth`` ranks on localhost; each rank's exit code and log."""
    procs, logs = start_ranks(out, depth, None, script=__file__)
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        reap(procs)
    return [p.returncode for p in procs], [log.read_text() for log in logs]


@pytest.mark.parametrize("depth", [2, 3])
def test_the_distributed_executor_keeps_every_modules_mode(depth, tmp_path):
    codes, logs = launch_ranks(tmp_path, depth)
    assert codes == [0] * depth, "\n\n".join(logs)
    seen = torch.load(Path(tmp_path, "seen.pt"), weights_only=False)
    xs = rows()
    model = drop_norm("traced").eval()
    for s, (out, x) in enumerate(zip(seen["eval"], xs)):
        assert torch.equal(out, plain(model, x)), s
    model = drop_norm("sequential").eval()
    for s, (out, x) in enumerate(zip(seen["rank 0's mode"], xs)):  # the other ranks' models were in train()
        assert torch.equal(out, plain(model, x)), s
    inline = run(drop_norm("traced").train(), depth, xs, "inline")[0]
    for s, (out, expected) in enumerate(zip(seen["train"], inline)):
        assert torch.equal(out, expected), s
    model = channels_last_net()  # its activations cross the links between ranks in their own strides
    for s, (out, x) in enumerate(zip(seen["channels_last"], channels_last_images())):
        assert torch.equal(out, plain(model, x)), s


if __name__ == "__main__":
    rank_main(sys.argv[1])

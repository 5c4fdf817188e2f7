"""Traced models (partime.traced.tracing): modules that are not an nn.Sequential, cut between the nodes of
their fx graph; against the model itself, the inline executor and plain online learning."""

import copy
import functools
import itertools
import json
import traceback

import pytest
import torch
import torch.fx
import traced_models as tm
from click.testing import CliRunner
from torch import nn

import partime
from partime.errors import StageError
from partime.planning import planner
from partime.planning.hop_cost import stage_hop
from partime.planning.partition import best_split
from partime.planning.planner import plan
from partime.planning.ties import tied_cuts
from partime.traced.partition import TracedPartition
from partime.traced.tracing import boundary_specs, layers_of
from partime_tools.bench.models import resnet
from partime_tools.cli import main

MODELS = ("resnet", "unet", "transformer", "windowed")  # windowed: a graph fx cannot trace again
GRAD_MODES = ("partime", "stash", "weight-stash", "graph-stash")


def loss_for(name):
    return (lambda out: (out**2).mean()) if name == "unet" else nn.CrossEntropyLoss()


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def even(n, depth):
    """``n`` layers in ``depth`` stages, as even as can be."""
    return [n // depth + (i < n % depth) for i in range(depth)]


def layer_count(name):
    return len(layers_of(tm.make(name)))


def learn(name, balance, executor, grad_mode, n=6):
    xs, ys = tm.samples(name, n)
    kw = dict(loss_fn=loss_for(name), optimizer=sgd, grad_mode=grad_mode, threads=1)
    with partime.Pipeline(tm.make(name), balance, executor=executor, **kw) as pipe:
        results = list(pipe.stream(xs, ys))
        return [(r.index, r.output, r.loss) for r in results], pipe.module


@functools.cache
def learnt_inline(name, depth, grad_mode):
    return learn(name, even(layer_count(name), depth), "inline", grad_mode)


def assert_same(a, b):
    (results_a, model_a), (results_b, model_b) = a, b
    assert [r[0] for r in results_a] == [r[0] for r in results_b] == list(range(len(results_a)))
    for (i, out_a, loss_a), (_, out_b, loss_b) in zip(results_a, results_b, strict=True):
        assert torch.equal(out_a, out_b) and loss_a == loss_b, i
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key


# --- what the model computes: inference and learning ----------------------------------------


@pytest.mark.parametrize("executor", ["inline", "process", "thread"])
@pytest.mark.parametrize("depth", [2, 3, 4])
@pytest.mark.parametrize("name", MODELS)
def test_inference_equals_the_model_to_the_bit(name, depth, executor):
    model = tm.make(name)
    xs, _ = tm.samples(name, 5)
    with partime.Pipeline(model, depth, executor=executor, threads=1, sample=xs[0]) as pipe:
        outputs = [r.output for r in pipe.stream(xs)]
        assert pipe.partition.depth == depth
    with torch.no_grad():
        expected = [model(x) for x in xs]
    assert len(outputs) == len(xs)
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert torch.equal(got, want), i


@pytest.mark.parametrize("executor", ["process", "thread"])
@pytest.mark.parametrize("grad_mode", GRAD_MODES)
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("name", MODELS)
def test_learning_equals_inline_to_the_bit(name, depth, grad_mode, executor):
    inline = learnt_inline(name, depth, grad_mode)
    other = learn(name, even(layer_count(name), depth), executor, grad_mode)
    assert_same(inline, other)
    assert type(other[1]) is type(tm.make(name))  # the user's module type, trained
    start = tm.make(name).state_dict()
    moved = [k for k, v in other[1].state_dict().items() if not torch.equal(v, start[k])]
    assert len(moved) > len(start) // 2  # it learnt: most weights (and BatchNorm's statistics) moved


def plain_online_learning(name, n=6):
    """The model, its loss and an SGD step per sample: what every grad mode is at D = 1."""
    model, loss_fn = tm.make(name), loss_for(name)
    optimizer = sgd(model.parameters())
    xs, ys = tm.samples(name, n)
    results = []
    for i, x in enumerate(xs):
        out = model(x)
        loss = loss_fn(out) if ys is None else loss_fn(out, ys[i])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        results.append((i, out.detach(), loss.item()))
    return results, model


@pytest.mark.parametrize("grad_mode", GRAD_MODES)
@pytest.mark.parametrize("name", MODELS)
def test_one_stage_is_plain_online_learning(name, grad_mode):
    assert_same(plain_online_learning(name), learn(name, 1, "inline", grad_mode))


def test_a_checkpoint_of_a_traced_model_resumes_on_another_executor(tmp_path):
    xs, ys = tm.samples("resnet", 6)
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=sgd, threads=1)
    balance = even(layer_count("resnet"), 2)
    with partime.Pipeline(tm.make("resnet"), balance, executor="inline", **kw) as pipe:
        whole = list(pipe.stream(xs, ys))
        expected = pipe.module
    with partime.Pipeline(tm.make("resnet"), balance, executor="inline", **kw) as pipe:
        first = [pipe.step(x, y) for x, y in zip(xs[:3], ys[:3], strict=True)]
        pipe.save(tmp_path / "run.pt")
    with partime.Pipeline(tm.make("resnet"), balance, executor="process", **kw) as pipe:
        pipe.load(tmp_path / "run.pt")
        rest = list(pipe.stream(xs[pipe.fed :], ys[pipe.fed :]))
        resumed = pipe.module
    got = [r for r in first if r is not None] + rest
    assert [r.index for r in got] == list(range(6))
    assert all(torch.equal(a.output, b.output) and a.loss == b.loss for a, b in zip(got, whole, strict=True))
    assert_same(([], expected), ([], resumed))


# --- how the graph becomes layers -----------------------------------------------------------


def test_the_values_crossing_each_cut_of_the_unet():
    layers = layers_of(tm.make("unet"))
    assert [layer.node for layer in layers] == list(layers._modules) == tm.UNET_NODES
    assert {k: layers[k].takes for k in range(1, len(layers))} == tm.UNET_CROSSING
    assert layers[0].takes == ("x",)


def test_the_segments_hold_the_models_own_modules_and_tensors():
    model = tm.make("resnet")
    layers = layers_of(model)
    held = {id(t) for t in itertools.chain(layers.parameters(), layers.buffers())}
    assert held == {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
    shortcut = layers.layer2_shortcut_0.get_submodule("layer2.shortcut.0")  # under the model's own name
    assert shortcut is model.layer2.shortcut[0]
    assert not any(tied_cuts(layers))  # ReLU is called twice in a block, and holds no tensor


def test_partition_names_the_nodes_of_each_stage_and_what_crosses_each_boundary():
    xs, _ = tm.samples("unet", 1)
    with partime.Pipeline(tm.make("unet"), [3, 14], executor="inline", sample=xs[0]) as pipe:
        p = pipe.partition
    assert isinstance(p, TracedPartition) and p.balance == (3, 14)
    assert p.stage_nodes == (tuple(tm.UNET_NODES[:3]), tuple(tm.UNET_NODES[3:]))
    (boundary,) = p.boundaries
    assert boundary.values == ("relu", "pool")  # e1 for the long skip, and the pooled e1
    assert [t.shape for t in boundary.spec.tensors] == [(1, 4, 8, 8), (1, 4, 4, 4)]
    assert boundary.nbytes == (4 * 8 * 8 + 4 * 4 * 4) * 4
    summary = p.summary().splitlines()
    assert summary[1:] == [
        "  stage 0 holds 3 nodes: enc1, relu, pool",
        "  stage 1 holds 14 nodes: enc2, relu_1, pool_1, mid, ..., relu_4, head",
        "  stage 0 -> 1: 2 tensors, 1280 bytes: relu (1, 4, 8, 8) float32, pool (1, 4, 4, 4) float32",
    ]
    with partime.Pipeline(tm.make("unet"), 2, executor="inline") as pipe:  # shapes from the first sample
        assert pipe.partition is None
        pipe.step(xs[0])
        assert pipe.partition.boundaries[0].nbytes is not None


def _brute_force(times, depth, hops=None):
    """The cut whose slowest stage (hops included) is fastest, by trying every one."""
    n = len(times)
    best = None
    for cuts in itertools.combinations(range(1, n), depth - 1):
        edges = (0, *cuts, n)
        worst = max(sum(times[a:b]) + stage_hop(a, b, n, hops, 0.0) for a, b in itertools.pairwise(edges))
        key = (worst, tuple(b - a for a, b in itertools.pairwise(edges)))
        best = key if best is None or key[0] < best[0] else best
    return best


def test_the_balancer_cuts_a_traced_graph_at_its_known_optimum(monkeypatch):
    layers = layers_of(tm.make("unet"))
    # convolutions 4, transposed ones 2, the rest 1: 34 in all, and no cut into 3 stages is under 12:
    # enc1 .. pool_1 (12) | mid .. dec2 (12) | relu_3 .. head (10) is the one that reaches it
    convolutions = {"enc1", "enc2", "mid", "dec2", "dec1"}
    times = tuple(4.0 if n in convolutions else 2.0 if n.startswith("up") else 1.0 for n in tm.UNET_NODES)
    monkeypatch.setattr(planner, "profile_layers", lambda *args, **kwargs: times)
    p = plan(layers, 3, torch.randn(1, 3, 8, 8))
    assert p.balance == (6, 5, 6) and p.stage_times == (12.0, 12.0, 10.0)
    assert max(p.stage_times) == _brute_force(times, 3)[0]
    # a boundary costs 10 per tensor that crosses it: the middle of the U-Net, which the skips cross,
    # is dear (17 | 17 + 3 tensors), and the cut after the last concatenation (one tensor) is best
    hops = [10.0 * len(layers[k].takes) for k in range(1, len(layers))]
    assert best_split(times, 2, hop_times=hops) == (14, 3) and layers[14].takes == ("cat_1",)
    assert _brute_force(times, 2, hops)[0] == 28.0 + 10.0


# --- ties: a parameter that two stages would update ---------------------------------------------


def test_a_list_balance_that_splits_tied_weights_is_refused_naming_them():
    with pytest.raises(ValueError) as info:
        partime.Pipeline(tm.TiedEnds(), [1, 4], executor="inline")
    assert str(info.value) == (
        'balance [1, 4] splits a shared parameter between stage 0 and stage 1: "enc.weight" of node enc '
        '(layer 0, stage 0) is "dec.weight" of node dec (layer 2, stage 1), and each stage would update it '
        "on its own (layers: 5); put layers 0 to 2 (nodes enc to dec) in one stage: balance=[3, 2], or untie "
        "the weights; TiedEnds: its 5 layers are the nodes of its traced graph, in order: 0 enc, 1 relu, 2 dec, "
        "3 relu_1, 4 head (pipe.partition.nodes names them, and pipe.partition.summary() shows them by stage, for a "
        "pipeline made with balance=[5])"
    )
    with pytest.raises(ValueError, match=r'"lin.weight" is used by node lin \(layer 0, stage 0\) and by node lin_1 '):
        partime.Pipeline(tm.SameTwice(), [2, 3], executor="inline")
    with pytest.raises(ValueError, match=r'"scale" is used by node mul \(layer 0, stage 0\) and by node mul_1 '):
        partime.Pipeline(tm.ScaledTwice(), [2, 3], executor="inline")


@pytest.mark.parametrize(("model", "allowed"), [(tm.TiedEnds, {(3, 2), (4, 1)}), (tm.ScaledTwice, {(4, 1)})])
def test_a_number_of_stages_cuts_where_no_tie_is_split(model, allowed):
    torch.manual_seed(0)
    net = model()
    xs = [torch.randn(1, 8) for _ in range(4)]
    with partime.Pipeline(net, 2, executor="inline", sample=xs[0]) as pipe:
        assert pipe.partition.balance in allowed
        outputs = [r.output for r in pipe.stream(xs)]
    with torch.no_grad():
        assert all(torch.equal(out, net(x)) for out, x in zip(outputs, xs, strict=True))


# --- what cannot be traced or cut -----------------------------------------------------------


def test_an_untraceable_forward_names_its_line_and_the_fix():
    with pytest.raises(TypeError) as info:
        partime.Pipeline(tm.Branchy(), 2, executor="inline")
    message = str(info.value)
    assert message.startswith("cannot trace Branchy.forward with torch.fx (traced_models.py:")
    assert "in forward: if x.sum() > 0:): TraceError: symbolically traced variables cannot be used" in message
    assert "is_leaf_module(module, name) is True for it" in message and "nn.Sequential" in message


def test_the_fix_a_leaf_traced_by_the_users_tracer():
    model = tm.Gated()
    graph_module = torch.fx.GraphModule(model, tm.GateLeaf().trace(model))
    xs = [torch.randn(1, 8) for _ in range(3)]
    with partime.Pipeline(graph_module, 2, executor="inline", sample=xs[0]) as pipe:
        assert pipe.partition.nodes == ("gate", "lin", "tanh")
        outputs = [r.output for r in pipe.stream(xs)]
        assert isinstance(pipe.module, torch.fx.GraphModule)
    with torch.no_grad():
        assert all(torch.equal(out, model(x)) for out, x in zip(outputs, xs, strict=True))


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (
            tm.ClampsItsInput,
            (
                r"node clamp_ of ClampsItsInput.forward \(traced_models.py:\d+, in forward: x.clamp_\(-1, 1\)\) "
                r"writes into its input x in place: .*x = x.add\(1\) for x.add_\(1\)"
            ),
        ),
        (tm.RelusItsInput, r"node act of RelusItsInput.forward \(.*\) writes into its input \(through getitem, a view"),
        (tm.ReturnsADict, r"ReturnsADict.forward returns a dict: partime streams outputs that are a tensor or a flat"),
        (
            tm.ReturnsAShape,
            (
                r"ReturnsAShape.forward returns node getitem \(traced_models.py:\d+, in forward: return y, y.shape\[0\]\), "
                r"a Python value"
            ),
        ),
        (nn.Linear, r"model must be an nn.Sequential, got Linear, .*wrap it: nn.Sequential\(model\)"),
    ],
)
def test_what_cannot_be_cut_is_refused_when_the_pipeline_is_made(model, match):
    net = model(8, 8) if model is nn.Linear else model()
    with pytest.raises(TypeError, match=match):
        partime.Pipeline(net, 2, executor="inline")


def test_a_value_that_is_not_a_tensor_and_would_cross_a_cut_is_named():
    xs = [torch.randn(2, 8) for _ in range(2)]
    match = (
        r"node rows \(traced_models.py:\d+, in forward: n = rows\(x\)\) gives an int, and it is used after node rows"
    )
    with pytest.raises(TypeError, match=match):
        partime.Pipeline(tm.CarriesAnInt(), 2, executor="inline", sample=xs[0])  # when the pipeline is made
    with partime.Pipeline(tm.CarriesAnInt(), [1, 3], executor="inline") as pipe:  # else at the first sample
        with pytest.raises(StageError, match=match):
            pipe.step(xs[0])


# --- in place: what Python writes into and fx does not record ---------------------------------


@pytest.mark.parametrize("balance", [1, 2, [1, 4]])
def test_an_augmented_assignment_into_a_tensor_with_another_name_is_refused(balance):
    x = torch.randn(2, 4)
    match = (
        r"node add of KeepsTheOldName.forward \(traced_models.py:\d+, in forward: a \+= self.l2\(a\)\) is an "
        r"augmented assignment \(\+=\): .* node l1 \(traced_models.py:\d+, in forward: a = self.l1\(x\)\), the "
        r"tensor it changes, is used after it by node add_1 \(traced_models.py:\d+, in forward: return "
        r"self.l3\(a\) \+ keep\)"
    )
    for sample in (x, None):
        with pytest.raises(TypeError, match=match):
            partime.Pipeline(tm.KeepsTheOldName(), balance, executor="inline", sample=sample)


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (tm.FeatureList, r"node add of FeatureList.forward \(.*y \+= self.block\(y\)\) .* node stem .* by node cat "),
        (
            tm.WritesIntoAView,
            (
                r"node mul_ of WritesIntoAView.forward \(.*a.mul_\(2\)\) writes in place into node lin .* node view "
                r"\(traced_models.py:\d+, in forward: flat = a.view\(-1\)\), which shares its memory, is used after it"
            ),
        ),
    ],
)
def test_an_in_place_write_that_another_name_would_miss_is_refused(model, match):
    with pytest.raises(TypeError, match=match):
        partime.Pipeline(model(), 2, executor="inline")


@pytest.mark.parametrize("model", [tm.InPlaceResNet, tm.ScaledQuery])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_in_place_ops_that_no_other_name_sees_pipeline_to_the_bit(model, depth):
    torch.manual_seed(0)
    net = model()
    xs = [torch.randn(1, 3, 8, 8) if model is tm.InPlaceResNet else torch.randn(1, 5, 8) for _ in range(4)]
    with partime.Pipeline(net, depth, executor="inline", threads=1, sample=xs[0]) as pipe:
        outputs = [r.output for r in pipe.stream(xs)]
    with torch.no_grad():
        assert all(torch.equal(out, net(x)) for out, x in zip(outputs, xs, strict=True))


def test_in_place_ops_that_no_other_name_sees_learn_as_the_model_does():
    torch.manual_seed(0)
    xs = [torch.randn(1, 3, 8, 8) for _ in range(5)]
    ys = [torch.randint(3, (1,)) for _ in xs]
    model, loss_fn = tm.InPlaceResNet(), nn.CrossEntropyLoss()
    plain, optimizer = copy.deepcopy(model), sgd(model.parameters())
    expected = []
    for x, y in zip(xs, ys, strict=True):
        out = model(x)
        loss = loss_fn(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append((out.detach(), loss.item()))
    kw = dict(loss_fn=loss_fn, optimizer=sgd, threads=1)
    with partime.Pipeline(plain, 1, executor="inline", sample=xs[0], **kw) as pipe:
        got = [(r.output, r.loss) for r in pipe.stream(xs, ys)]
    assert all(torch.equal(a, b) and la == lb for (a, la), (b, lb) in zip(got, expected, strict=True))
    runs = []
    for executor in ("inline", "thread", "process"):  # stages that begin with ReLU(inplace=True), out += identity
        with partime.Pipeline(plain, [2, 6, 12], executor=executor, **kw) as pipe:
            runs.append([(r.output, r.loss) for r in pipe.stream(xs, ys)])
    for run in runs[1:]:
        assert all(torch.equal(a, b) and la == lb for (a, la), (b, lb) in zip(runs[0], run, strict=True))


def test_a_traced_graph_that_computes_otherwise_than_the_forward_is_refused_on_the_sample():
    x = torch.randn(2, 4)
    model = tm.CountsItsCalls()
    layers = layers_of(model)  # traced with calls == 1: the graph multiplies by 1, the forward by 2 next
    match = (
        r"the traced graph of CountsItsCalls.forward computes other values than CountsItsCalls.forward on the "
        r"sample: its output, a \(2, 4\) torch.float32 tensor, differs by up to [\d.e+-]+\. "
    )
    with pytest.raises(TypeError, match=match):
        boundary_specs(layers, x, model)
    assert model.calls == 1  # the check ran a copy
    unet = tm.make("unet")
    assert len(boundary_specs(layers_of(unet), torch.randn(1, 3, 8, 8), unet)) == len(tm.UNET_NODES) - 1


# --- what the sample and the balance must fit ------------------------------------------------


def test_a_sample_that_does_not_fit_the_traced_forward_names_its_inputs_and_the_fix():
    x, mask = torch.randn(2, 8), torch.ones(2, 8)
    match = (
        r"the traced Masked.forward\(x, mask=None\) takes 1 input, x: give each sample as one tensor, got a tuple "
        r"of 2 \(Tensor, Tensor\)\. mask is left at its default .* to stream it too, give it no default "
        r"\(forward\(self, x, mask\)\) and each sample as a tuple \(x, mask\)"
    )
    with pytest.raises(TypeError, match=match):
        partime.Pipeline(tm.Masked(), 2, executor="inline", sample=(x, mask))
    with partime.Pipeline(tm.Masked(), 2, executor="inline") as pipe:  # timed on the first sample
        with pytest.raises(TypeError, match=match):
            pipe.step((x, mask))
    with partime.Pipeline(tm.Masked(), [1, 1], executor="inline") as pipe:  # in stage 0
        with pytest.raises(StageError, match=match):
            pipe.step((x, mask))
    two = r"the traced TwoInputs.forward\(x, y\) takes 2 inputs, x and y: give each sample as a tuple of 2 tensors"
    with pytest.raises(TypeError, match=two + r" \(x, y\), in this order, got a Tensor\.$"):
        partime.Pipeline(tm.TwoInputs(), 2, executor="inline", sample=x)
    with partime.Pipeline(tm.TwoInputs(), [1, 2], executor="inline") as pipe:
        with pytest.raises(StageError, match=two + r" \(x, y\), in this order, got a tuple of 3 \(Tensor, "):
            pipe.step((x, x, x))


UNET_LISTING = (
    "UNet: its 17 layers are the nodes of its traced graph, in order: 0 enc1, 1 relu, 2 pool, 3 enc2, 4 relu_1, "
    "5 pool_1, 6 mid, 7 relu_2, 8 up2, 9 cat, 10 dec2, 11 relu_3, 12 up1, 13 cat_1, 14 dec1, 15 relu_4, 16 head "
    "(pipe.partition.nodes names them, and pipe.partition.summary() shows them by stage, for a pipeline made with "
    "balance=[17])"
)


@pytest.mark.parametrize(
    ("balance", "start"),
    [
        ([3, 3], "balance and number of layers differ (layers: 17, sum of balance: 6, balance: [3, 3])"),
        ([17, 0], "every stage needs at least one layer, got 0 at index 1 (balance: [17, 0])"),
        (18, "cannot cut 17 layers into 18 stages: a stage needs at least one layer (balance: 18, layers: 17)"),
    ],
)
def test_a_balance_that_does_not_fit_a_traced_model_counts_and_names_its_nodes(balance, start):
    with pytest.raises(ValueError) as info:
        partime.Pipeline(tm.make("unet"), balance, executor="inline")
    assert str(info.value) == f"{start}; {UNET_LISTING}"
    with partime.Pipeline(tm.make("unet"), [17], executor="inline") as pipe:  # the way the message gives
        assert list(pipe.partition.nodes) == tm.UNET_NODES


def test_the_nodes_of_a_long_traced_model_are_listed_shortened():
    torch.manual_seed(0)
    model = tm.Transformer(layers=3)
    with pytest.raises(ValueError) as info:
        partime.Pipeline(model, [1, 1], executor="inline")
    message = str(info.value)
    assert "Transformer: its 29 layers are the nodes of its traced graph, in order: 0 embed, 1 add, " in message
    assert ", 11 layers_1_attn, ..., 17 add_4, " in message and message.count(", ") < 40
    assert "27 mean, 28 out (pipe.partition.nodes names them" in message


# --- the bench ------------------------------------------------------------------------------


def test_the_bench_sweeps_a_traced_resnet(tmp_path):
    args = ["bench", "--sizes", "8", "--samples", "5", "--rounds", "1", "--model", "resnet", "--layers", "2"]
    result = CliRunner().invoke(main, [*args, "--executor", "thread", "--json", str(tmp_path / "rows.json")])
    assert result.exit_code == 0, result.output + "".join(traceback.format_exception(*result.exc_info or ()))
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["model"] for r in rows} == {"resnet"} and "traced by torch.fx" in result.output
    # the Python floor cuts an nn.Sequential: a cut across a shortcut would hand it a tuple
    assert all(r["floor_left_out"] and "(ResNet) is traced" in r["floor_left_out"] for r in rows)
    for mode, classes in (("inference", None), ("learning", 10)):
        pipe = next(r for r in rows if r["mode"] == mode and r["contender"] == "thread D=2")
        assert len(pipe["balance"]) == 2 and pipe["speedup_vs_seq_1thread"] > 0
        assert sum(pipe["balance"]) == len(layers_of(resnet(2, 24, classes=classes)))  # the traced nodes
    refused = CliRunner().invoke(main, ["bench", "--model", "resnet"])
    assert refused.exit_code != 0 and "goes with --sizes only" in refused.output


def test_copies_leave_the_users_model_alone():
    model = tm.make("resnet")
    before = copy.deepcopy(model.state_dict())
    xs, ys = tm.samples("resnet", 3)
    with partime.Pipeline(model, 2, executor="inline", loss_fn=nn.CrossEntropyLoss(), optimizer=sgd) as pipe:
        list(pipe.stream(xs, ys))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

"""Hugging Face transformers models, as built from their configs, traced by torch.export on a
sample (partime.traced.exporting): their own outputs to the bit, learning equal to inline on every
executor, and the samples a graph traced on a sample refuses."""

import copy
import functools
import itertools
import logging

import hf_models as hf
import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import partime
from partime.planning import auto_check, planner
from partime.traced.tracing import layers_of


def even(n, depth):
    return [n // depth + (i < n % depth) for i in range(depth)]


@functools.cache
def layer_count(name, training=True):
    """How many layers the model's graph has: its dropouts are ops of it in training mode only."""
    xs, _ = hf.samples(name, 1)
    return len(layers_of(hf.make(name).train(training), xs[0]))


def learn(name, balance, executor, n=6):
    xs, ys = hf.samples(name, n)
    kw = dict(loss_fn=hf.hidden_loss, optimizer=hf.adam, threads=1, sample=xs[0])
    with partime.Pipeline(hf.make(name), balance, executor=executor, **kw) as pipe:
        results = [(r.index, tuple(r.output.values()), r.loss) for r in pipe.stream(xs, ys)]
        return results, pipe.module.state_dict()


@functools.cache
def learnt_inline(name, depth):
    return learn(name, even(layer_count(name), depth), "inline")


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("name", hf.NAMES)
def test_a_transformers_model_streams_its_own_outputs_to_the_bit(name, depth, executor):
    model = hf.make(name).eval()
    xs, _ = hf.samples(name, 4)
    balance = even(layer_count(name, training=False), depth)
    with partime.Pipeline(model, balance, executor=executor, threads=1, sample=xs[0]) as pipe:
        outputs = [r.output for r in pipe.stream(xs)]
    with torch.no_grad():
        expected = [hf.outputs_of(model, x) for x in xs]
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert type(got) is type(want) and got.keys() == want.keys(), i
        assert all(torch.equal(got[k], want[k]) for k in want), i


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("name", hf.NAMES)
def test_a_transformers_model_learns_equal_to_inline(name, depth, executor):
    inline_results, inline_state = learnt_inline(name, depth)
    results, state = learn(name, even(layer_count(name), depth), executor)
    assert [r[0] for r in results] == list(range(6))
    for (i, out_a, loss_a), (_, out_b, loss_b) in zip(inline_results, results, strict=True):
        assert loss_a == loss_b and all(torch.equal(a, b) for a, b in zip(out_a, out_b, strict=True)), i
    assert state.keys() == inline_state.keys()
    assert all(torch.equal(state[k], inline_state[k]) for k in state)
    start = hf.make(name).state_dict()
    assert sum(not torch.equal(v, start[k]) for k, v in state.items()) > len(start) // 2  # it learnt


def test_one_stage_is_plain_online_learning_with_the_models_dropout():
    model, given = hf.make("bert"), hf.make("bert")
    xs, ys = hf.samples("bert", 5)
    optimizer = hf.adam(model.parameters())
    torch.manual_seed(7)
    expected = []
    for x, y in zip(xs, ys, strict=True):
        loss = hf.hidden_loss(model(**x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    torch.manual_seed(7)
    kw = dict(
        loss_fn=hf.hidden_loss, optimizer=hf.adam, executor="inline", sample=xs[0], threads=torch.get_num_threads()
    )
    with partime.Pipeline(given, 1, **kw) as pipe:
        got = [r.loss for r in pipe.stream(xs, ys)]
        state = pipe.module.state_dict()
    assert got == expected
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_a_sample_of_other_shapes_than_traced_is_refused_naming_both():
    xs, _ = hf.samples("gpt2", 1)
    longer = {"input_ids": torch.zeros(1, hf.TOKENS + 1, dtype=torch.long)}
    with partime.Pipeline(hf.make("gpt2").eval(), 2, executor="inline", sample=xs[0]) as pipe:
        with pytest.raises(
            TypeError, match=r"traced on a sample of input_ids \(1, 8\) int64.*\(1, 9\) int64.*one Pipeline per shape"
        ):
            pipe.step(longer)
        pipe.step(xs[0])  # the refused sample used up its index
        assert pipe.fed == 2


def test_a_sample_without_the_traced_names_is_refused_naming_them():
    xs, _ = hf.samples("bert", 1)
    with partime.Pipeline(hf.make("bert").eval(), 2, executor="inline", sample=xs[0]) as pipe:
        with pytest.raises(TypeError, match=r"input_ids, attention_mask.*with \['attention_mask'\]"):
            pipe.step({"input_ids": xs[0]["input_ids"]})


def test_without_a_sample_the_error_says_to_give_one():
    with pytest.raises(TypeError, match=r"\*\*kwargs.*give the Pipeline sample="):
        partime.Pipeline(hf.make("vit"), 2, executor="inline")


class Windows(nn.Module):
    """A module of one's own that reads its input's shape in Python, and takes named arguments."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, scale):
        if x.shape[0] > 1:  # fx cannot trace this symbolically; torch.export takes the sample's branch
            x = x.flip(0)
        return {"y": self.second(torch.relu(self.first(x)) * scale), "x": x + 1}


def test_a_module_of_ones_own_with_control_flow_on_shapes_is_traced_on_its_sample():
    torch.manual_seed(0)
    model = Windows()
    xs = [{"x": torch.randn(3, 6), "scale": torch.rand(3, 1)} for _ in range(4)]
    with partime.Pipeline(model, 2, executor="process", threads=1, sample=xs[0]) as pipe:
        outputs = [r.output for r in pipe.stream(xs)]
    for got, x in zip(outputs, xs, strict=True):
        want = model(**x)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


class Masked(nn.Module):
    """A forward fx traces alone, of two named inputs."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, mask):
        return self.second(torch.relu(self.first(x)) * mask)


def test_a_module_fx_traces_alone_takes_its_inputs_by_name_too():
    torch.manual_seed(0)
    model = Masked()
    xs = [{"mask": torch.rand(3, 1), "x": torch.randn(3, 6)} for _ in range(4)]
    with partime.Pipeline(model, 2, executor="thread", threads=1, sample=xs[0]) as pipe:
        outputs = [r.output for r in pipe.stream(xs)]
        assert pipe.partition.nodes[0] == "first"  # traced by fx: the model's own modules are its nodes
        with pytest.raises(TypeError, match=r"takes x, mask: give every sample as a dict of these, with \['mask'\]"):
            pipe.step({"x": xs[0]["x"]})
    assert all(torch.equal(got, model(**x)) for got, x in zip(outputs, xs, strict=True))


class Doubling(nn.Module):
    """Control flow on the input's shape, one tensor in and one out."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 1)

    def forward(self, x):
        if x.shape[0] > 1:
            x = x * 2
        return self.second(torch.relu(self.first(x)))


def test_a_model_traced_on_its_sample_that_returns_a_tensor_streams_tensors_and_learns_as_inline():
    xs, ys = [torch.randn(3, 6) for _ in range(6)], [torch.randn(3, 1) for _ in range(6)]
    torch.manual_seed(0)
    model = Doubling()
    with partime.Pipeline(copy.deepcopy(model), 2, executor="process", threads=1, sample=xs[0]) as pipe:
        assert all(torch.equal(r.output, model(x)) for r, x in zip(pipe.stream(xs), xs, strict=True))
    runs, balance = [], even(len(layers_of(copy.deepcopy(model), xs[0])), 2)
    for executor in ("inline", "thread"):
        kw = dict(loss_fn=nn.MSELoss(), optimizer=hf.adam, sample=xs[0], executor=executor, threads=1)
        with partime.Pipeline(copy.deepcopy(model), balance, **kw) as pipe:
            runs.append([(r.output, r.loss) for r in pipe.stream(xs, ys)])
    assert all(torch.equal(a, b) and la == lb for (a, la), (b, lb) in zip(*runs, strict=True))


def test_a_dict_that_names_no_argument_of_forward_is_refused():
    with pytest.raises(TypeError, match=r"takes no argument 'pixels'"):
        partime.Pipeline(Windows(), 2, executor="inline", sample={"x": torch.zeros(3, 6), "pixels": torch.zeros(1)})


def test_the_segments_hold_the_models_own_tensors():
    model = hf.make("bert")
    xs, _ = hf.samples("bert", 1)
    layers = layers_of(model, xs[0])
    held = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    assert {id(p) for p in model.parameters()} <= held
    assert id(model.embeddings.position_ids) in held  # a buffer stays a buffer
    assert copy.deepcopy(layers)  # and they copy, as the balancer's probes do


def test_a_checkpoint_of_a_transformers_model_resumes_on_another_executor(tmp_path):
    xs, ys = hf.samples("vit", 6)
    balance = even(layer_count("vit"), 2)
    kw = dict(loss_fn=hf.hidden_loss, optimizer=hf.adam, threads=1, sample=xs[0])
    whole, whole_state = learn("vit", balance, "inline")
    with partime.Pipeline(hf.make("vit"), balance, executor="inline", **kw) as pipe:
        first = [pipe.step(x, y) for x, y in zip(xs[:3], ys[:3], strict=True)]
        pipe.save(tmp_path / "run.pt")
    with partime.Pipeline(hf.make("vit"), balance, executor="process", **kw) as pipe:
        pipe.load(tmp_path / "run.pt")
        rest = list(pipe.stream(xs[pipe.fed :], ys[pipe.fed :]))
        state = pipe.module.state_dict()
    got = [r for r in first if r is not None] + rest
    assert [(r.index, r.loss) for r in got] == [(i, loss) for i, _, loss in whole]
    assert all(
        torch.equal(a, b) for r, (_, out, _) in zip(got, whole, strict=True) for a, b in zip(r.output.values(), out)
    )
    assert all(torch.equal(state[k], whole_state[k]) for k in state)


def test_auto_learning_a_transformers_model_keeps_its_cut_and_learns_as_inline(monkeypatch):
    # a profile that makes "auto" choose two stages, and a measure that keeps them: the trial pipeline
    # of the cut runs for a few results, learning from a zero loss of the model's own output (a ModelOutput);
    # its last stage, where the loss is, runs in the caller under the thread and process executors alike
    executor = "thread"
    n = layer_count("gpt2")
    monkeypatch.setattr(planner, "profile_layers", lambda *args, **kwargs: (1.0,) * n)
    monkeypatch.setattr(planner, "usable_cores", lambda: 2)
    taken = []

    def in_turns(*runs):
        (results, _), (calls, _) = runs
        taken.extend(itertools.islice(results, 3))
        next(calls)  # the plain model, learning as a user runs it
        return 1.0, 1e9

    monkeypatch.setattr(auto_check, "in_turns", in_turns)
    xs, ys = hf.samples("gpt2", 4)
    kw = dict(loss_fn=hf.hidden_loss, optimizer=hf.adam, threads=1, sample=xs[0])
    with partime.Pipeline(hf.make("gpt2"), "auto", executor=executor, **kw) as pipe:
        balance = list(pipe.partition.balance)
        results = [(r.index, tuple(r.output.values()), r.loss) for r in pipe.stream(xs, ys)]
    assert len(balance) == 2 and [r.index for r in taken] == [0, 1, 2] and all(r.loss == 0.0 for r in taken)
    expected, _ = learn("gpt2", balance, "inline", n=4)
    for (i, out_a, loss_a), (_, out_b, loss_b) in zip(expected, results, strict=True):
        assert loss_a == loss_b and all(torch.equal(a, b) for a, b in zip(out_a, out_b, strict=True)), i


def _gpt2_lm_head():
    """GPT-2 with its language-model head, whose weight is the token embedding's (tied)."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=hf.WIDTH, n_head=2, vocab_size=hf.VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config).eval()


def test_a_tied_lm_head_that_leaves_no_useful_cut_is_warned_of_with_the_fix(monkeypatch, caplog):
    # every node of the graph takes as long: the tie keeps every cut but the one after the first node
    # (the input's view) out, which a pipeline of 2 stages gains nothing by
    model = _gpt2_lm_head()
    xs, _ = hf.samples("gpt2", 3)
    n = len(layers_of(model, xs[0]))
    monkeypatch.setattr(planner, "profile_layers", lambda *args, **kwargs: (1.0,) * n)
    with caplog.at_level(logging.WARNING, logger="partime.planning.planner"):
        with partime.Pipeline(model, 2, executor="inline", sample=xs[0]) as pipe:
            assert pipe.partition.balance == (1, n - 1)
    (warned,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned.startswith(f"balance=2: the cut [1, {n - 1}] is predicted ")
    assert f'layers 1 to {n - 1} (nodes embedding to linear) must stay in one stage ("lm_head.weight"' in warned
    assert "model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())" in warned
    # the fix: untied, it is cut in the middle, and infers as the tied model does
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="partime.planning.planner"):
        with partime.Pipeline(model, 2, executor="inline", sample=xs[0]) as pipe:
            assert abs(pipe.partition.balance[0] - n // 2) <= 1
            outputs = [r.output.logits for r in pipe.stream(xs)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    tied = _gpt2_lm_head()
    with torch.no_grad():
        assert all(torch.equal(out, tied(**x, use_cache=False).logits) for out, x in zip(outputs, xs, strict=True))

"""Damaged checkpoints: each raises a CheckpointError that names the file and what is wrong; none hangs."""

import multiprocessing
import pickle
import random
import re
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import partime
from partime import CheckpointError
from partime.checkpoint import files as checkpoint

gen = torch.Generator().manual_seed(0)
XS, YS = torch.randn(12, 4, generator=gen), torch.randn(12, 2, generator=gen)
STOP = 5
"""The checkpoint is written inside the stream loop, when result ``STOP`` is handed out."""


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def pipeline(executor="inline", seed=0, balance=(2, 1), **kw):
    balance = list(balance) if not isinstance(balance, int) else balance
    return partime.Pipeline(
        model(seed),
        balance,
        executor=executor,
        loss_fn=nn.MSELoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        threads=1,
        **kw,
    )


def real_checkpoint(path):
    """A checkpoint saved mid-stream (results held, values in transit); its state as read back."""
    with pipeline() as pipe:
        for r in pipe.stream(XS, YS):
            if r.index == STOP:
                pipe.save(path)
    return torch.load(path, weights_only=True)


def edited(tmp_path, edit):
    """``real_checkpoint`` changed by ``edit`` (which changes the state in place), saved with torch.save."""
    state = real_checkpoint(tmp_path / "real.pt")
    edit(state)
    path = tmp_path / "edited.pt"
    torch.save(state, path)
    return path


def test_the_real_checkpoint_has_all_that_the_edits_touch(tmp_path):
    state = real_checkpoint(tmp_path / "real.pt")
    assert state["counters"] == {"next_index": 8, "in_segment": 8, "taken": 6}
    assert [h["index"] for h in state["held"]] == [6]
    assert state["transit"]["tick"] == 8 and state["transit"]["acts"][1] is not None
    assert state["transit"]["grads"][0] is not None and len(state["transit"]["targets"]) == 1
    checkpoint.check_contents(state)


def counters(**values):
    return lambda state: state["counters"].update(values)


def held_twice(state):
    state["held"] = state["held"] * 2
    state["counters"]["taken"] -= 1


def remove(*keys):
    def edit(state):
        part = state
        for key in keys[:-1]:
            part = part[key]
        del part[keys[-1]]

    return edit


def put(*keys, value):
    def edit(state):
        part = state
        for key in keys[:-1]:
            part = part[key]
        part[keys[-1]] = value

    return edit


def after_the_segment(state):
    state["counters"].update(in_segment=0, taken=0)
    state["held"] = []


INCONSISTENT = {
    "taken above in_segment": (counters(taken=9), "counters.taken (9) is more than counters.in_segment (8)"),
    "in_segment above next_index": (
        counters(in_segment=9, taken=7),
        "counters.in_segment (9) is more than counters.next_index (8)",
    ),
    "a negative counter": (counters(next_index=-1), "its counters.next_index is -1 (int), not a whole number >= 0"),
    "a counter not a whole number": (counters(taken=6.0), "its counters.taken is 6.0 (float), not a whole number"),
    "a counter that is a bool": (counters(taken=True), "its counters.taken is True (bool), not a whole number"),
    "taken above the results out": (
        counters(taken=8),
        (
            "counters.taken (8) is more than the results that left the "
            "pipeline in this segment: max(0, in_segment 8 - (depth 2 - 1)) = 7"
        ),
    ),
    "more held than left the pipeline": (
        counters(taken=7),
        (
            "len(held) is 1, but the counters say 0 results left "
            "the pipeline and were not handed out: max(0, in_segment 8 - (depth 2 - 1)) "
            "- taken 7 = 0"
        ),
    ),
    "fewer held than left the pipeline": (counters(taken=5), "len(held) is 1, but the counters say 2 results"),
    "held emptied": (put("held", value=[]), "len(held) is 0, but the counters say 1 results"),
    "held out of order": (
        held_twice,
        ("held[1].index is 6: held results must come in increasing sample order (the one before is 6)"),
    ),
    "held beyond the samples fed": (put("held", 0, "index", value=8), "held[0].index is 8"),
    "held output not tensors": (
        put("held", 0, "output", value=[1.0]),
        "its held[0].output is [1.0] (list), not None or a list of tensors",
    ),
    "transit of another tick": (
        counters(next_index=9, in_segment=9, taken=7),
        "transit.tick is 8, but counters.in_segment is 9",
    ),
    "nothing in transit mid-segment": (
        put("transit", value=None),
        "nothing is in transit, but counters.in_segment is 8",
    ),
    "transit after the segment": (after_the_segment, "values are in transit, but counters.in_segment is 0"),
    "acts of one stage": (lambda s: s["transit"]["acts"].pop(), "len(transit.acts) is 1, not one per stage (2)"),
    "grads of three stages": (
        lambda s: s["transit"]["grads"].append(None),
        "len(transit.grads) is 3, not one per stage (2)",
    ),
    "an activation of a sample not fed": (
        put("transit", "acts", 1, "sample", value=99),
        ("transit.acts[1].sample is 99, but only samples before counters.next_index (8) were fed"),
    ),
    "a target without tensors": (
        put("transit", "targets", 0, "tensors", value=None),
        "its transit.targets[0].tensors is None (NoneType), not a list of tensors",
    ),
    "one stage state for two stages": (lambda s: s["stages"].pop(), "len(stages) is 1, but identity.depth is 2"),
    "stage without weights": (remove("stages", 1, "module"), "it has no stages[1].module"),
    "no layout mid-segment": (
        put("layout", value=None),
        "its layout is None, as before the first sample, but counters.in_segment is 8",
    ),
    "a layout without tensors": (
        put("layout", "output", value={"tensors": [], "is_tuple": False}),
        "its layout.output is {'tensors': [], 'is_tuple': False}, not a layout",
    ),
    "a layout of an unknown dtype": (
        put("layout", "input", value={"tensors": [[[4], "load"]], "is_tuple": False}),
        "its layout.input is",
    ),
    "activations of three boundaries": (
        lambda s: s["layout"]["activations"].append(None),
        "len(layout.activations) is 2, not depth - 1 = 1",
    ),
    "counters a list": (put("counters", value=[8, 8, 6]), "its counters is [8, 8, 6] (list), not a dict"),
    "held a dict": (put("held", value={}), "its held is {} (dict), not a list"),
    "no depth": (remove("identity", "depth"), "it has no identity.depth"),
    "a balance of another depth": (
        put("identity", "balance", value=[3]),
        "its identity.balance [3] is not 2 positive whole numbers",
    ),
    **{
        f"no {key}": (remove(key), f"it has no {key}")
        for key in ("identity", "counters", "layout", "held", "stages", "transit")
    },
    "no counters.taken": (remove("counters", "taken"), "it has no counters.taken"),
    "an activation of another shape": (
        put("transit", "acts", 1, "tensors", value=[torch.zeros(1, 5)]),
        "transit.acts[1] holds tensors of [[[1, 5], 'float32']] ([shape, dtype] each), but layout.activations[0] is",
    ),
    "an activation sent to stage 0": (
        put("transit", "acts", 0, value={"sample": 0, "tensors": [torch.zeros(1, 4)]}),
        "transit.acts[0] holds tensors of [[[1, 4], 'float32']], but stage 0 is sent no activation",
    ),
    "a gradient sent to the last stage": (
        put("transit", "grads", 1, value={"sample": 0, "tensors": [torch.zeros(1, 2)]}),
        "transit.grads[1] holds tensors of [[[1, 2], 'float32']], but the last stage is sent no gradient",
    ),
    "a held output of another dtype": (
        lambda s: s["held"][0].update(output=[t.double() for t in s["held"][0]["output"]]),
        "'float64']] ([shape, dtype] each), but layout.output is",
    ),
    "a target of another shape": (
        put("transit", "targets", 0, "tensors", value=[torch.zeros(7)]),
        "transit.targets[0] holds tensors of [[[7], 'float32']] ([shape, dtype] each), but identity.target is",
    ),
    "targets given without a target layout": (
        put("identity", "target", value=None),
        "targets given (given), but no identity.target to read them by",
    ),
    "no transit.tick": (remove("transit", "tick"), "it has no transit.tick"),
}


@pytest.mark.parametrize("case", INCONSISTENT)
def test_an_inconsistent_checkpoint_is_refused_at_load_naming_the_file_and_the_values(tmp_path, case):
    edit, problem = INCONSISTENT[case]
    path = edited(tmp_path, edit)
    with pytest.raises(CheckpointError) as raised:
        checkpoint.load(path)
    assert str(path) in str(raised.value) and problem in str(raised.value)
    with pipeline(balance=2) as pipe:
        with pytest.raises(CheckpointError) as raised:
            pipe.load(path)
        assert str(raised.value).startswith(f"{path}: damaged checkpoint: ")
        assert problem in str(raised.value)
        assert pipe.fed == 0 and pipe.partition is None  # nothing of the pipeline changed
        with pytest.raises(CheckpointError, match="damaged checkpoint") as raised:
            pipe.load_state_dict(torch.load(path, weights_only=True))  # in memory: no file to name
        assert problem in str(raised.value) and str(path) not in str(raised.value)


def test_a_missing_identity_entry_is_named(tmp_path):
    path = edited(tmp_path, remove("identity", "grad_mode"))
    checkpoint.load(path)  # what the file alone says agrees; the pipeline compares its grad mode
    with pipeline() as pipe, pytest.raises(CheckpointError, match="it has no identity.grad_mode") as raised:
        pipe.load(path)
    assert str(raised.value).startswith(f"{path}: ")


def test_a_cut_that_does_not_fit_the_model_is_refused_before_anything_changes(tmp_path):
    path = edited(tmp_path, put("identity", "balance", value=[1, 1]))  # 2 layers; the model has 3
    with pipeline(balance=2) as pipe:
        with pytest.raises(CheckpointError, match="cut does not fit this model") as raised:
            pipe.load(path)
        assert str(raised.value).startswith(f"{path}: ") and isinstance(raised.value.__cause__, ValueError)
        assert pipe.partition is None
        assert [r.index for r in pipe.stream(XS[:3], YS[:3])] == [0, 1, 2]


def test_a_checkpoint_refused_by_a_fresh_pipeline_leaves_its_weights_as_they_were(tmp_path):
    path = edited(tmp_path, put("identity", "target", value=None))  # what a fresh pipeline cannot compare
    with pipeline(seed=1) as pipe:
        before = [p.detach().clone() for p in pipe.module.parameters()]
        with pytest.raises(CheckpointError, match=r"it has \d+ targets given.* but no identity.target"):
            pipe.load_state_dict(torch.load(path, weights_only=True))
        assert all(torch.equal(p, q) for p, q in zip(pipe.module.parameters(), before, strict=True))
        assert pipe.fed == 0 and pipe.partition.balance == (2, 1)


def test_a_refused_checkpoint_leaves_a_running_pipeline_as_it_was(tmp_path):
    path = edited(tmp_path, counters(taken=5))
    with pipeline() as pipe:
        reference = [(r.output, r.loss) for r in pipe.stream(XS, YS)]
    with pipeline() as pipe:
        results = []
        for r in pipe.stream(XS, YS):
            results.append((r.output, r.loss))
            if r.index == 3:
                with pytest.raises(CheckpointError, match=re.escape("len(held) is 1, but the counters say 2 results")):
                    pipe.load(path)
    assert len(results) == len(reference)
    for (out, loss), (out_ref, loss_ref) in zip(results, reference):
        assert torch.equal(out, out_ref) and loss == loss_ref


def test_an_inconsistent_checkpoint_is_refused_by_a_process_pipeline_before_workers_start(tmp_path):
    # Loaded, this checkpoint would leave a process pipeline waiting forever for a result that no
    # worker will send again (it left the pipeline before the checkpoint was taken).
    path = edited(tmp_path, put("held", value=[]))
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pipeline("process") as pipe:
        with pytest.raises(
            CheckpointError, match=re.escape("len(held) is 0, but the counters say 1 results")
        ) as raised:
            pipe.load(path)
        assert str(raised.value).startswith(f"{path}: ")
        assert set(multiprocessing.active_children()) <= before  # no worker was started
    assert time.monotonic() - start < 5


# -- files that are no checkpoint -------------------------------------------------------------------


class Touches:
    """Pickles as a call of ``Path.touch``: what a tampered file could make ``torch.load`` run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def truncated(tmp_path):
    data = (tmp_path / "real.pt").read_bytes()
    (tmp_path / "c.pt").write_bytes(data[: len(data) // 2])


def empty(tmp_path):
    (tmp_path / "c.pt").write_bytes(b"")


def random_bytes(tmp_path):
    (tmp_path / "c.pt").write_bytes(random.Random(0).randbytes(4096))


def a_plain_pickle(tmp_path):
    (tmp_path / "c.pt").write_bytes(pickle.dumps({"format": "partime-checkpoint"}, protocol=2))


def a_tensor(tmp_path):
    torch.save(torch.ones(3), tmp_path / "c.pt")


def a_dict_of_weights(tmp_path):
    torch.save(model().state_dict(), tmp_path / "c.pt")


def another_version(tmp_path):
    torch.save(dict(torch.load(tmp_path / "real.pt", weights_only=True), version=99), tmp_path / "c.pt")


def tampered(tmp_path):
    state = torch.load(tmp_path / "real.pt", weights_only=True)
    state["held"][0]["loss"] = Touches(tmp_path / "ran")
    torch.save(state, tmp_path / "c.pt")


def a_directory(tmp_path):
    (tmp_path / "c.pt").mkdir()


NOT_CHECKPOINTS = {
    # torch's zip reader raises one or the other, by where the cut falls
    "truncated": (truncated, (RuntimeError, OSError), "not a readable partime checkpoint ("),
    "empty": (empty, EOFError, "not a readable partime checkpoint (EOFError: the file is empty or ends early"),
    "random bytes": (random_bytes, pickle.UnpicklingError, "not a readable partime checkpoint (UnpicklingError: "),
    "a plain pickle": (a_plain_pickle, RuntimeError, "not a readable partime checkpoint"),
    "a tensor": (a_tensor, None, "not a partime checkpoint (no 'format': 'partime-checkpoint' in it)"),
    "a dict of weights": (a_dict_of_weights, None, "not a partime checkpoint"),
    "another version": (another_version, None, "checkpoint format version 99 cannot be read"),
    "tampered": (
        tampered,
        pickle.UnpicklingError,
        "not a readable partime checkpoint (UnpicklingError: torch.load(weights_only=True) refused it: ",
    ),
    "a directory": (a_directory, IsADirectoryError, "not a readable partime checkpoint (IsADirectoryError: "),
}


@pytest.mark.parametrize("case", NOT_CHECKPOINTS)
def test_a_file_that_is_no_checkpoint_is_refused_naming_it(tmp_path, case):
    make, cause, problem = NOT_CHECKPOINTS[case]
    real_checkpoint(tmp_path / "real.pt")
    make(tmp_path)
    path = tmp_path / "c.pt"
    with pytest.raises(CheckpointError) as raised:
        checkpoint.load(path)
    assert str(raised.value).startswith(f"{path}: ") and problem in str(raised.value), str(raised.value)
    if cause is None:
        assert raised.value.__cause__ is None
    else:
        assert isinstance(raised.value.__cause__, cause)
    with pipeline() as pipe:
        with pytest.raises(CheckpointError) as raised:
            pipe.load(path)
        assert str(raised.value).startswith(f"{path}: ") and problem in str(raised.value)
    assert not (tmp_path / "ran").exists()  # a tampered file runs nothing


def test_a_tampered_file_says_it_needs_no_unsafe_load(tmp_path):
    real_checkpoint(tmp_path / "real.pt")
    tampered(tmp_path)
    with pytest.raises(CheckpointError, match="every partime checkpoint loads with weights_only=True") as raised:
        checkpoint.load(tmp_path / "c.pt")
    assert "GLOBAL" in str(raised.value)  # torch's reason
    assert "weights_only` set to `False`" not in str(raised.value)  # torch's advice does not apply


def test_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        checkpoint.load(tmp_path / "nothing.pt")
    with pipeline() as pipe, pytest.raises(FileNotFoundError):
        pipe.load(tmp_path / "nothing.pt")


# -- what the library writes passes -----------------------------------------------------------------


@pytest.mark.parametrize("learns", [True, False], ids=["learning", "inference"])
@pytest.mark.parametrize("balance", [[3], [2, 1], [1, 1, 1]], ids=["D=1", "D=2", "D=3"])
def test_every_checkpoint_the_pipeline_writes_passes_the_checks(balance, learns):
    # At every tick of two segments, by step and inside a stream, with skipped samples (holes) in flight.
    xs = XS.clone()
    xs[2, 0] = float("nan")
    xs[9, 1] = float("inf")
    ys = YS if learns else [None] * len(xs)

    def make():
        return partime.Pipeline(
            model(),
            balance,
            executor="inline",
            nonfinite="skip",
            threads=1,
            loss_fn=nn.MSELoss() if learns else None,
            optimizer=(lambda p: torch.optim.SGD(p, lr=0.1)) if learns else None,
        )

    states = []
    with make() as pipe:
        states.append(pipe.state_dict())  # before the first sample
        for i in range(6):
            pipe.step(xs[i], ys[i])
            states.append(pipe.state_dict())
        pipe.flush()
        states.append(pipe.state_dict())
        for _ in pipe.stream(xs[6:], YS[6:] if learns else None):
            states.append(pipe.state_dict())
        states.append(pipe.state_dict())
    assert any(s["held"] for s in states) and any(s["transit"] for s in states)
    for state in states:
        checkpoint.check_contents(state)
        checkpoint.check_contents(checkpoint.from_bytes(checkpoint.to_bytes(state)))
        with make() as pipe:
            pipe.load_state_dict(state)

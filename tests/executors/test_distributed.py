"""The distributed executor against the inline reference, with 2 and 3 ranks on localhost (gloo).

Each test starts its ranks as processes running this file (with the environment torchrun gives:
MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), listening on 127.0.0.1 only; rank 0
saves what it saw, and the test compares it with the inline executor run here. Every rank is
always reaped.
"""

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import hf_models
import pytest
import torch
import torch.distributed as dist
import traced_models
from models import (
    CONV_BALANCES,
    Join,
    Pair,
    classification_stream,
    conv_net,
    mlp,
    nonfinite_stream,
    reconstruction_loss,
    scaled_loss,
    strided_frames,
)
from torch import nn

import partime

BALANCES = {2: [3, 4], 3: [2, 3, 2]}
TUPLE_BALANCES = {2: [2, 2], 3: [2, 1, 1]}  # the first boundary carries a tuple
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "plain": lambda params: torch.optim.SGD(params, lr=0.05),
}
LEARNING = {  # every grad mode, each with its own optimizer
    "partime": "sgd",
    "stash": "adam",
    "weight-stash": "sgd",
    "graph-stash": "plain",  # no weight prediction: the kept graph itself is under test
}
COMPENSATED = dict(
    loss_fn=nn.CrossEntropyLoss(),
    optimizer=OPTIMIZERS["sgd"],
    grad_mode="partime",
    compensation=("lr-scale", "weight-prediction", "delay-correction"),
)
OPTIMIZER_AWARE = dict(
    loss_fn=nn.CrossEntropyLoss(),
    optimizer=OPTIMIZERS["adam"],
    grad_mode="stash",
    compensation=("optimizer-prediction", "long-momentum", "spike"),
)
SAMPLES = 40
FAIL_AT = 13
RUNNING_AT = 100  # the sample after which the endless scenario says it runs
STOP = 17  # a checkpoint is taken after this many steps, in the middle of the segment
CHECKPOINTED = [None, *LEARNING]  # inference, and learning in each grad mode


def tuple_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 5), Pair(), Join(), nn.Linear(10, 4))


def frozen(model, *layers):
    """``model`` with the parameters of its ``layers`` frozen."""
    for k in layers:
        model[k].requires_grad_(False)
    return model


def adamw_by_name(named):
    """Weight decay on the weights alone, chosen by the parameters' names."""
    named = list(named)
    decayed = [p for n, p in named if n.endswith("weight")]
    return torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": [p for n, p in named if not n.endswith("weight")]}],
        lr=1e-2,
    )


FROZEN = {"head only": (0, 2, 4), "middle frozen": (2, 4)}  # mlp()'s layers frozen in each


def learning(grad_mode):
    return dict(loss_fn=nn.CrossEntropyLoss(), optimizer=OPTIMIZERS[LEARNING[grad_mode]], grad_mode=grad_mode)


def run(executor, model, balance, xs, ys=None, **kw):
    """Stream ``xs``: the results and the trained model (rank 0), or nothing (ranks > 0)."""
    with partime.Pipeline(model, balance, executor=executor, threads=1, **kw) as pipe:
        results = [(r.index, r.output, r.loss) for r in pipe.stream(xs, ys)]
        return results, [p.detach().clone() for p in pipe.module.parameters()], pipe.partition


def transformers_run(executor, balance):
    """A transformers GPT-2 learning from its named inputs: each result as (index, the tensors of its
    ModelOutput, loss), the trained weights, and the partition (rank 0)."""
    xs, ys = hf_models.samples("gpt2", SAMPLES // 4)
    kw = dict(loss_fn=hf_models.hidden_loss, optimizer=hf_models.adam, sample=xs[0])
    with partime.Pipeline(hf_models.make("gpt2"), balance, executor=executor, threads=1, **kw) as pipe:
        results = [(r.index, tuple(r.output.values()), r.loss) for r in pipe.stream(xs, ys)]
        return results, [p.detach().clone() for p in pipe.module.parameters()], pipe.partition


def skipping(executor, depth, grad_mode=None):
    """A stream with holes (NaN inputs) and, when learning, infinite losses, under ``nonfinite="skip"``:
    each result as (index, output, loss, skipped), and the trained weights (rank 0)."""
    xs, ys = nonfinite_stream(SAMPLES, holes=(0, 7, 8, 21, 39), infinite=(3, 8, 12, 13, 38) if grad_mode else ())
    kw = dict(loss_fn=scaled_loss, optimizer=OPTIMIZERS["sgd"], grad_mode=grad_mode) if grad_mode else {}
    with partime.Pipeline(mlp(), BALANCES[depth], executor=executor, threads=1, nonfinite="skip", **kw) as pipe:
        results = [(r.index, r.output, r.loss, r.skipped) for r in pipe.stream(xs, ys if grad_mode else None)]
        return results, [p.detach().clone() for p in pipe.module.parameters()]


def play(pipe, samples, xs, ys):
    """Step through ``samples``: the results that came out, as (index, output, loss)."""
    results = [pipe.step(xs[s], None if ys is None else ys[s]) for s in samples]
    return [(r.index, r.output, r.loss) for r in results if r is not None]


def stopped(executor, depth, grad_mode, path):
    """Run the first ``STOP`` samples and save a checkpoint to ``path``: the results."""
    xs, ys = classification_stream(SAMPLES)
    kw = learning(grad_mode) if grad_mode else {}
    with partime.Pipeline(mlp(), BALANCES[depth], executor=executor, threads=1, **kw) as pipe:
        results = play(pipe, range(STOP), xs, ys if grad_mode else None)
        pipe.save(path)
        return results


def resumed(executor, depth, grad_mode, path):
    """Load the checkpoint in ``path`` into a pipeline with other weights and run the rest of the
    stream: the results and the trained weights."""
    xs, ys = classification_stream(SAMPLES)
    kw = learning(grad_mode) if grad_mode else {}
    with partime.Pipeline(mlp(seed=1), BALANCES[depth], executor=executor, threads=1, **kw) as pipe:
        pipe.load(path)
        results = play(pipe, range(pipe.fed, SAMPLES), xs, ys if grad_mode else None)
        results += [(r.index, r.output, r.loss) for r in pipe.flush()]
        return results, [p.detach().clone() for p in pipe.module.parameters()]


LEARNT = [not (s % 4 == 2 or s in (5, 6, 15)) for s in range(SAMPLES)]  # the others are only predicted
STOP_PREDICTING = 16  # predicted activations (15, and 14 at D = 3) and skipped gradients are in transit


def predicting(executor, depth, grad_mode):
    """A stream in which the samples not ``LEARNT`` are only predicted: each result as (index,
    output, loss, predicted), and the trained weights (rank 0)."""
    xs, ys = classification_stream(SAMPLES)
    with partime.Pipeline(mlp(), BALANCES[depth], executor=executor, threads=1, **learning(grad_mode)) as pipe:
        results = [(r.index, r.output, r.loss, r.predicted) for r in pipe.stream(xs, ys, learn=LEARNT)]
        return results, [p.detach().clone() for p in pipe.module.parameters()]


def predicting_resumed(executor, depth, path):
    """``predicting`` in ``stash`` mode, stopped after ``STOP_PREDICTING`` steps, saved to ``path``
    and resumed in a new pipeline."""
    xs, ys = classification_stream(SAMPLES)

    def steps(pipe, samples):
        results = [pipe.step(xs[s], ys[s], learn=LEARNT[s]) for s in samples]
        return [(r.index, r.output, r.loss, r.predicted) for r in results if r is not None]

    with partime.Pipeline(mlp(), BALANCES[depth], executor=executor, threads=1, **learning("stash")) as pipe:
        results = steps(pipe, range(STOP_PREDICTING))
        pipe.save(path)
    with partime.Pipeline(mlp(seed=1), BALANCES[depth], executor=executor, threads=1, **learning("stash")) as pipe:
        pipe.load(path)
        results += steps(pipe, range(pipe.fed, SAMPLES))
        results += [(r.index, r.output, r.loss, r.predicted) for r in pipe.flush()]
        return results, [p.detach().clone() for p in pipe.module.parameters()]


def trace(executor, depth):
    """Steps, two flushes and the weights read between ticks, as the caller sees them."""
    xs, ys = classification_stream(SAMPLES)
    seen = []
    with partime.Pipeline(mlp(), BALANCES[depth], executor=executor, threads=1, **learning("stash")) as pipe:
        for i in range(25):
            r = pipe.step(xs[i], ys[i])
            seen.append(None if r is None else (r.index, r.loss))
            if i in (4, 17):
                seen.append([p.detach().clone() for p in pipe.module.parameters()])
        seen.append([(r.index, r.loss) for r in pipe.flush()])
        for i in range(25, SAMPLES):  # a second segment
            r = pipe.step(xs[i], ys[i])
            seen.append(None if r is None else (r.index, r.loss))
        seen.append([(r.index, r.loss) for r in pipe.flush()])
        seen.append([p.detach().clone() for p in pipe.module.parameters()])
    return seen


# -- what each rank runs -------------------------------------------------------------------------


class Boom(nn.Module):
    """Raises at the forward of sample ``at`` (inference: one forward per sample), noting the time."""

    def __init__(self, at, out):
        super().__init__()
        self.at, self.out, self.calls = at, out, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at + 1:
            Path(self.out, "failed_at").write_text(repr(time.time()))
            raise RuntimeError("boom")
        return x


class Vanish(Boom):
    """Ends its process without a word at the forward of sample ``at``."""

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at + 1:
            Path(self.out, "failed_at").write_text(repr(time.time()))
            os._exit(9)
        return x


def join_on_localhost(depth, rank):
    """The process group torchrun's environment describes, with every port on 127.0.0.1 (its
    env:// start would listen on every interface; gloo keeps to GLOO_SOCKET_IFNAME=lo)."""
    port, listening = int(os.environ["MASTER_PORT"]), None
    if rank == 0:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
        listening = sock.detach()  # the store's from now on
    store = dist.TCPStore("127.0.0.1", port, depth, rank == 0, master_listen_fd=listening, use_libuv=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=depth)


def rank_main(scenario, out):
    depth, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    join_on_localhost(depth, rank)
    torch.set_num_threads(1)
    xs, ys = classification_stream(SAMPLES)
    if scenario == "compare":
        seen = {"inference": run("distributed", mlp(), BALANCES[depth], xs)}
        seen["balanced"] = run("distributed", mlp(), depth, xs, sample=xs[0] if rank == 0 else None)
        for grad_mode in LEARNING:
            seen[grad_mode] = run("distributed", mlp(), BALANCES[depth], xs, ys, **learning(grad_mode))
        seen["compensated"] = run("distributed", mlp(), BALANCES[depth], xs, ys, **COMPENSATED)
        seen["optimizer-aware"] = run("distributed", mlp(), BALANCES[depth], xs, ys, **OPTIMIZER_AWARE)
        for name, layers in FROZEN.items():
            kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=adamw_by_name)
            seen[name] = run("distributed", frozen(mlp(), *layers), BALANCES[depth], xs, ys, **kw)
        seen["tuple"] = run(
            "distributed",
            tuple_model(),
            TUPLE_BALANCES[depth],
            xs,
            loss_fn=reconstruction_loss,
            optimizer=OPTIMIZERS["sgd"],
            grad_mode="weight-stash",
        )
        seen["trace"] = trace("distributed", depth)
        strided_xs, strided_ys = strided_frames(SAMPLES)
        seen["strided"] = run(
            "distributed", conv_net(), CONV_BALANCES[depth], strided_xs, strided_ys, **learning("stash")
        )
        seen["skip inference"] = skipping("distributed", depth)
        traced_xs, traced_ys = traced_models.samples("resnet", SAMPLES)
        seen["traced"] = run(  # any module: a ResNet, traced and cut between its nodes
            "distributed",
            traced_models.make("resnet"),
            depth,
            traced_xs,
            traced_ys,
            sample=traced_xs[0] if rank == 0 else None,
            **learning("stash"),
        )
        seen["transformers"] = transformers_run("distributed", depth)  # every rank traces it on the sample
        for grad_mode in LEARNING:
            seen[f"skip {grad_mode}"] = skipping("distributed", depth, grad_mode)
        if rank == 0:
            torch.save(seen, Path(out, "seen.pt"))
    elif scenario == "checkpoint":
        seen = {}
        for grad_mode in CHECKPOINTED:
            name = grad_mode or "inference"
            first = stopped("distributed", depth, grad_mode, Path(out, f"{name}.pt"))
            rest, params = resumed("distributed", depth, grad_mode, Path(out, f"{name}.pt"))
            seen[name] = first + rest, params
            if rank == 0:
                stopped("inline", depth, grad_mode, Path(out, f"{name} inline.pt"))
                stopped("thread", depth, grad_mode, Path(out, f"{name} thread.pt"))
            seen[f"{name} from inline"] = resumed("distributed", depth, grad_mode, Path(out, f"{name} inline.pt"))
            seen[f"{name} from thread"] = resumed("distributed", depth, grad_mode, Path(out, f"{name} thread.pt"))
        if rank == 0:
            torch.save(seen, Path(out, "seen.pt"))
    elif scenario == "predict":
        seen = {grad_mode: predicting("distributed", depth, grad_mode) for grad_mode in LEARNING}
        seen["resumed"] = predicting_resumed("distributed", depth, Path(out, "predicting.pt"))
        if rank == 0:
            torch.save(seen, Path(out, "seen.pt"))
    elif scenario == "endless":  # learns until the test stops it (it kills a rank)
        with partime.Pipeline(mlp(), BALANCES[depth], executor="distributed", threads=1, **learning("stash")) as pipe:
            for result in pipe.stream(itertools.cycle(xs), itertools.cycle(ys)):
                if result.index == RUNNING_AT:
                    print("running", flush=True)
    elif scenario == "mismatch":  # rank 1 was given another model
        run("distributed", mlp(width=9 if rank == 1 else 8), BALANCES[depth], xs)
    else:  # a stage fails: at the start of stage 1 (raise), or of stage 2 (vanish)
        layers = list(mlp())
        if scenario == "raise":
            model, balance = nn.Sequential(*layers[:2], Boom(FAIL_AT, out), *layers[2:]), [2, 3, 3]
        else:
            model, balance = nn.Sequential(*layers[:4], Vanish(FAIL_AT, out), *layers[4:]), [2, 2, 4]
        run("distributed", model, balance, xs)


# -- the tests -----------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(out, depth, scenario, script=__file__):
    """Start ``scenario`` of ``script`` (None: the script's only one) on ``depth`` ranks: their
    processes, and the paths of their logs."""
    port = _free_port()
    procs, logs = [], []
    for rank in range(depth):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(depth),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(depth),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        )
        logs.append(Path(out, f"rank{rank}.log"))
        with open(logs[-1], "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *([scenario] if scenario else []), str(out)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs, logs


def reap(procs):
    """Kill the ranks that still run, and wait for every one."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def launch(out, depth, scenario, timeout=90.0):
    """Run ``scenario`` on ``depth`` ranks; each rank's exit code, exit time and log."""
    procs, logs = start_ranks(out, depth, scenario)
    ended = [None] * depth
    deadline = time.monotonic() + timeout
    try:
        while None in ended and time.monotonic() < deadline:
            for rank, proc in enumerate(procs):
                if ended[rank] is None and proc.poll() is not None:
                    ended[rank] = time.time()
            time.sleep(0.05)
    finally:
        reap(procs)
    return [p.returncode for p in procs], ended, [log.read_text() for log in logs]


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request, tmp_path_factory):
    """What rank 0 saw, with ``request.param`` ranks."""
    depth = request.param
    out = tmp_path_factory.mktemp(f"ranks{depth}")
    codes, _, logs = launch(out, depth, "compare")
    assert codes == [0] * depth, "\n\n".join(logs)
    return depth, torch.load(Path(out, "seen.pt"), weights_only=False)


def assert_same(a, b):
    (results_a, params_a, _), (results_b, params_b, _) = a, b
    assert [r[0] for r in results_a] == [r[0] for r in results_b] == list(range(SAMPLES))
    for (i, out_a, loss_a), (_, out_b, loss_b) in zip(results_a, results_b):
        assert torch.equal(out_a, out_b), i
        assert loss_a == loss_b, i
    for p, q in zip(params_a, params_b, strict=True):
        assert torch.equal(p, q)


def test_inference_matches_inline_and_the_model(ranks):
    depth, seen = ranks
    xs, _ = classification_stream(SAMPLES)
    assert_same(seen["inference"], run("inline", mlp(), BALANCES[depth], xs))
    results, _params, partition = seen["balanced"]  # cut by timing on rank 0, the cut sent to every rank
    assert partition.depth == depth
    model = mlp()
    with torch.no_grad():
        for (i, out, _), x in zip(results, xs, strict=True):
            assert torch.equal(out, model(x)), i


@pytest.mark.parametrize("grad_mode", list(LEARNING))
def test_learning_matches_inline(ranks, grad_mode):
    depth, seen = ranks
    xs, ys = classification_stream(SAMPLES)
    assert_same(seen[grad_mode], run("inline", mlp(), BALANCES[depth], xs, ys, **learning(grad_mode)))
    assert not torch.equal(seen[grad_mode][1][0], next(mlp().parameters()))  # it learnt


@pytest.mark.parametrize("name", list(FROZEN))
def test_frozen_layers_and_parameter_groups_by_name_learn_as_inline_does(ranks, name):
    depth, seen = ranks
    xs, ys = classification_stream(SAMPLES)
    kw = dict(loss_fn=nn.CrossEntropyLoss(), optimizer=adamw_by_name)
    assert_same(seen[name], run("inline", frozen(mlp(), *FROZEN[name]), BALANCES[depth], xs, ys, **kw))
    assert torch.equal(seen[name][1][4], mlp()[4].weight)  # a frozen layer stays as it was


def test_staleness_compensation_matches_inline(ranks):
    depth, seen = ranks
    xs, ys = classification_stream(SAMPLES)
    assert_same(seen["compensated"], run("inline", mlp(), BALANCES[depth], xs, ys, **COMPENSATED))


def test_optimizer_aware_compensation_matches_inline(ranks):
    depth, seen = ranks
    xs, ys = classification_stream(SAMPLES)
    assert_same(seen["optimizer-aware"], run("inline", mlp(), BALANCES[depth], xs, ys, **OPTIMIZER_AWARE))


def test_strided_samples_give_the_bits_of_inline(ranks):
    depth, seen = ranks
    xs, ys = strided_frames(SAMPLES)
    assert_same(seen["strided"], run("inline", conv_net(), CONV_BALANCES[depth], xs, ys, **learning("stash")))


def test_a_traced_module_learns_as_inline_does(ranks):
    depth, seen = ranks
    results, params, partition = seen["traced"]
    assert partition.depth == depth
    xs, ys = traced_models.samples("resnet", SAMPLES)
    inline = run("inline", traced_models.make("resnet"), list(partition.balance), xs, ys, **learning("stash"))
    assert_same((results, params, partition), inline)


def test_a_transformers_model_learns_as_inline_does(ranks):
    depth, seen = ranks
    results, params, partition = seen["transformers"]
    assert partition.depth == depth and len(results) == SAMPLES // 4
    inline = transformers_run("inline", list(partition.balance))
    for (i, out_a, loss_a), (_, out_b, loss_b) in zip(results, inline[0], strict=True):
        assert loss_a == loss_b and all(torch.equal(a, b) for a, b in zip(out_a, out_b, strict=True)), i
    assert all(torch.equal(p, q) for p, q in zip(params, inline[1], strict=True))


def test_tuple_activations_and_unsupervised_loss_match_inline(ranks):
    depth, seen = ranks
    xs, _ = classification_stream(SAMPLES)
    kw = dict(loss_fn=reconstruction_loss, optimizer=OPTIMIZERS["sgd"], grad_mode="weight-stash")
    assert_same(seen["tuple"], run("inline", tuple_model(), TUPLE_BALANCES[depth], xs, **kw))


def test_steps_flushes_and_weights_between_ticks_match_inline(ranks):
    depth, seen = ranks
    for a, b in zip(seen["trace"], trace("inline", depth), strict=True):
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        else:
            assert a == b


@pytest.mark.parametrize("grad_mode", [None, *LEARNING])
def test_skipped_samples_match_inline(ranks, grad_mode):
    depth, seen = ranks
    results, params = seen[f"skip {grad_mode or 'inference'}"]
    expected, expected_params = skipping("inline", depth, grad_mode)
    assert [r[0] for r in results] == list(range(SAMPLES))
    assert sum(r[3] for r in results) == (9 if grad_mode else 5)
    for (i, out, loss, skipped), (_, out_e, loss_e, skipped_e) in zip(results, expected, strict=True):
        assert (skipped, loss) == (skipped_e, loss_e), i
        assert (out is None and out_e is None) or torch.equal(out, out_e), i
    assert all(torch.equal(p, q) for p, q in zip(params, expected_params, strict=True))
    if grad_mode:
        assert not torch.equal(params[0], next(mlp().parameters()))  # it learnt


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def predictions(request, tmp_path_factory):
    """What rank 0 saw of streams with samples only predicted, with ``request.param`` ranks."""
    depth = request.param
    out = tmp_path_factory.mktemp(f"predictions{depth}")
    codes, _, logs = launch(out, depth, "predict")
    assert codes == [0] * depth, "\n\n".join(logs)
    return depth, torch.load(Path(out, "seen.pt"), weights_only=False)


def assert_same_predictions(a, b):
    (results_a, params_a), (results_b, params_b) = a, b
    assert [r[0] for r in results_a] == [r[0] for r in results_b] == list(range(SAMPLES))
    for (i, out_a, loss_a, predicted_a), (_, out_b, loss_b, predicted_b) in zip(results_a, results_b):
        assert (loss_a, predicted_a) == (loss_b, predicted_b) and torch.equal(out_a, out_b), i
    assert all(torch.equal(p, q) for p, q in zip(params_a, params_b, strict=True))


@pytest.mark.parametrize("grad_mode", LEARNING)
def test_predicted_samples_match_inline(predictions, grad_mode):
    depth, seen = predictions
    expected = predicting("inline", depth, grad_mode)
    assert [r[3] for r in expected[0]] == [not learnt for learnt in LEARNT]
    assert_same_predictions(seen[grad_mode], expected)
    assert not torch.equal(expected[1][0], next(mlp().parameters()))  # it learnt


def test_a_checkpoint_with_predictions_in_flight_resumes_exactly(predictions):
    depth, seen = predictions
    assert_same_predictions(seen["resumed"], predicting("inline", depth, "stash"))


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def checkpoints(request, tmp_path_factory):
    """What rank 0 saw of runs stopped, saved and resumed, with ``request.param`` ranks; and where
    the checkpoints are."""
    depth = request.param
    out = tmp_path_factory.mktemp(f"checkpoints{depth}")
    codes, _, logs = launch(out, depth, "checkpoint")
    assert codes == [0] * depth, "\n\n".join(logs)
    return depth, torch.load(Path(out, "seen.pt"), weights_only=False), out


def assert_same_results(a, b):
    assert [r[0] for r in a] == [r[0] for r in b]
    for (i, out_a, loss_a), (_, out_b, loss_b) in zip(a, b, strict=True):
        assert torch.equal(out_a, out_b) and loss_a == loss_b, i


@pytest.mark.parametrize("grad_mode", CHECKPOINTED)
def test_a_run_stopped_mid_segment_resumes_exactly_from_a_checkpoint(checkpoints, grad_mode):
    depth, seen, out = checkpoints
    name = grad_mode or "inference"
    xs, ys = classification_stream(SAMPLES)
    kw = learning(grad_mode) if grad_mode else {}
    whole = run("inline", mlp(), BALANCES[depth], xs, ys if grad_mode else None, **kw)
    results, params = seen[name]  # stopped, saved, resumed in a new pipeline: all distributed
    assert_same(whole, (results, params, None))
    rest, params = seen[f"{name} from inline"]  # resumed from a checkpoint of the inline executor
    assert rest[0][0] == STOP - (depth - 1)
    assert_same_results(rest, whole[0][rest[0][0] :])
    assert all(torch.equal(p, q) for p, q in zip(params, whole[1], strict=True))
    rest, params = seen[f"{name} from thread"]  # resumed from a checkpoint of the thread executor
    assert_same_results(rest, whole[0][rest[0][0] :])
    assert all(torch.equal(p, q) for p, q in zip(params, whole[1], strict=True))
    for executor in ("inline", "thread"):  # the other way round
        rest, params = resumed(executor, depth, grad_mode, Path(out, f"{name}.pt"))
        assert_same_results(rest, whole[0][rest[0][0] :])
        assert all(torch.equal(p, q) for p, q in zip(params, whole[1], strict=True))
    if grad_mode:
        assert not torch.equal(params[0], next(mlp().parameters()))  # it learnt


@pytest.mark.parametrize("scenario", ["raise", "vanish"])
def test_a_failing_rank_stops_every_rank_within_seconds_with_an_error_naming_it(tmp_path, scenario):
    codes, ended, logs = launch(tmp_path, 3, scenario)
    failed_at = float(Path(tmp_path, "failed_at").read_text())
    assert all(code != 0 for code in codes), (codes, logs)
    assert max(ended) - failed_at < 5.0, (max(ended) - failed_at, logs)
    if scenario == "raise":  # every rank, rank 1 included, raises rank 1's error
        for log in logs:
            assert f"StageError: stage 1, sample {FAIL_AT}, forward: RuntimeError: boom (rank 1 on" in log
            assert 'raise RuntimeError("boom")' in log  # the original traceback
    else:  # rank 2 vanished: its neighbours saw their links to it break
        for log in logs[:2]:
            assert "partime.errors.WorkerDiedError: stage 2, running: rank 2 is gone: rank " in log, log


def test_a_rank_killed_while_rank_0_is_stopped_fails_rank_0_naming_it_once_rank_0_runs_again(tmp_path):
    """Rank 0 does not see rank 1 go: it is stopped (SIGSTOP) while rank 1 is killed, as a rank on
    a loaded host may not run for a while. Once it runs again it meets the broken links wherever it
    is (a send of the caller, a link's ping, a wait), and whichever it meets first, it fails with
    the error that names stage 1, within seconds: it neither hands out a link's own ``Aborted`` nor
    waits for a link stuck on the peer that is gone."""
    procs, logs = start_ranks(tmp_path, 2, "endless")
    try:
        deadline = time.monotonic() + 60
        while "running" not in logs[0].read_text():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs[0].read_text()
            time.sleep(0.05)
        procs[0].send_signal(signal.SIGSTOP)
        procs[1].send_signal(signal.SIGKILL)
        time.sleep(1.5)  # long enough for rank 0's links to find the peer gone once they run
        procs[0].send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        while procs[0].poll() is None and time.monotonic() - resumed < 10:
            time.sleep(0.01)
        exited = time.monotonic() - resumed
    finally:
        reap(procs)
    log = logs[0].read_text()
    assert exited < 10 and procs[0].returncode != 0, (exited, log)
    assert "partime.errors.WorkerDiedError: stage 1, running: rank 1 is gone: rank 0 on " in log, log
    assert "Aborted" not in log, log


def test_ranks_given_different_models_stop_at_the_first_sample_naming_the_stage(tmp_path):
    codes, _, logs = launch(tmp_path, 2, "mismatch")
    assert codes[0] != 0 and codes[1] != 0, (codes, logs)
    differs = "stage 1 of the model differs between rank 1 and rank 0: ['4.weight (9, 9) float32', "
    assert "ValueError: " + differs in logs[1]
    assert "partime.errors.StageError: stage 1, start: " + differs in logs[0]
    theirs = "'4.weight (8, 8) float32', '4.bias (8,) float32', '6.weight (3, 8) float32', '6.bias (3,) float32'"
    assert f"[{theirs}] on rank 0" in logs[0]


def test_it_runs_under_torchrun_only_with_one_rank_per_stage(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="torchrun --standalone --nproc-per-node=D"):
        partime.Pipeline(mlp(), [3, 4], executor="distributed")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"2 stages and 3 ranks; start 2 ranks \(torchrun --nproc-per-node=2\)"):
        partime.Pipeline(mlp(), [3, 4], executor="distributed")
    with pytest.raises(ValueError, match="leave devices=None"):
        partime.Pipeline(mlp(), [3, 4], executor="distributed", devices=["cpu", "cpu"])


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])

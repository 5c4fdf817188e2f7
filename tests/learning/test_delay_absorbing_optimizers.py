"""NAdam with β1 = 0.99 and Muon (``partime.optim.MuonWithAdamW``) inside each stage: at D = 1 the
plain online loop to the bit, alike under every executor, exact across a checkpoint, and what
``compensation="auto"`` chooses for them."""

import copy

import pytest
import torch
from models import CONV_BALANCES, conv_net, strided_frames
from torch import nn

import partime
from partime.learning.compensation import chosen_compensation, optimizer_kind
from partime.optim import MuonWithAdamW

CE = nn.CrossEntropyLoss()
BALANCES = {1: [5], **CONV_BALANCES}
STRIDED, YS = strided_frames(14, seed=3)
XS = [x.contiguous() for x in STRIDED]  # frames as a plain loop's data loader gives them


def nadam(params):
    return torch.optim.NAdam(params, lr=3e-3, betas=(0.99, 0.999), decoupled_weight_decay=True)


def muon(params):
    return MuonWithAdamW(params, lr=3e-3, weight_decay=0.01)


OPTIMIZERS = [nadam, muon]
IDS = ["nadam", "muon"]


def plain_loop(optimizer):
    """Forward, loss, backward, step per sample: the losses and the model's weights."""
    model = conv_net()
    opt = optimizer(model.parameters())
    losses = []
    for x, y in zip(XS, YS):
        loss = CE(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def piped(depth, executor="inline", **kw):
    """The losses and final weights of a pipeline of ``conv_net()`` cut into ``depth`` stages."""
    with partime.Pipeline(conv_net(), BALANCES[depth], executor=executor, threads=1, loss_fn=CE, **kw) as pipe:
        losses = [r.loss for r in pipe.stream(XS, YS)]
        return losses, weights(pipe)


def weights(pipe):
    return [p.detach().clone() for p in pipe.module.parameters()]


def same(a, b):
    (losses_a, weights_a), (losses_b, weights_b) = a, b
    return losses_a == losses_b and all(torch.equal(p, q) for p, q in zip(weights_a, weights_b, strict=True))


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=IDS)
def test_at_depth_one_each_is_the_plain_loop_to_the_bit(optimizer):
    reference = plain_loop(optimizer)
    assert same(piped(1, optimizer=optimizer), reference)
    assert not same(piped(1, optimizer=lambda p: torch.optim.Adam(p, lr=3e-3)), reference)  # the optimizer counts


@pytest.mark.parametrize(
    ("optimizer", "depth"), [(nadam, 2), (muon, 2), (muon, 3)], ids=["nadam-2", "muon-2", "muon-3"]
)
def test_each_executor_learns_as_inline(optimizer, depth):
    reference = piped(depth, optimizer=optimizer)
    assert not same(reference, piped(1, optimizer=optimizer))  # the delay changed what was learnt
    for executor in ("thread", "process"):
        assert same(piped(depth, executor, optimizer=optimizer), reference), executor


@pytest.mark.parametrize(("optimizer", "chosen"), [(nadam, ("step-scale",)), (muon, ("step-scale",))], ids=IDS)
def test_auto_applies_what_measured_best_for_them(optimizer, chosen):
    made = optimizer(conv_net().parameters())
    assert optimizer_kind(made) == optimizer.__name__
    assert chosen_compensation(("auto",), made) == chosen
    auto = piped(2, optimizer=optimizer, compensation="auto")
    assert same(auto, piped(2, optimizer=optimizer, compensation=chosen))
    other = () if chosen else ("step-scale",)
    assert not same(auto, piped(2, optimizer=optimizer, compensation=other))  # the choice shows


def test_torch_muon_alone_is_known_to_auto_as_muon():
    made = torch.optim.Muon([nn.Parameter(torch.ones(3, 2))], lr=0.02)
    assert optimizer_kind(made) == "muon"
    assert chosen_compensation(("auto",), made) == ("step-scale",)


# -- checkpoints ----------------------------------------------------------------------------------

ACTIONS = ["step"] * 6 + ["flush"] + ["step"] * 6 + ["flush"]


def play(pipe, actions):
    results = []
    for action in actions:
        if action == "flush":
            results.extend(r.loss for r in pipe.flush())
            continue
        r = pipe.step(XS[pipe.fed], YS[pipe.fed])
        if r is not None:
            results.append(r.loss)
    return results


def pipeline(optimizer, executor="inline", seed=0):
    return partime.Pipeline(
        conv_net(seed), CONV_BALANCES[3], executor=executor, threads=1, loss_fn=CE, optimizer=optimizer
    )


def resumed(optimizer, stop, path, executor="inline"):
    """Stopped after ``ACTIONS[:stop]``, saved, loaded into a fresh pipeline (other weights) under
    ``executor``, finished: the losses and the final weights."""
    with pipeline(optimizer) as pipe:
        before = play(pipe, ACTIONS[:stop])
        pipe.save(path)
    with pipeline(optimizer, executor, seed=1) as pipe:
        pipe.load(path)
        return before + play(pipe, ACTIONS[stop:]), weights(pipe)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=IDS)
def test_a_checkpoint_resumes_exactly_with_the_optimizer_state(optimizer, tmp_path):
    with pipeline(optimizer) as pipe:
        reference = play(pipe, ACTIONS), weights(pipe)
    for stop in (2, 9):  # samples in flight, then after a flush
        assert same(resumed(optimizer, stop, tmp_path / f"{stop}.pt"), reference), stop
    # the optimizer's state counted: the same checkpoint with a fresh optimizer's state learns otherwise
    with pipeline(optimizer) as pipe:
        play(pipe, ACTIONS[:9])
        state = pipe.state_dict()
    with pipeline(optimizer) as fresh:
        for stage, fresh_stage in zip(state["stages"], fresh.state_dict()["stages"]):
            stage["optimizer"] = fresh_stage["optimizer"]
    with pipeline(optimizer, seed=1) as pipe:
        pipe.load_state_dict(state)
        forgot = play(pipe, ACTIONS[9:]), weights(pipe)
    assert not same(forgot, (reference[0][-len(forgot[0]) :], reference[1]))


def test_muon_resumes_exactly_under_the_process_executor(tmp_path):
    with pipeline(muon) as pipe:
        reference = play(pipe, ACTIONS), weights(pipe)
    assert same(resumed(muon, 4, tmp_path / "process.pt", "process"), reference)


# -- MuonWithAdamW ----------------------------------------------------------------------------------


def test_muon_with_adamw_steps_matrices_with_muon_and_the_rest_with_adamw():
    model = conv_net()
    twin = conv_net()  # the same weights: conv_net seeds itself
    made = MuonWithAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    matrices = [p for p in twin.parameters() if p.dim() >= 2]
    flat = [nn.Parameter(p.detach().reshape(p.shape[0], -1).clone()) for p in matrices]
    rest = [p for p in twin.parameters() if p.dim() < 2]
    by_hand = [
        torch.optim.Muon(flat, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1),
    ]
    assert [len(g["params"]) for g in made.param_groups] == [len(matrices), len(rest)]
    for x, y in zip(XS[:4], YS[:4]):
        made.zero_grad()
        CE(model(x), y).backward()
        made.step()
        for p in twin.parameters():
            p.grad = None
        CE(twin(x), y).backward()
        for f, p in zip(flat, matrices):
            f.grad = p.grad.reshape(f.shape)
        for o in by_hand:
            o.step()
        with torch.no_grad():
            for f, p in zip(flat, matrices):
                p.copy_(f.reshape(p.shape))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    assert not torch.equal(model[0].weight, conv_net()[0].weight)  # it learnt


def test_muon_with_adamw_uses_the_lr_set_in_its_groups():
    def stepped(lr_after):
        model = conv_net()
        made = MuonWithAdamW(model.parameters(), lr=1e-2)
        for i, (x, y) in enumerate(zip(XS[:3], YS[:3])):
            if i == 1:
                for group in made.param_groups:
                    group["lr"] = lr_after
            made.zero_grad()
            CE(model(x), y).backward()
            made.step()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(p, q) for p, q in zip(stepped(1e-2), stepped(1e-2)))
    assert all(not torch.equal(p, q) for p, q in zip(stepped(1e-2), stepped(0.0)))
    with_zero = stepped(0.0)
    assert all(torch.equal(p, q) for p, q in zip(stepped(0.0), with_zero))


def test_muon_with_adamw_state_round_trips_exactly():
    def learn(made, model, frames):
        for x, y in frames:
            made.zero_grad()
            CE(model(x), y).backward()
            made.step()

    model = conv_net()
    made = MuonWithAdamW(model.parameters(), lr=1e-2)
    learn(made, model, zip(XS[:3], YS[:3]))
    twin = conv_net()
    twin.load_state_dict(model.state_dict())
    loaded = MuonWithAdamW(twin.parameters(), lr=0.5)  # its lr is the state's
    loaded.load_state_dict(copy.deepcopy(made.state_dict()))  # torch's optimizers load states without copying
    assert [g["lr"] for g in loaded.param_groups] == [1e-2, 1e-2]
    learn(made, model, zip(XS[3:6], YS[3:6]))
    learn(loaded, twin, zip(XS[3:6], YS[3:6]))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


def test_muon_with_adamw_refuses_groups_and_another_state():
    with pytest.raises(ValueError, match="takes the parameters themselves"):
        MuonWithAdamW([{"params": list(conv_net().parameters())}])
    only_matrices = MuonWithAdamW([nn.Parameter(torch.ones(3, 2))])
    with pytest.raises(ValueError, match="its adamw part does not fit"):
        only_matrices.load_state_dict(MuonWithAdamW(conv_net().parameters()).state_dict())
    with pytest.raises(ValueError, match="not a MuonWithAdamW state"):
        only_matrices.load_state_dict(torch.optim.Adam([nn.Parameter(torch.ones(2))]).state_dict())

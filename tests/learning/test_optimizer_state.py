"""The optimizer factory, checked on copies of the model's own parameters: what a plain loop
accepts is accepted, what cannot learn one sample per tick is refused when the pipeline is made."""

import copy
import re

import pytest
import torch
from torch import nn

import partime
from partime.errors import StageError
from partime.learning.optimizer_state import check_optimizer_factory

MSE = nn.MSELoss()
EXAMPLE = "lambda params: torch.optim.SGD(params, lr=0.01)"


def weights_only(seed=0):
    """A model whose parameters are all 2-D (no biases): what Muon takes."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.Linear(8, 3, bias=False)
    )


def muon(params):
    return torch.optim.Muon(params, lr=0.02)


def stream(n=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, generator=gen), torch.randn(n, 2, 3, generator=gen)


def learnt(executor, depth, model):
    xs, ys = stream()
    balance = [4] if depth == 1 else [2, 2]
    with partime.Pipeline(model, balance, executor=executor, threads=1, loss_fn=MSE, optimizer=muon) as pipe:
        losses = [r.loss for r in pipe.stream(xs, ys)]
        return losses, [p.detach().clone() for p in pipe.module.parameters()]


def test_muon_at_depth_one_learns_exactly_as_a_plain_loop():
    model = weights_only()
    plain = copy.deepcopy(model)
    opt = muon(plain.parameters())
    xs, ys = stream()
    expected = []
    for x, y in zip(xs, ys):
        loss = MSE(plain(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    losses, weights = learnt("inline", 1, model)
    assert losses == expected
    assert all(torch.equal(p, q) for p, q in zip(weights, plain.parameters(), strict=True))


def test_muon_at_depth_two_learns_alike_under_every_executor():
    runs = {executor: learnt(executor, 2, weights_only()) for executor in ("inline", "thread", "process")}
    losses, weights = runs.pop("inline")
    for executor, (other_losses, other_weights) in runs.items():
        assert other_losses == losses, executor
        assert all(torch.equal(p, q) for p, q in zip(other_weights, weights, strict=True)), executor
    assert not torch.equal(weights[0], weights_only().state_dict()["0.weight"])  # stage 0 learnt


def test_a_factory_that_a_plain_loop_refuses_is_refused_with_the_parameters_it_was_called_on():
    torch.manual_seed(0)
    with_bias = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 3))
    with pytest.raises(ValueError) as info:
        partime.Pipeline(with_bias, [2, 1], executor="inline", loss_fn=MSE, optimizer=muon)
    message = str(info.value)
    assert message.startswith(
        "the optimizer factory, called on copies of the model's 3 trainable parameters "
        "(0.weight (8, 6), 2.weight (3, 8), 2.bias (3,)), failed: ValueError: Muon only supports 2D parameters"
    )
    assert "a plain loop's factory(model.named_parameters()) fails alike" in message
    assert (
        "partime.optim.MuonWithAdamW, one optimizer that steps the matrices with Muon and the rest with AdamW"
        in message
    )
    assert isinstance(info.value.__cause__, ValueError)


def test_a_stage_whose_parameters_the_factory_refuses_names_the_stage_and_them():
    # Muon of the 2-D weights, the rest left out: the model as a whole is accepted, but stage 1 has
    # no 2-D weight, and Muon refuses an empty list there.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.LayerNorm(8))
    factory = lambda named: torch.optim.Muon([p for _, p in named if p.dim() == 2], lr=0.02)
    xs, _ = stream(3)
    with partime.Pipeline(model, [1, 1], executor="inline", loss_fn=MSE, optimizer=factory) as pipe:
        with pytest.raises(StageError) as info:
            list(pipe.stream(xs, torch.randn(3, 2, 8)))
    message = str(info.value)
    assert (
        "stage 1: the optimizer factory, called on its 2 trainable parameters (1.weight (8,), 1.bias (8,)), "
        "failed: ValueError: optimizer got an empty parameter list; stage 1 cannot learn."
    ) in message
    assert "leave them out of the one it returns" in message


@pytest.mark.parametrize("executor", ["inline", "process"])
def test_an_optimizer_whose_step_needs_a_closure_is_refused_when_the_pipeline_is_made(executor):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with pytest.raises(TypeError) as info:
        partime.Pipeline(model, [2, 1], executor=executor, loss_fn=MSE, optimizer=lambda p: torch.optim.LBFGS(p))
    assert str(info.value) == (
        "the optimizer factory, called on copies of the model's 4 trainable parameters "
        "(0.weight (8, 6), 0.bias (8,), 2.weight (3, 8), 2.bias (3,)), made LBFGS, whose step() requires "
        "closure (a closure that evaluates the loss again, several times per step, as LBFGS does): a pipeline "
        "learns from one gradient per sample per tick and has no closure to give; use an optimizer that steps "
        "on the gradient alone, e.g. torch.optim.SGD or torch.optim.Adam"
    )


def test_an_optimizer_subclass_whose_step_takes_an_optional_closure_is_accepted():
    class Logged(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    param = nn.Parameter(torch.zeros(2, 2))
    check_optimizer_factory(lambda p: Logged(p, lr=0.1), (), [("w", param)])


def test_an_optimizer_with_an_lr_schedule_is_accepted():
    def factory(params):  # the schedule wraps the optimizer's step in one that reads as step(self, ...)
        optimizer = torch.optim.SGD(params, lr=0.1)
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
        return optimizer

    check_optimizer_factory(factory, (), [("w", nn.Parameter(torch.zeros(2, 2)))])


def test_the_factory_is_called_on_copies_never_on_the_model_parameters():
    model = weights_only()
    seen = []

    def factory(named):
        params = [p for _, p in named]
        seen.extend(params)
        with torch.no_grad():
            for p in params:
                p.zero_()  # what an initialising factory might do: it must not reach the model
        return torch.optim.SGD(params, lr=0.1)

    before = copy.deepcopy(model.state_dict())
    check_optimizer_factory(factory, (), list(model.named_parameters()))
    assert [p.shape for p in seen] == [p.shape for p in model.parameters()]
    assert not any(p is q for p in seen for q in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- the factory's own checks ---------------------------------------------------------------------

NAMED = [("0.weight", nn.Parameter(torch.zeros(3, 2))), ("0.bias", nn.Parameter(torch.zeros(3)))]
SOURCE = (
    "the optimizer factory, called on copies of the model's 2 trainable parameters (0.weight (3, 2), 0.bias (3,)), "
)


@pytest.mark.parametrize(
    "factory, got",
    [
        ("sgd", "got str 'sgd'"),
        (torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), "got an instance of SGD"),
        (0.01, "got float 0.01"),
    ],
)
@pytest.mark.parametrize("names", [(), ("auto",), ("spike",)])
def test_check_optimizer_factory_refuses_a_string_or_an_optimizer(factory, got, names):
    message = f"optimizer must be a factory params -> Optimizer, e.g. {EXAMPLE}; {got}"
    with pytest.raises(TypeError, match=re.escape(message)):
        check_optimizer_factory(factory, names, NAMED)


def forgets_to_return(params):
    torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize(
    "factory, returned",
    [
        (
            forgets_to_return,
            (
                "returned None, not a torch.optim.Optimizer: no stage would learn; the factory must return "
                "the optimizer it makes of the params it is given (a def must return it)"
            ),
        ),
        (lambda named: [p for _, p in named], "returned list [Parameter c"),
    ],
)
def test_check_optimizer_factory_refuses_a_factory_that_makes_no_optimizer(factory, returned):
    with pytest.raises(TypeError, match=re.escape(SOURCE + returned)):
        check_optimizer_factory(factory, (), NAMED)


def test_check_optimizer_factory_refuses_an_optimizer_of_other_parameters():
    other = nn.Linear(3, 3)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "returned SGD holding none of them (it holds 2 other parameters): no stage would learn; the optimizer "
            f"factory must optimise the params it is given, e.g. {EXAMPLE}, not other_model.parameters()"
        ),
    ):
        check_optimizer_factory(lambda params: torch.optim.SGD(other.parameters(), lr=0.1), (), NAMED)


def test_check_optimizer_factory_says_when_the_factory_fails():
    with pytest.raises(ValueError, match=re.escape(SOURCE + "failed: ValueError: Invalid learning rate: -1")) as info:
        check_optimizer_factory(lambda params: torch.optim.SGD(params, lr=-1), (), NAMED)
    assert isinstance(info.value.__cause__, ValueError)

    def broken(params):
        raise KeyError("lr")

    with pytest.raises(RuntimeError, match="failed: KeyError: 'lr'") as info:
        check_optimizer_factory(broken, (), NAMED)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(
    "factory",
    [
        lambda params: torch.optim.SGD(params, lr=0.1),
        torch.optim.SGD,  # the class is a factory too (lr has a default)
        lambda params: torch.optim.Adam(params, lr=1e-3),
        # param groups by shape, and a look at the first parameter's shape, as real factories do
        lambda params: torch.optim.SGD(
            [
                {"params": [p for _, p in params if p.dim() > 1], "weight_decay": 1e-4},
                {"params": [p for _, p in params if p.dim() <= 1]},
            ],
            lr=0.1,
        ),
        lambda params: torch.optim.SGD(params, lr=0.1 / params[0][1].shape[1]),
    ],
)
def test_check_optimizer_factory_takes_factories_that_optimise_their_params(factory):
    check_optimizer_factory(factory, ("spike",), NAMED)

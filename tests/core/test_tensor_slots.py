"""TensorSlots: a forward with other tensors in place of a module's own, as functional_call runs it."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from partime.core.stage.tensor_slots import TensorSlots


class Tied(nn.Module):
    """An embedding and an output layer that share one weight, and a BatchNorm with buffers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 6, bias=False)
        self.norm = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 4, bias=False)
        self.out.weight = nn.Parameter(self.embed.weight.detach().t().contiguous())
        self.back = nn.Linear(4, 6, bias=False)
        self.back.weight = self.embed.weight  # tied: one tensor under two names

    def forward(self, x):
        return self.back(self.out(self.norm(self.embed(x))))


class Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def others(module, buffers=True):
    """Other tensors for every parameter (and buffer) of ``module``, by name."""
    torch.manual_seed(1)
    tensors = {n: torch.randn_like(p).requires_grad_() for n, p in module.named_parameters()}
    if buffers:
        tensors.update((n, b.clone() + 1) for n, b in module.named_buffers())
    return tensors


@pytest.mark.parametrize("buffers", [False, True])
def test_a_forward_holding_other_tensors_equals_functional_call_and_gives_the_module_its_own_back(buffers):
    torch.manual_seed(0)
    module = Tied().train()
    x = torch.randn(5, 4)
    own = {n: t for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]}
    tensors = others(module, buffers)
    expected_module = Tied().train()
    expected_module.load_state_dict(module.state_dict())
    expected = torch.func.functional_call(expected_module, others(expected_module, buffers), (x,))
    with TensorSlots(module).holding(tensors):
        got = module(x)
    assert torch.equal(got, expected)
    # the tied name took the tensor given for the first: a gradient reaches it through both uses
    (g,) = torch.autograd.grad(got.sum(), [tensors["embed.weight"]])
    (e,) = torch.autograd.grad(expected.sum(), [expected_module.embed.weight], allow_unused=True)
    assert g is not None and e is None  # functional_call's forward did not use the module's own either
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
        assert t is own[name], name
    assert module.back.weight is module.embed.weight
    if buffers:  # BatchNorm's running statistics moved in the copies given, not in the module's own
        assert torch.equal(module.norm.running_mean, torch.zeros(6))
        assert not torch.equal(tensors["norm.running_mean"], torch.ones(6))


def test_a_parametrized_weight_is_computed_from_the_tensor_held_in_its_place():
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    parametrize.register_parametrization(layer, "weight", Doubled())
    x = torch.randn(2, 3)
    tensors = others(layer, buffers=False)
    with TensorSlots(layer).holding(tensors):
        got = layer(x)
    assert torch.equal(got, x @ (2 * tensors["parametrizations.weight.original"]).t() + tensors["bias"])
    assert torch.equal(layer(x), torch.func.functional_call(layer, {}, (x,)))


def test_the_module_gets_its_own_back_when_the_forward_raises_and_an_unknown_name_is_a_key_error():
    layer = nn.Linear(3, 3)
    weight = layer.weight
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        with TensorSlots(layer).holding({"weight": torch.zeros(3, 5)}):
            layer(torch.randn(2, 3))
    assert layer.weight is weight
    with pytest.raises(KeyError, match="bias2"):
        with TensorSlots(layer).holding({"weight": torch.zeros(3, 3), "bias2": torch.zeros(3)}):
            pass
    assert layer.weight is weight

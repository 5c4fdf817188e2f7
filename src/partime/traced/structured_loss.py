"""A traced model's own structured inputs and outputs, beside its graph's flat tensors.

A model traced on a sample (``partime.traced.exporting``) may return a ``ModelOutput`` or a
dict; its graph returns the tensors of it, and those are what cross stages. ``StructuredLoss``
hands the user's ``loss_fn`` the output as the model returns it (``out.last_hidden_state``), so a
loss written for the model works unchanged on the pipeline. ``ModelCall`` goes the other way: the
model itself, called as its user calls it, on a sample as the graph takes it, giving the graph's
tensors; what ``balance="auto"`` weighs a pipeline against (``partime.planning.auto_check``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from .exporting import exported_output
from .segment import Forward


class StructuredLoss(nn.Module):
    """``loss_fn`` called with ``forward.structured(output)`` in place of the graph's ``output``.

    A loss that is an ``nn.Module`` is its child, so that its parameters (a loss that learns) are
    this module's and learn in the last stage as they would unwrapped."""

    def __init__(self, loss_fn: Any, forward: Forward):
        super().__init__()
        if isinstance(loss_fn, nn.Module):
            self.loss = loss_fn
        else:
            object.__setattr__(self, "loss", loss_fn)
        self.traced_forward = forward

    def forward(self, output: Any, *target: Any) -> Tensor:
        loss: Tensor = self.loss(self.traced_forward.structured(output), *target)
        return loss


class ModelCall(nn.Module):
    """``model`` (the module whose graph ``forward`` traced) run by its own ``forward``, as its user
    runs it, on a sample as the traced graph takes it (``Forward.flat_sample``: a tensor, or a tuple
    of one per input); it returns the tensors of the model's output, in the graph's order (one
    tensor, or a tuple). ``model`` is its child: its parameters are this module's."""

    def __init__(self, model: nn.Module, forward: Forward):
        super().__init__()
        self.model = model
        self.traced_forward = forward

    def forward(self, sample: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        tensors = (sample,) if isinstance(sample, Tensor) else tuple(sample)
        if self.traced_forward.traced_on is not None:  # exported on a sample: called as it was exported
            return exported_output(self.model, self.traced_forward, tensors)
        leaves = tuple(tree_leaves(self.model(*tensors)))
        return leaves[0] if len(leaves) == 1 else leaves


__all__ = ["ModelCall", "StructuredLoss"]

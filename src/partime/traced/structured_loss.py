"""A loss given the model's own output of a traced graph's tensors: a ``ModelOutput``, a dict.

A model traced on a sample (``partime.traced.exporting``) may return a ``ModelOutput`` or a
dict; its graph returns the tensors of it, and those are what cross stages. ``StructuredLoss``
hands the user's ``loss_fn`` the output as the model returns it (``out.last_hidden_state``), so a
loss written for the model works unchanged on the pipeline.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

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


__all__ = ["StructuredLoss"]

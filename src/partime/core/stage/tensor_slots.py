"""Where each parameter and buffer of a module is held, to run a forward with other tensors in their place.

``torch.func.functional_call`` runs a module with the tensors of a dict in place of its own
parameters and buffers, and finds, at every call, where each name is held (walking the module
tree, looking for tied names). A stage that runs its forward with other weights at every tick
(predicted weights, stashed weights, copies of its buffers) pays that walk at every tick: on a
stage of a few convolutions it is a tenth of the forward. ``TensorSlots`` finds the places once,
and ``holding`` puts tensors in them, as ``functional_call`` does, and puts the module's own back.

A name stands for every name of the same tensor (weights tied between two layers), so that a
tensor given for one name is used wherever the module uses that tensor, as ``functional_call``
ties them by default.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from torch import Tensor, nn


class TensorSlots:
    """The places of ``module``'s parameters and buffers, by name (as ``named_parameters`` and
    ``named_buffers`` give them, tied names included)."""

    def __init__(self, module: nn.Module):
        self._places: dict[str, list[tuple[dict[str, Tensor | None], str]]] = {}
        first_name: dict[int, str] = {}  # a tensor's first name: the one its other names stand with
        members = [
            *((name, "_parameters") for name, _ in module.named_parameters(remove_duplicate=False)),
            *((name, "_buffers") for name, _ in module.named_buffers(remove_duplicate=False)),
        ]
        for name, table in members:
            path, _, attr = name.rpartition(".")
            owner = module.get_submodule(path)
            held = getattr(owner, table)
            tensor = held[attr]
            canonical = first_name.setdefault(id(tensor), name)
            place = (held, attr)
            self._places.setdefault(name, []).append(place)
            if canonical != name:
                self._places[canonical].append(place)

    @contextmanager
    def holding(self, tensors: Mapping[str, Tensor]) -> Iterator[None]:
        """Within it, the module holds ``tensors`` (by name) in place of its own, as
        ``torch.func.functional_call`` would give them to a forward; a KeyError for a name it
        does not have. Its own are back when it ends, however it ends."""
        swapped: list[tuple[dict[str, Tensor | None], str, Tensor | None]] = []
        try:
            for name, tensor in tensors.items():
                for held, attr in self._places[name]:
                    swapped.append((held, attr, held[attr]))
                    held[attr] = tensor
            yield
        finally:
            for held, attr, own in reversed(swapped):
                held[attr] = own

"""The graph of a forward, kept for the product of a late gradient across the stage's steps.

Autograd refuses to run a backward through a graph whose saved tensors were changed in place
after the forward, and every optimizer step changes the stage's parameters in place. A
``KeptGraph`` gives the forward of a ``graph-stash`` stage ``saved_tensors_hooks`` under which:

- a saved tensor that shares storage with one of the stage's parameters (a weight, a view of
  it such as ``weight.t()``) is let through unchecked, so the product reads the parameter as it
  is when the product runs: the stage's weights now;
- every other saved tensor (inputs, activations, a dropout mask, BatchNorm's batch statistics) is
  checked when the backward reads it, as autograd checks it, and a change in place since the
  forward raises a RuntimeError that names the stage and the sample.

So the product of a late gradient uses the graph of the sample's own forward (its activations,
its masks) with the stage's current weights, and no forward runs twice. The saved tensors that
are not parameters are collected, by reference, in the order the forward saved them: a
checkpoint copies them, and ``replaying`` builds the same graph again from those copies.

A normalisation layer (BatchNorm, LayerNorm, GroupNorm, ...) saves statistics of its input for its
backward, and those depend on the weights before it: run back with the weights now, a kept graph
scales the gradient at each such layer by about the ratio of its input's spread now to its spread
then, and a chain of them compounds the ratios until a step overflows (a BatchNorm net learning
one sample at a time with SGD at lr 0.01 reached NaN in six samples). ``normalisation_in`` names
such a layer, so that the stage keeps its forwards' weights with their graphs instead, as
``weight-stash`` does: the product is then the exact one of the sample at the weights it went with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from torch import Tensor, fx, nn
from torch.autograd.graph import saved_tensors_hooks

_NORMALISATIONS: tuple[type[nn.Module], ...] = (nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()  # torch >= 2.4
)
"""Layers whose backward reads statistics of their input that the weights before them change."""

_NORMALISING_FUNCTIONS = ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm")
"""The same, as the names of the functions (and aten operators) a traced graph calls."""


def normalisation_in(module: nn.Module) -> str | None:
    """The name of a normalisation layer that ``module`` runs with statistics of its input (its own
    name and type, or a traced graph's node), or None if it runs none: a BatchNorm or InstanceNorm
    that normalises with its running statistics (in eval mode) counts as none."""
    for name, layer in module.named_modules():
        if isinstance(layer, nn.modules.batchnorm._NormBase):
            if layer.training or layer.running_mean is None:
                return f"{name or 'the stage'} ({type(layer).__name__})"
        elif isinstance(layer, _NORMALISATIONS):
            return f"{name or 'the stage'} ({type(layer).__name__})"
        if isinstance(layer, fx.GraphModule):
            for node in layer.graph.nodes:
                target = getattr(node.target, "__name__", str(node.target))
                if node.op == "call_function" and any(f in target for f in _NORMALISING_FUNCTIONS):
                    return f"node {node.name} ({target})"
    return None


class KeptGraph:
    """Saved-tensor hooks for the forwards of one stage, whose parameters are ``parameters``."""

    def __init__(self, stage: int, parameters: Iterable[Tensor]):
        self.stage = stage
        self._storages = {_storage(p) for p in parameters} - {None}

    def keeping(self, sample: int, saved: list[Tensor]) -> saved_tensors_hooks:
        """Hooks for the forward of ``sample``: its graph stays valid across the stage's steps;
        every saved tensor that is not a parameter is appended to ``saved``."""

        storages = self._storages

        def pack(t: Tensor) -> tuple[Tensor, int | None]:  # run for every tensor a forward saves: kept short
            try:
                if t.untyped_storage().data_ptr() in storages:
                    return t, None
            except (RuntimeError, NotImplementedError):  # no storage (sparse, opaque): not a parameter
                pass
            saved.append(t)
            return t, t._version

        return saved_tensors_hooks(pack, self._unpack(sample))

    @contextmanager
    def replaying(self, sample: int, saved: list[Tensor]) -> Iterator[None]:
        """Within it, a forward of ``sample`` builds again the graph ``keeping`` built: each saved
        tensor that is not a parameter is replaced, in order, by the next of ``saved`` (the copies
        a checkpoint kept). A ValueError if the forward saves other tensors, or fewer."""
        position = iter(range(len(saved)))

        def pack(t: Tensor) -> tuple[Tensor, int | None]:
            if _storage(t) in self._storages:
                return t, None
            k = next(position, None)
            if k is None or saved[k].shape != t.shape or saved[k].dtype != t.dtype:
                raise ValueError(
                    f"stage {self.stage}: the checkpoint's graph of sample {sample} does not fit this stage's "
                    f"forward: it saved {len(saved)} tensors, and tensor {len(saved) if k is None else k} "
                    f"of the forward is {tuple(t.shape)} {t.dtype}"
                )
            return saved[k], saved[k]._version

        with saved_tensors_hooks(pack, self._unpack(sample)):
            yield
        left = sum(1 for _ in position)
        if left:
            raise ValueError(
                f"stage {self.stage}: the checkpoint's graph of sample {sample} does not fit this stage's "
                f"forward: it saved {len(saved)} tensors, the forward {len(saved) - left}"
            )

    def _unpack(self, sample: int) -> Callable[[tuple[Tensor, int | None]], Tensor]:
        def unpack(packed: tuple[Tensor, int | None]) -> Tensor:
            t, version = packed
            if version is not None and t._version != version:
                raise RuntimeError(
                    f"stage {self.stage}: a tensor that the forward of sample {sample} saved for its backward "
                    f"(shape {tuple(t.shape)}) was changed in place afterwards (version {t._version}, "
                    f"{version} at the forward): write the in-place operation out of place"
                )
            return t

        return unpack


def _storage(t: Tensor) -> int | None:
    """Where ``t``'s storage begins, or None for a tensor without one (sparse, opaque)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None

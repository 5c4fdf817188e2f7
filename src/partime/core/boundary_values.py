"""Values that cross a stage boundary: a tensor, or a flat tuple of tensors.

Every boundary of a pipeline (a sample, an activation between two stages, an output, a target)
carries values of one fixed layout, learnt from the first sample. ``TensorSpec`` describes one
tensor of it; ``ValueSpec`` the whole value, remembering whether it was a bare tensor.

Where a stage's output crosses a cut, its layout also keeps the strides it had (``spec_of(...,
strides=True)``), and every executor hands it to the next stage in them (``rebuild``): a
``channels_last`` activation, or a transposed one, arrives as it left, and what the next stage
computes from it (a pooling, a BatchNorm, a matrix product) has the bits it has in ``model(x)``.
Samples and targets cross as contiguous copies, whatever strides the caller's tensors have.
"""

from __future__ import annotations

import cmath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor at a boundary, and the strides it crosses in (None: contiguous).

    The strides are no part of what a value must match (``check_like``, ``==``): a value of other
    strides is taken, and handed on in these (``laid_out``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    strides: tuple[int, ...] | None = field(default=None, compare=False)

    def zeros(self, count: int) -> Tensor:
        """``count`` values of this spec one after another (``[k]`` is the k-th), zeros, each in
        the spec's strides."""
        if self.strides is None:
            return torch.zeros((count, *self.shape), dtype=self.dtype)
        numel = 1
        for d in self.shape:
            numel *= d
        return torch.empty_strided((count, *self.shape), (numel, *self.strides), dtype=self.dtype).zero_()

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class ValueSpec:
    """The layout of a value: its tensors, and whether it is a bare tensor or a tuple."""

    tensors: tuple[TensorSpec, ...]
    is_tuple: bool

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def __str__(self) -> str:
        inner = ", ".join(str(t) for t in self.tensors)
        return f"({inner})" if self.is_tuple else inner


def as_tensors(value: object, what: str) -> tuple[Tensor, ...]:
    """The tensors of a value; a TypeError naming ``what`` if it is not a tensor or a flat tuple."""
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        return tuple(value)
    kind = type(value).__name__
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(type(v).__name__ for v in value) or "empty"
        kind = f"{kind} of ({kinds})"
    raise TypeError(f"{what} must be a tensor or a flat tuple of tensors, got {kind}")


def spec_of(value: object, what: str, *, strides: bool = False) -> ValueSpec:
    """The layout of ``value``; with ``strides``, the strides of its tensors too (``dense_strides``)."""
    tensors = as_tensors(value, what)
    return ValueSpec(
        tuple(TensorSpec(tuple(t.shape), t.dtype, dense_strides(t) if strides else None) for t in tensors),
        not isinstance(value, Tensor),
    )


def dense_strides(t: Tensor) -> tuple[int, ...]:
    """The strides of ``t`` where its elements fill its memory without gaps or overlaps (a
    ``channels_last`` tensor, a transposed one); else those of a copy of it (``preserve_format``:
    contiguous, or ``channels_last`` for a view of a ``channels_last`` tensor)."""
    return tuple(torch.empty_like(t, device="meta").stride())


def laid_out(t: Tensor, spec: TensorSpec) -> Tensor:
    """``t`` in the strides of ``spec`` (contiguous where it has none): itself if it has them, else a copy."""
    if spec.strides is None:
        return t.contiguous()
    if t.stride() == spec.strides:
        return t
    return torch.empty_strided(t.shape, spec.strides, dtype=t.dtype, device=t.device).copy_(t)


def in_bytes(data: Tensor, spec: TensorSpec) -> Tensor:
    """``data``, ``spec.nbytes`` bytes (uint8), seen as a tensor of ``spec`` in its strides: the
    elements of a dense layout span exactly its bytes, whatever their order."""
    values = data.view(spec.dtype)
    return values.view(spec.shape) if spec.strides is None else values.as_strided(spec.shape, spec.strides)


def dense(t: Tensor) -> Tensor:
    """``t`` itself where its elements fill its memory without gaps or overlaps, else a copy of it in
    ``dense_strides``: what a link hands on by reference, its strides kept."""
    if t.is_contiguous() or t.stride() == dense_strides(t):  # the first, the common case, at little cost
        return t
    return t.clone(memory_format=torch.preserve_format)


def rebuild(spec: ValueSpec, tensors: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    """The value of layout ``spec`` made of ``tensors``, each in the strides of its spec (``laid_out``)."""
    if spec.is_tuple:
        return tuple(laid_out(t, s) for t, s in zip(tensors, spec.tensors))
    return laid_out(tensors[0], spec.tensors[0])


def check_like(value: object, expected: ValueSpec, what: str) -> None:
    """Raise a ValueError naming ``what`` and both layouts if ``value`` is not of ``expected``."""
    if not expected.is_tuple and isinstance(value, Tensor):  # the common case, without making a spec
        (spec,) = expected.tensors
        if value.shape == spec.shape and value.dtype == spec.dtype:
            return
    got = spec_of(value, what)
    if got != expected:
        hint = ""
        if _only_batch_differs(got, expected):
            hint = (
                "; only the first (batch) dimension differs, as in the short last batch of a "
                "torch.utils.data.DataLoader: pass DataLoader(..., drop_last=True), or stream batches of one size"
            )
        raise ValueError(
            f"{what} is {got}, but the first one was {expected}: every value at this point "
            f"of a stream must have the shape and dtype of the first{hint}"
        )


def _only_batch_differs(got: ValueSpec, expected: ValueSpec) -> bool:
    """Whether ``got`` is ``expected`` but for the first dimension of some of its tensors."""
    if got.is_tuple != expected.is_tuple or len(got.tensors) != len(expected.tensors):
        return False
    return all(
        g.dtype == e.dtype and len(g.shape) == len(e.shape) >= 1 and g.shape[1:] == e.shape[1:]
        for g, e in zip(got.tensors, expected.tensors)
    )


def nonfinite(value: Tensor | tuple[Tensor, ...]) -> str | None:
    """Where ``value`` holds NaN or an infinity, in words (its first such entry); None if nowhere.

    Only floating-point and complex tensors are looked at: other dtypes cannot hold such values.
    """
    tensors = as_tensors(value, "value")
    for k, t in enumerate(tensors):
        if not is_float(t) or _all_finite(t):
            continue
        bad = ~torch.isfinite(t)
        count = int(bad.sum())
        first = tuple(int(j) for j in bad.nonzero()[0])
        which = f"tensor {k}" if len(tensors) > 1 else "it"
        plural = "s" if count > 1 else ""
        return f"{which} has {count} non-finite value{plural}, the first {t[first].item()} at index {first}"
    return None


def _all_finite(t: Tensor) -> bool:
    """Whether every entry of the floating-point or complex ``t`` is finite.

    A sum is finite only if every entry is (a NaN or an infinity makes it NaN or infinite), and it
    is many times cheaper than ``isfinite`` over the whole tensor; only a sum that overflowed from
    finite entries needs the entry-by-entry look."""
    total = t.sum().item()
    if cmath.isfinite(total):
        return True
    return bool(torch.isfinite(t).all())


def is_float(t: TensorSpec | Tensor) -> bool:
    """Whether gradients flow through this tensor (floating point or complex)."""
    return t.dtype.is_floating_point or t.dtype.is_complex


def copy_tensors(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists and tuples) replaced by a detached copy."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: copy_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copy_tensors(v) for v in value)
    return value

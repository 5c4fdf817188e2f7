"""Whether a balance can cut a model.

``check_balance`` promises that a balance it accepts cuts the model into contiguous, non-empty
stages that keep tied tensors together (or is ``"auto"``: the planner chooses the depth too);
``is_int`` is the int test every balance check shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Literal, TypeGuard

from torch import nn

from .ties import check_ties

AUTO: Literal["auto"] = "auto"
"""The balance that lets the planner choose the number of stages as well as the cut."""

Balance = int | Sequence[int] | Literal["auto"]
"""A balance: a number of stages, the layers of each stage, or ``"auto"``."""


def check_balance(model: nn.Sequential, balance: Balance) -> None:
    """Raise a TypeError or ValueError naming the actual values unless ``balance`` cuts ``model``.

    ``balance`` is either a number of stages D (1 <= D <= len(model)), or the number of layers
    of each stage: positive ints summing to ``len(model)``, or ``"auto"`` (any model with layers
    can be cut so; any other string is refused). A bool is not taken for an int.

    No stage may be cut off from another that holds the same parameter or buffer (see
    ``ties.check_ties``): a list balance that does so is refused, naming the tensor, both stages
    and a balance that keeps them together; a number of stages D only if no cut into D stages
    avoids it.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential, got {type(model).__name__}; wrap it: nn.Sequential(model)")
    n = len(model)
    if n == 0:
        raise ValueError("model is an empty nn.Sequential: there are no layers to cut into stages")
    if isinstance(balance, str):
        if balance != AUTO:
            raise ValueError(
                f"unknown balance {balance!r}: give {AUTO!r} (the number of stages chosen by timing), "
                "a number of stages (e.g. 2) or the layers of each stage (e.g. [2, 3])"
            )
        return
    if is_int(balance):
        if balance < 1:
            raise ValueError(
                f"cannot cut {n} layers into {balance} stages: there must be at least one stage "
                f"(balance: {balance}, layers: {n})"
            )
        if balance > n:
            raise ValueError(
                f"cannot cut {n} layers into {balance} stages: a stage needs at least one layer "
                f"(balance: {balance}, layers: {n})"
            )
        check_ties(model, balance)
        return
    if not isinstance(balance, Sequence) or isinstance(balance, (str, bytes)):
        raise TypeError(
            f"balance must be {AUTO!r}, an int (the number of stages) or a sequence of ints (layers per "
            f"stage), got {type(balance).__name__} ({balance!r})"
        )
    if len(balance) == 0:
        raise ValueError(f"balance is empty: give at least one stage (balance: [], layers: {n})")
    for i, b in enumerate(balance):
        if not is_int(b):
            raise TypeError(
                f"balance must hold ints, got {type(b).__name__} ({b!r}) at index {i} (balance: {list(balance)!r})"
            )
    for i, b in enumerate(balance):
        if b < 1:
            raise ValueError(f"every stage needs at least one layer, got {b} at index {i} (balance: {_ints(balance)})")
    if sum(balance) != n:
        raise ValueError(
            "balance and number of layers differ "
            f"(layers: {n}, sum of balance: {sum(balance)}, balance: {_ints(balance)})"
        )
    check_ties(model, balance)


def is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _ints(balance: Sequence[int]) -> list[int]:
    return [int(b) for b in balance]

"""Optimizers for learning under delay that torch does not hold as one optimizer.

``MuonWithAdamW`` steps a model's matrices with ``torch.optim.Muon`` and every other parameter with
``torch.optim.AdamW``, as torch's documentation of Muon recommends, inside ONE
``torch.optim.Optimizer``: what a pipeline stage's optimizer factory must return (each stage makes
its own optimizer of its own parameters, and a stage may hold only biases, or only convolutions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["MuonWithAdamW"]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the matrices, AdamW for the rest, as one optimizer.

    A parameter with two dimensions or more is a matrix: a ``Linear`` weight as it is, a
    convolution kernel ``(out, in, k, k)`` seen as the ``(out, in·k·k)`` matrix of its filters
    (a view of the same memory: Muon steps the kernel itself). Those are stepped by
    ``torch.optim.Muon`` (momentum ``momentum``, Nesterov, ``adjust_lr_fn``; the default
    ``"match_rms_adamw"`` scales each matrix's step to the size of an AdamW step, so that one ``lr``
    suits both); the others (biases, norms' scales) by ``torch.optim.AdamW`` (``betas``, ``eps``).
    Both decay the weights by ``lr · weight_decay`` per step, decoupled (default 0, as
    ``torch.optim.Adam``). ``param_groups`` holds the matrices' group first, then the rest's (a
    group with no parameter is left out): an lr set there (by a schedule) is the one each step uses.

    ``params`` are the parameters, or ``(name, parameter)`` pairs as a pipeline's stage hands them
    (and ``model.named_parameters()`` gives them). ``step`` is exactly Muon's step of the matrices
    and AdamW's of the rest; ``state_dict`` holds both optimizers' states and ``load_state_dict``
    restores them exactly. A ValueError if ``params`` holds a parameter group (a dict): pass the
    parameters themselves.
    """

    def __init__(
        self,
        params: Iterable[Tensor | tuple[str, Tensor]],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adjust_lr_fn: str = "match_rms_adamw",
    ):
        given = list(params)
        if any(isinstance(p, dict) for p in given):
            raise ValueError(
                "MuonWithAdamW takes the parameters themselves (e.g. model.parameters() or "
                "model.named_parameters()), not parameter groups: it groups them itself, the matrices for "
                "Muon and the rest for AdamW"
            )
        tensors = [p[1] if isinstance(p, tuple) else p for p in given]
        matrices = [p for p in tensors if p.dim() >= 2]
        rest = [p for p in tensors if p.dim() < 2]
        # its groups hold what it was given, named or not, as torch's own optimizers' do
        given_matrices = [g for g, p in zip(given, tensors) if p.dim() >= 2]
        given_rest = [g for g, p in zip(given, tensors) if p.dim() < 2]
        muon_settings: dict[str, Any] = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn=adjust_lr_fn
        )
        adamw_settings: dict[str, Any] = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        groups = [
            {"params": ps, **s} for ps, s in ((given_matrices, muon_settings), (given_rest, adamw_settings)) if ps
        ]
        super().__init__(groups, dict(lr=lr, weight_decay=weight_decay))
        # Muon takes 2-D tensors only: each matrix is given as a 2-D view of its own memory.
        self.views = [p.detach().view(p.shape[0], -1) for p in matrices]
        self.muon = torch.optim.Muon(self.views, **muon_settings) if matrices else None
        self.adamw = torch.optim.AdamW(rest, **adamw_settings) if rest else None

    def inner(self) -> list[tuple[dict[str, Any], torch.optim.Optimizer]]:
        """Each group of ``param_groups`` with the optimizer that steps it."""
        optimizers = [o for o in (self.muon, self.adamw) if o is not None]
        return list(zip(self.param_groups, optimizers))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of Muon on the matrices and of AdamW on the rest, each with its group's settings."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices = self.param_groups[0]["params"] if self.muon is not None else []
        for view, p in zip(self.views, matrices):
            view.grad = None if p.grad is None else p.grad.reshape(view.shape)
        for group, optimizer in self.inner():
            own = optimizer.param_groups[0]
            for key in own:
                if key not in ("params", "param_names") and key in group:
                    own[key] = group[key]
            optimizer.step()
        for view in self.views:
            view.grad = None
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The groups' settings and both optimizers' states."""
        return {
            "param_groups": super().state_dict()["param_groups"],
            "muon": None if self.muon is None else self.muon.state_dict(),
            "adamw": None if self.adamw is None else self.adamw.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` gave: a ValueError if it is of another ``MuonWithAdamW``'s
        parameters (other groups, other sizes)."""
        if set(state_dict) != {"param_groups", "muon", "adamw"}:
            raise ValueError(
                f"not a MuonWithAdamW state (keys {sorted(state_dict)}); load one that MuonWithAdamW.state_dict() gave"
            )
        for name, optimizer in (("muon", self.muon), ("adamw", self.adamw)):
            if (optimizer is None) != (state_dict[name] is None):
                raise ValueError(
                    f"the state is of another MuonWithAdamW: its {name} part does not fit these parameters"
                )
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        if self.muon is not None:
            self.muon.load_state_dict(state_dict["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["adamw"])

"""The models and the camera's loss that fidelity's streams learn, and an even cut of them.

``digits_model`` and ``camera_model`` promise a fresh, randomly initialised ``nn.Sequential``
on each call; ``model_of`` names which of them a stream learns with; ``even_balance`` the most
even layers per stage.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn


class Carry(nn.Module):
    """Applies ``module`` to the first tensor of a tuple and carries the others along."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return (self.module(value[0]), *value[1:])


def next_frame_error(output: tuple[Tensor, Tensor]) -> Tensor:
    """The camera's loss: the predicted frame against the next frame that travelled beside it."""
    predicted, actual = output
    return nn.functional.mse_loss(predicted, actual)


def digits_model() -> nn.Sequential:
    """A small CNN for 24 × 24 digits, ten top-level layers."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 6 * 6, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def camera_model() -> nn.Sequential:
    """A small convolutional next-frame predictor for 3 × 16 × 16 frames, eight layers."""
    layers = [
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 3, 3, padding=1),
        nn.Sigmoid(),
    ]
    return nn.Sequential(*(Carry(layer) for layer in layers))


def model_of(stream: str) -> str:
    """The model a stream is learnt with: ``"camera"``, or ``"digits"`` (also for the shuffled control)."""
    return "camera" if stream == "camera" else "digits"


def model_named(model: str) -> nn.Sequential:
    """A new model of ``model_of``'s name: ``camera_model()`` for ``"camera"``, else ``digits_model()``."""
    return camera_model() if model == "camera" else digits_model()


def loss_named(model: str) -> Any:
    """The loss the model of ``model_of``'s name learns with: ``next_frame_error`` for the camera,
    cross-entropy for the digits."""
    return next_frame_error if model == "camera" else nn.CrossEntropyLoss()


def even_balance(layers: int, depth: int) -> list[int]:
    """Layers per stage, as even as possible, the larger stages first."""
    base, extra = divmod(layers, depth)
    return [base + (i < extra) for i in range(depth)]

"""Small models and streams shared by the tests (importable by stage processes)."""

import torch
from torch import nn


class Pair(nn.Module):
    """Returns a tuple: the input and its square (an activation made of two tensors)."""

    def forward(self, x):
        return x, x * x


class Join(nn.Module):
    """Takes the tuple of ``Pair`` back to one tensor."""

    def forward(self, pair):
        a, b = pair
        return torch.cat([a, b], dim=-1)


def mlp(width=8, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.ReLU(inplace=True),
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3),
    )


def classification_stream(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, generator=gen), torch.randint(0, 3, (n, 2), generator=gen)


def reconstruction_loss(output):
    """An unsupervised loss: it takes the output only."""
    return (output ** 2).mean()

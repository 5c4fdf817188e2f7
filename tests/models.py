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
        nn.Linear(6, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.ReLU(inplace=True),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, 3),
    )


def classification_stream(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, generator=gen), torch.randint(0, 3, (n, 2), generator=gen)


def reconstruction_loss(output):
    """An unsupervised loss: it takes the output only."""
    return (output**2).mean()


def conv_net(seed=0):
    """Two 3x3 convolutions and a classifier of 3 classes, for frames of shape (1, 3, 8, 8)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 8 * 8, 3)
    )


CONV_BALANCES = {2: [2, 3], 3: [1, 2, 2]}


def strided_frames(n, seed=0):
    """``n`` frames of shape (1, 3, 8, 8) that are not contiguous (channels last, seen through a
    permute: a convolution computes them in other bits than their contiguous copies), and labels."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, 8, 8, 3, generator=gen).permute(0, 3, 1, 2) for _ in range(n)]
    ys = [torch.randint(3, (1,), generator=gen) for _ in range(n)]
    return xs, ys


def scaled_loss(out, target):
    """Cross-entropy times a scale that comes with the target: an infinite scale, an infinite loss."""
    y, scale = target
    return nn.functional.cross_entropy(out, y) * scale.sum()


def nonfinite_stream(n, holes=(), infinite=()):
    """``n`` samples; those in ``holes`` have a NaN input, those in ``infinite`` an infinite loss."""
    xs, ys = classification_stream(n)
    scales = torch.ones(n, 1)
    for s in holes:
        xs[s, 0, 2] = float("nan")
    for s in infinite:
        scales[s] = float("inf")
    return list(xs), list(zip(ys, scales))


class CountedForward(nn.Module):
    """A traceable module that counts the runs of its own forward outside the model (on its class):
    a traced graph runs none of them."""

    runs = 0

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        type(self).runs += 1
        return self.b(torch.tanh(self.a(x)))

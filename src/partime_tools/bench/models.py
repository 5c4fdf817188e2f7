"""The models ``partime bench --sizes`` can stream, by name (``--model``).

``conv`` is ``conv3_net``, an ``nn.Sequential`` cut between its blocks (``conv_net``, its 5x5
sibling, is the model of ``partime bench`` and of the demo); ``resnet`` is a
ResNet-style network, a module of its own that partime traces (``partime.internals.layers_of``) and cuts
between the nodes of its graph, with its shortcuts crossing the cuts. Each factory takes
``(layers, channels, classes=, seed=)`` and builds the same model from the same seed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def conv_net(layers: int = 12, channels: int = 32, *, classes: int | None = None, seed: int = 0) -> nn.Sequential:
    """A stem and ``layers`` blocks of 5x5 convolution + ReLU at ``channels`` channels, on RGB frames.

    With ``classes``, a head (global average pool, linear layer to ``classes`` logits) is appended.
    The convolutions are He-initialised; the weights depend only on ``seed`` (and the sizes), not
    on the global random state.
    """
    return _conv_stack(5, layers, channels, classes, seed)


def conv3_net(layers: int = 8, channels: int = 24, *, classes: int | None = None, seed: int = 0) -> nn.Sequential:
    """The family of ``partime bench --sizes``: ``conv_net`` with 3x3 convolutions, by default a stem
    and 8 blocks at 24 channels, whose stage time grows with the frame size alone."""
    return _conv_stack(3, layers, channels, classes, seed)


def _conv_stack(kernel: int, layers: int, channels: int, classes: int | None, seed: int) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pad = kernel // 2
        blocks = [nn.Sequential(nn.Conv2d(3, channels, kernel, padding=pad), nn.ReLU())]
        blocks += [nn.Sequential(nn.Conv2d(channels, channels, kernel, padding=pad), nn.ReLU()) for _ in range(layers)]
        if classes is not None:
            blocks.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)))
        model = nn.Sequential(*blocks)
        # He initialisation: with PyTorch's default, a frame's signal fades by about 2.5x per
        # block and a deep stack outputs little more than its biases, which no stream can teach.
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                if module.bias is not None:  # always: bias=True
                    nn.init.zeros_(module.bias)
    return model


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and ReLU, added to a shortcut: the identity, or, where
    the block changes the channels or strides, a 1x1 convolution with BatchNorm (a projection)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A stem (3x3 convolution, BatchNorm, ReLU) and ``blocks`` ``BasicBlock`` layers of ``channels``
    channels, the block halfway with stride 2 and twice the channels (a projection shortcut), then
    global average pooling and, with ``classes``, a linear head."""

    def __init__(self, blocks: int, channels: int, classes: int | None):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, 1, 1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        layers, width = [], channels
        for i in range(blocks):
            wider = 2 * channels if i == blocks // 2 else width
            layers.append(BasicBlock(width, wider, stride=2 if wider != width else 1))
            width = wider
        self.blocks = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, classes) if classes is not None else None

    def forward(self, x: Tensor) -> Tensor:
        x = torch.flatten(self.pool(self.blocks(self.stem(x))), 1)
        return self.head(x) if self.head is not None else x


def resnet(layers: int = 8, channels: int = 24, *, classes: int | None = None, seed: int = 0) -> nn.Module:
    """``ResNet(layers, channels, classes)`` from ``seed`` (He initialisation, as ``conv3_net``), in
    eval mode for inference (no ``classes``: BatchNorm uses its statistics), in train mode to learn."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResNet(layers, channels, classes)
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    return model.train(classes is not None)


MODELS: dict[str, Callable[..., nn.Module]] = {"conv": conv3_net, "resnet": resnet}
"""The bench's models by ``--model`` name; ``conv`` is the default."""

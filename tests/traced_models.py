"""Models that are not an nn.Sequential, for the tests of traced models (importable by stage processes)."""

import torch
import torch.fx
from torch import nn


class BasicBlock(nn.Module):
    """ResNet's block: two 3x3 convolutions with BatchNorm, added to an identity or projection shortcut."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A stem, a block with an identity shortcut, one with a strided projection, pooling, a linear head."""

    def __init__(self, channels=4, classes=3):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.layer1 = BasicBlock(channels, channels)
        self.layer2 = BasicBlock(channels, 2 * channels, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * channels, classes)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class UNet(nn.Module):
    """Two levels down and up, each level's encoder output joined to the decoder by torch.cat."""

    def __init__(self, c=4):
        super().__init__()
        self.enc1 = nn.Conv2d(3, c, 3, padding=1)
        self.enc2 = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.up2 = nn.ConvTranspose2d(2 * c, 2 * c, 2, stride=2)
        self.dec2 = nn.Conv2d(4 * c, c, 3, padding=1)
        self.up1 = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.dec1 = nn.Conv2d(2 * c, c, 3, padding=1)
        self.head = nn.Conv2d(c, 3, 1)

    def forward(self, x):
        e1 = torch.relu(self.enc1(x))  # 8 x 8
        e2 = torch.relu(self.enc2(self.pool(e1)))  # 4 x 4
        m = torch.relu(self.mid(self.pool(e2)))  # 2 x 2
        d2 = torch.relu(self.dec2(torch.cat([self.up2(m), e2], dim=1)))
        d1 = torch.relu(self.dec1(torch.cat([self.up1(d2), e1], dim=1)))
        return self.head(d1)


# The values that cross each cut position k of the U-Net's layers (before layer k), by hand: e1 (relu)
# crosses every cut from its making to the last concatenation, e2 (relu_1) those to the first.
UNET_NODES = [
    "enc1",
    "relu",
    "pool",
    "enc2",
    "relu_1",
    "pool_1",
    "mid",
    "relu_2",
    "up2",
    "cat",
    "dec2",
    "relu_3",
    "up1",
    "cat_1",
    "dec1",
    "relu_4",
    "head",
]
UNET_CROSSING = {
    1: ("enc1",),
    2: ("relu",),
    3: ("relu", "pool"),
    4: ("relu", "enc2"),
    5: ("relu", "relu_1"),
    6: ("relu", "relu_1", "pool_1"),
    7: ("relu", "relu_1", "mid"),
    8: ("relu", "relu_1", "relu_2"),
    9: ("relu", "relu_1", "up2"),
    10: ("relu", "cat"),
    11: ("relu", "dec2"),
    12: ("relu", "relu_3"),
    13: ("relu", "up1"),
    14: ("cat_1",),
    15: ("dec1",),
    16: ("relu_4",),
}


class EncoderLayer(nn.Module):
    """A pre-norm transformer encoder layer: attention (nn.MultiheadAttention, a leaf) and a
    feed-forward block, each added to a residual."""

    def __init__(self, d=8, heads=2, hidden=16):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, hidden)
        self.ff2 = nn.Linear(hidden, d)

    def forward(self, x):
        h = self.norm1(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + a
        return x + self.ff2(torch.relu(self.ff1(self.norm2(x))))


class Transformer(nn.Module):
    """Tokens of 4 features in, a learnt position embedding (a parameter read by the graph), a stack
    of encoder layers, mean pooling and a classifier."""

    def __init__(self, d=8, layers=2, tokens=5, classes=3):
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.position = nn.Parameter(0.1 * torch.randn(1, tokens, d))
        self.layers = nn.ModuleList(EncoderLayer(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        h = self.embed(x) + self.position
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h).mean(dim=1))


def window_attention(x, mix):
    """Swin's shifted-window step, in small: control flow on the input's shape, which fx cannot
    trace through; kept whole by ``torch.fx.wrap`` below, as torchvision keeps its own."""
    if x.shape[-1] % 2 == 0:  # windows of two columns, shifted by one
        x = torch.roll(x, shifts=1, dims=-1)
    return x + mix(x.transpose(1, -1)).transpose(1, -1)


torch.fx.wrap("window_attention")


class WindowBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.mix = nn.Linear(channels, channels)

    def forward(self, x):
        return torch.relu(window_attention(self.norm(x), self.mix))


class Windowed(nn.Module):
    """A Swin-style network: a patch embedding, blocks whose window step fx cannot trace again
    from partime's graph (the function is kept whole where the model is defined), a head."""

    def __init__(self, channels=6, classes=3):
        super().__init__()
        self.embed = nn.Conv2d(3, channels, 2, stride=2)
        self.blocks = nn.Sequential(WindowBlock(channels), WindowBlock(channels))
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)).mean(dim=(2, 3)))


def make(name, seed=0):
    torch.manual_seed(seed)
    return {"resnet": ResNet, "unet": UNet, "transformer": Transformer, "windowed": Windowed}[name]()


def samples(name, n, seed=0):
    """``n`` samples for model ``name`` and a class label (or, for the U-Net, nothing) for each."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, 5, 4) if name == "transformer" else (1, 3, 8, 8)
    xs = [torch.randn(shape, generator=gen) for _ in range(n)]
    ys = [torch.randint(3, (1,), generator=gen) for _ in range(n)]
    return xs, (None if name == "unet" else ys)


# --- models partime refuses, or cuts with care -------------------------------------------------


class TiedEnds(nn.Module):
    """Weight tying: ``dec`` uses ``enc``'s weight; a head after them that may be cut off."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.dec = nn.Linear(8, 8)
        self.dec.weight = self.enc.weight
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(torch.relu(self.dec(torch.relu(self.enc(x)))))


class ScaledTwice(nn.Module):
    """A parameter of the model itself, read by two nodes (one tensor), and a head after them."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((8,), 0.5))
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x * self.scale)) * self.scale)


class SameTwice(nn.Module):
    """One module called twice: two nodes, one weight."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(torch.relu(self.lin(torch.relu(self.lin(x)))))


class Branchy(nn.Module):
    """Control flow on a tensor's values: fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return -x


class Gate(nn.Module):
    """The branch of ``Branchy``, in a module of its own: a leaf, it need not be traced."""

    def forward(self, x):
        return x if x.sum() > 0 else -x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(self.gate(x)))


class GateLeaf(torch.fx.Tracer):
    """A tracer that keeps ``Gate`` whole."""

    def is_leaf_module(self, m, name):
        return isinstance(m, Gate) or super().is_leaf_module(m, name)


class ClampsItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x.clamp_(-1, 1)
        return self.lin(x)


class RelusItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(self.act(x[0]))


class ReturnsADict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return {"y": self.lin(x)}


class ReturnsAShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y, y.shape[0]


@torch.fx.wrap
def rows(x):
    """The number of rows of ``x``: fx records a call, and cannot tell it gives an int."""
    return int(x.shape[0])


class CarriesAnInt(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        n = rows(x)
        y = torch.relu(self.lin(x))
        return y.reshape(n, -1)


# --- in place, and what fx records otherwise -------------------------------------------------


class KeepsTheOldName(nn.Module):
    """``a += ...`` on a tensor with another name used after it: Python adds in place, so ``keep``
    changes with ``a``; torch.fx records an add that makes a new tensor."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        a = self.l1(x)
        keep = a
        a += self.l2(a)
        return self.l3(a) + keep


class FeatureList(nn.Module):
    """A list of features (DenseNet's habit) whose first is then added into in place."""

    def __init__(self):
        super().__init__()
        self.stem, self.block = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.stem(x)
        features = [y]
        y += self.block(y)
        features.append(y)
        return torch.cat(features, dim=1)


class WritesIntoAView(nn.Module):
    """An in-place write into a tensor that a view made before it still names after it."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        a = self.lin(x)
        flat = a.view(-1)
        a.mul_(2)
        return self.out(a) + flat.sum()


class InPlaceBlock(nn.Module):
    """torchvision's BasicBlock: ``ReLU(inplace=True)``, and ``out += identity`` where ``out``'s old
    value is used nowhere after."""

    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class InPlaceResNet(nn.Module):
    """A stem and two ``InPlaceBlock``, as torchvision writes them, and a head."""

    def __init__(self, c=4, classes=3):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(InPlaceBlock(c), InPlaceBlock(c))
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.layer1(self.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class ScaledQuery(nn.Module):
    """Attention whose query, a chunk of one projection, is scaled in place: the other chunks are
    other memory, so nothing else changes with it."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q *= 0.5
        weights = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return self.out(weights @ v)


class CountsItsCalls(nn.Module):
    """A Python side effect: tracing runs forward once and keeps the count it saw as a constant."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


class Masked(nn.Module):
    """An optional second input, left at its default by the tracer."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask=None):
        y = self.lin(x)
        if mask is not None:
            y = y * mask
        return self.out(y)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        return self.out(self.lin(x) * y)

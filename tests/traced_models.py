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


# --- models with train and eval modes, in the shape of popular vision models ---------------------


class DropNorm(nn.Module):
    """A Linear, Dropout and BatchNorm on a branch added back to its input, and a head: what it
    computes depends on train() and eval() in both."""

    def __init__(self, width=8, out=4):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.drop = nn.Dropout(0.5)
        self.norm = nn.BatchNorm1d(width)
        self.b = nn.Linear(width, width)
        self.head = nn.Linear(width, out)

    def forward(self, x):
        h = self.a(x)
        h = self.norm(self.drop(h)) + h
        return self.head(torch.relu(self.b(h)))


def drop_norm_sequential(width=8, out=4):
    """DropNorm's kind of layers as an nn.Sequential: Linear, Dropout, BatchNorm, ReLU, Linear."""
    return nn.Sequential(
        nn.Linear(width, width),
        nn.Dropout(0.5),
        nn.BatchNorm1d(width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.Dropout(0.25),
        nn.Linear(width, out),
    )


class InvertedResidual(nn.Module):
    """MobileNetV2's block: a 1x1 expansion, a depthwise 3x3 and a 1x1 projection, each with
    BatchNorm (ReLU6 after the first two), added to the input where the shapes allow it."""

    def __init__(self, cin, cout, stride=1, expand=4):
        super().__init__()
        hidden = cin * expand
        self.residual = stride == 1 and cin == cout
        self.conv = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x):
        return x + self.conv(x) if self.residual else self.conv(x)


class MobileNetV2Like(nn.Module):
    """A stem, inverted residual blocks (one strided), pooling, Dropout and a classifier."""

    def __init__(self, classes=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True))
        self.blocks = nn.Sequential(InvertedResidual(8, 8), InvertedResidual(8, 12, stride=2), InvertedResidual(12, 12))
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(12, classes))

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class StochasticDepth(nn.Module):
    """torchvision's stochastic depth, by rows: in training, each sample's branch is dropped with
    probability ``p`` (and the others scaled up); in eval, the branch as it is."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        noise = torch.empty([x.shape[0]] + [1] * (x.dim() - 1), dtype=x.dtype, device=x.device).bernoulli_(keep)
        return x * noise.div_(keep)


class SqueezeExcitation(nn.Module):
    """Channel weights from the pooled input: reduce, SiLU, expand, sigmoid, multiplied in."""

    def __init__(self, channels, squeezed):
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x):
        scale = nn.functional.adaptive_avg_pool2d(x, 1)
        scale = torch.sigmoid(self.expand(nn.functional.silu(self.reduce(scale))))
        return x * scale


class MBConv(nn.Module):
    """EfficientNet's block: expansion, depthwise convolution, squeeze-excitation and projection,
    with BatchNorm and SiLU, and stochastic depth on the residual branch."""

    def __init__(self, cin, cout, expand=4, p=0.2):
        super().__init__()
        hidden = cin * expand
        self.expand = nn.Sequential(nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.SiLU())
        self.depthwise = nn.Sequential(
            nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.SiLU()
        )
        self.se = SqueezeExcitation(hidden, max(1, cin // 4))
        self.project = nn.Sequential(nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = cin == cout
        self.drop = StochasticDepth(p)

    def forward(self, x):
        h = self.project(self.se(self.depthwise(self.expand(x))))
        return x + self.drop(h) if self.residual else h


class EfficientNetLike(nn.Module):
    """A stem with BatchNorm and SiLU, MBConv blocks, a 1x1 head, pooling, Dropout and a classifier."""

    def __init__(self, classes=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.blocks = nn.Sequential(MBConv(8, 8), MBConv(8, 12), MBConv(12, 12))
        self.head = nn.Sequential(nn.Conv2d(12, 16, 1, bias=False), nn.BatchNorm2d(16), nn.SiLU())
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(self.drop(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)))


class ViTBlock(nn.Module):
    """A pre-norm vision transformer block: LayerNorm, attention with Dropout, LayerNorm, an MLP
    with GELU and Dropout, each added to a residual."""

    def __init__(self, d=8, heads=2, hidden=16, p=0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.drop1 = nn.Dropout(p)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(p), nn.Linear(hidden, d), nn.Dropout(p))

    def forward(self, x):
        h = self.norm1(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + self.drop1(a)
        return x + self.mlp(self.norm2(x))


class ViTLike(nn.Module):
    """Patches by a strided convolution, a class token and position embedding, Dropout, two blocks,
    a final LayerNorm and a head on the class token."""

    def __init__(self, d=8, classes=3, patches=16):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 2, stride=2)
        self.cls = nn.Parameter(0.1 * torch.randn(1, 1, d))
        self.position = nn.Parameter(0.1 * torch.randn(1, patches + 1, d))
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(ViTBlock(d), ViTBlock(d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], dim=1)
        h = self.blocks(self.drop(tokens + self.position))
        return self.head(self.norm(h)[:, 0])


class DenseLayer(nn.Module):
    """DenseNet's layer: BatchNorm, ReLU, a 1x1 bottleneck, BatchNorm, ReLU, a 3x3 convolution; its
    output is concatenated to its input."""

    def __init__(self, cin, growth=4):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, 2 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(2 * growth)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.conv1(torch.relu(self.norm1(x)))
        h = self.drop(self.conv2(torch.relu(self.norm2(h))))
        return torch.cat([x, h], dim=1)


class DenseNetLike(nn.Module):
    """A stem, a dense block of three layers, a transition (BatchNorm, ReLU, 1x1, average pooling),
    a final BatchNorm and a classifier."""

    def __init__(self, classes=3):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.block = nn.Sequential(DenseLayer(6), DenseLayer(10), DenseLayer(14))
        self.transition = nn.Sequential(nn.BatchNorm2d(18), nn.ReLU(), nn.Conv2d(18, 8, 1, bias=False), nn.AvgPool2d(2))
        self.norm = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        x = torch.relu(self.norm(self.transition(self.block(self.stem(x)))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def with_statistics(model, seed=0):
    """``model`` with every BatchNorm's running statistics (and affine weights) set to values of its
    own, far from their fresh 0 and 1: a BatchNorm in eval() then computes what no fresh one does."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            n = module.num_features
            module.running_mean.copy_(torch.rand(n, generator=gen) - 0.5)
            module.running_var.copy_(0.5 + torch.rand(n, generator=gen))
            module.num_batches_tracked.fill_(7)
            with torch.no_grad():
                module.weight.copy_(0.5 + torch.rand(n, generator=gen))
                module.bias.copy_(torch.rand(n, generator=gen) - 0.5)
    return model


def add_one(module, args, output):
    """A forward hook that changes what its module gives."""
    return output + 1


def doubled_input(module, args):
    """A forward-pre hook that changes what its module is given."""
    return (2 * args[0],)

"""EfficientNet-B0 learning online at D = 2 with ``compensation=()``: is its NaN the delay, or partime?

Question. torchvision's ``efficientnet_b0`` (random weights, no dropout, 64 x 64 inputs, batch 1,
cross-entropy on random classes, SGD lr 0.01) learning in a ``Pipeline`` at D = 2 with
``compensation=()`` gets a NaN loss within its first ten samples on some seeds, where the plain
online loop (forward, loss, backward, step, one sample at a time) over the same samples, and the
pipeline with ``compensation="auto"``, stay finite. Is it the delay, or a bug in partime?

Answer. Not a bug in partime's code, and not the delay as such: it is the ``graph-stash`` product
(the default grad mode) on a BatchNorm network, as SPEC.md defines it.

- partime computes what SPEC.md says: a delayed loop written by hand in plain torch
  (``reference``: stage 0 keeps each sample's graph and, two ticks later, back-propagates the late
  gradient through it, reading its weights as they are at that tick) gives the inline pipeline's losses
  to the bit, NaN included, and the thread and process executors give the inline one's. At D = 1
  every grad mode, with and without compensation, is the plain loop to the bit.
- The delay alone does not diverge: with the same delay, step size and no compensation, ``stash``
  and ``weight-stash`` stay finite on every seed where ``graph-stash`` diverges (4 of 24 seeds,
  first NaN loss at sample 6 to 8; seed 16: sample 6).
- ``graph-stash``'s product mixes the forward's saved BatchNorm statistics (the batch mean and
  1/sigma of a batch of one, taken with the weights *then*) with the weights *now*. Behind a
  convolution a BatchNorm divides out the scale of its weights, so the exact backward has two
  factors that cancel: W^T on one side, 1/sigma(W x) on the other. Mixed, each conv+BN pair
  multiplies the gradient going back by about sigma_now / sigma_then, and stage 0 of this cut
  chains 26 of them. SGD's first steps at lr 0.01 are large (gradient norms in the hundreds at
  batch 1, on 2 x 2 and 4 x 4 maps), so the product of those ratios is 11.6 after one step, 6e4
  after two and 3e26 after three, and stage 0's gradient norm runs 394, 2.7e3, 1.6e7, 7.8e27,
  then NaN (the stem convolution's weight gradient, the far end of the chain, is inf first). With
  the same weights now and the same late gradients, the ``stash`` product (the sample forward
  again) is 133, 80 and 48 at ticks 3 to 5, and the ``weight-stash`` one 185, 167 and 87. A large
  step makes the next ratio larger: positive feedback. Once stage 0's weights are NaN, the next
  sample's loss is NaN.
- ``compensation="auto"`` (step-scale divides stage 0's step by 3 at D = 2, and delay-correction)
  and lr 0.001 stay finite at these seeds. The default is not immune: at lr 0.03, where the plain
  loop, ``stash`` and ``weight-stash`` (both with ``"auto"``) stay finite, ``graph-stash`` with
  ``"auto"`` diverges on seed 18.

What changed after it. A delayed stage that holds a normalisation layer using its input's
statistics now forms its products under ``graph-stash`` as ``weight-stash`` does
(``partime.core.stage.kept_graph.normalisation_in``; SPEC.md, "Learning: loss and backward"). The
figures in ``experiments/learning/efficientnet_delay.txt`` were made at commit 1a4e80b, before that: run on a later
commit, partime's ``graph-stash`` rows are its ``weight-stash`` rows, and no longer the
hand-written ``graph-stash`` reference's.

Run: ``.venv/bin/python experiments/learning/efficientnet_delay.py`` from the repository root (about 15 minutes
on two busy cores). It prints its findings and writes them to ``experiments/learning/efficientnet_delay.txt``.
The model is torchvision's ``efficientnet_b0(dropout=0.0)`` written out in plain torch (the
torchvision wheels here are CUDA builds): the same modules, forward, stochastic depth ("row",
rate 0.2 scaled by block index) and initialisation, 5,288,548 parameters.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import sys

import torch
from torch import Tensor, fx, nn
from torch.autograd.graph import saved_tensors_hooks

from partime import Pipeline

# -- torchvision's efficientnet_b0, in plain torch ------------------------------------------------


def stochastic_depth(input: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    """torchvision.ops.stochastic_depth: zero the residual branch of a row with probability p."""
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


fx.wrap("stochastic_depth")  # as torchvision does: a leaf of the traced graph


class StochasticDepth(nn.Module):
    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, input: Tensor) -> Tensor:
        return stochastic_depth(input, self.p, self.mode, self.training)


class Conv2dNormActivation(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel_size: int = 3, stride: int = 1, groups: int = 1, act: bool = True):
        padding = (kernel_size - 1) // 2
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        if act:
            layers.append(nn.SiLU(inplace=True))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.SiLU(inplace=True)
        self.scale_activation = nn.Sigmoid()

    def forward(self, input: Tensor) -> Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(input)))))
        return scale * input


class MBConv(nn.Module):
    def __init__(self, expand: int, kernel: int, stride: int, cin: int, cout: int, sd_prob: float):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        expanded = cin * expand
        layers: list[nn.Module] = []
        if expanded != cin:
            layers.append(Conv2dNormActivation(cin, expanded, kernel_size=1))
        layers.append(Conv2dNormActivation(expanded, expanded, kernel, stride, groups=expanded))
        layers.append(SqueezeExcitation(expanded, max(1, cin // 4)))
        layers.append(Conv2dNormActivation(expanded, cout, kernel_size=1, act=False))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(sd_prob, "row")

    def forward(self, input: Tensor) -> Tensor:
        result = self.block(input)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += input
        return result


B0 = [  # expand, kernel, stride, in, out, repeats
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
]


class EfficientNet(nn.Module):
    def __init__(self, dropout: float = 0.0, stochastic_depth_prob: float = 0.2, num_classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = [Conv2dNormActivation(3, 32, kernel_size=3, stride=2)]
        total, block_id = sum(row[5] for row in B0), 0
        for expand, kernel, stride, cin, cout, repeats in B0:
            stage = []
            for k in range(repeats):
                sd_prob = stochastic_depth_prob * float(block_id) / total
                stage.append(MBConv(expand, kernel, stride if k == 0 else 1, cin if k == 0 else cout, cout, sd_prob))
                block_id += 1
            layers.append(nn.Sequential(*stage))
        layers.append(Conv2dNormActivation(320, 1280, kernel_size=1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True), nn.Linear(1280, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                init_range = 1.0 / math.sqrt(m.out_features)
                nn.init.uniform_(m.weight, -init_range, init_range)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


# -- the runs --------------------------------------------------------------------------------------

LR = 0.01
MODES = ("graph-stash", "stash", "weight-stash")
BALANCE = [133, 116]  # the cut balance=2 picked here: before the BatchNorm of block 5.0's projection
BOUNDARY = "features_5_0_block_3_0"  # the value crossing it: that projection convolution's output
loss_fn = nn.CrossEntropyLoss()


def data(seed: int, n: int) -> tuple[EfficientNet, list[Tensor], list[Tensor]]:
    """The model (made right after ``torch.manual_seed(seed)``, in train mode) and n samples and
    targets, drawn from generators of their own so that a run of n samples is a prefix of a longer one."""
    g = torch.Generator().manual_seed(1000 + seed)
    xs = [torch.randn(1, 3, 64, 64, generator=g) for _ in range(n)]
    g = torch.Generator().manual_seed(2000 + seed)
    ys = [torch.randint(0, 1000, (1,), generator=g) for _ in range(n)]
    torch.manual_seed(seed)
    return EfficientNet().train(), xs, ys


def plain(seed: int, n: int, lr: float = LR) -> list[float]:
    """The plain online loop: forward, loss, backward, step, one sample at a time."""
    model, xs, ys = data(seed, n)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in zip(xs, ys):
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def piped(seed: int, n: int, depth: int = 2, lr: float = LR, executor: str = "inline", **kw) -> list[float]:
    """partime's pipeline over the same samples (made right after the model, as the plain loop starts)."""
    model, xs, ys = data(seed, n)
    kw.setdefault("compensation", ())
    balance = BALANCE if depth == 2 else [sum(BALANCE)]
    pipe = Pipeline(
        model,
        balance,
        loss_fn=loss_fn,
        optimizer=lambda p: torch.optim.SGD(p, lr=lr),
        executor=executor,
        sample=xs[0],
        threads=1,
        nonfinite="skip",  # a NaN loss is reported in its result and not learnt from; "raise" stops there
        **kw,
    )
    with pipe:
        return [r.loss for r in pipe.stream(zip(xs, ys))]


def derived(origin: Tensor, stage: int) -> Tensor:
    """The random state of stage ``stage`` > 0, as partime derives it from the pipeline's (SPEC.md,
    "Random and stateful layers"): stochastic depth's draws in stage 1 come from it."""
    digest = hashlib.sha256(origin.numpy().tobytes() + stage.to_bytes(8, "little")).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return generator.get_state()


def stages(model: EfficientNet) -> tuple[nn.Sequential, nn.Sequential]:
    """The model cut at ``BOUNDARY``, by hand: block 5.0 has no residual, so its children compose."""
    block = model.features[5][0].block
    first = nn.Sequential(*model.features[:5], block[0], block[1], block[2], block[3][0])
    rest = [block[3][1], *model.features[5][1:], *model.features[6:], model.avgpool, nn.Flatten(1), model.classifier]
    return first, nn.Sequential(*rest)


def reference(seed: int, n: int, lr: float = LR, probe=None) -> list[float]:
    """D = 2, grad mode graph-stash, no compensation, in plain torch: at tick t stage 0 runs sample
    t forward and keeps its graph, stage 1 runs sample t-1 forward, its loss, backward and step,
    and stage 0 back-propagates sample t-2's gradient (sent by stage 1 at tick t-1) through that
    sample's kept graph, reading its weights as they are now, and steps. ``probe(t, s, ...)`` is
    called before each of stage 0's steps."""
    model, xs, ys = data(seed, n)
    s0, s1 = stages(model)
    random = [torch.get_rng_state(), derived(torch.get_rng_state(), 1)]  # stage 0 continues the caller's
    opt0, opt1 = torch.optim.SGD(s0.parameters(), lr=lr), torch.optim.SGD(s1.parameters(), lr=lr)
    kept: dict[int, tuple[Tensor, Tensor, dict]] = {}
    losses, sent, back = [], None, None

    def drawing(i, f, *args):  # f(*args) with stage i's random stream
        outer = torch.get_rng_state()
        torch.set_rng_state(random[i])
        try:
            return f(*args)
        finally:
            random[i] = torch.get_rng_state()
            torch.set_rng_state(outer)

    def step(opt, params, grads):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)

    for t in range(n + 2):
        to_send = to_back = None
        if t < n:  # identity hooks: autograd then does not refuse the weights a step changed since
            then = (random[0].clone(), copy.deepcopy(s0.state_dict()))
            with saved_tensors_hooks(lambda x: x, lambda x: x):
                out = drawing(0, s0, xs[t].clone())
            kept[t] = (out, *then)
            to_send = out.detach()
        if sent is not None:
            a = sent.clone().requires_grad_()
            loss = drawing(1, lambda a, y: loss_fn(s1(a), y), a, ys[t - 1])
            losses.append(loss.item())
            if math.isfinite(losses[-1]):  # as nonfinite="skip": no step, no gradient sent back
                grads = torch.autograd.grad(loss, [*s1.parameters(), a])
                step(opt1, s1.parameters(), grads[:-1])
                to_back = (t - 1, grads[-1])
            else:
                kept.pop(t - 1)
        if back is not None:
            s, delta = back
            out, state, weights = kept.pop(s)
            grads = torch.autograd.grad(out, list(s0.parameters()), delta)
            if probe is not None:
                probe(t, s, s0, xs[s], delta, grads, state, weights)
            step(opt0, s0.parameters(), grads)
        sent, back = to_send, to_back
    return losses


class Products:
    """Stage 0's product of each late gradient, three ways: graph-stash (what it applies), stash
    (the sample forward again with the weights now) and weight-stash (with the weights it went
    forward with), and how much each BatchNorm's input scale sigma grew between the two forwards."""

    def __init__(self):
        self.rows = []

    def __call__(self, t, s, s0, x, delta, grads, state, weights):
        names = [name for name, _ in s0.named_parameters()]
        now, sig_now = self._product(s0, None, x, state, delta)
        then, sig_then = self._product(s0, weights, x, state, delta)
        ratios = [(a / b).median().item() for a, b in zip(sig_now, sig_then)]
        stem = names.index("0.0.weight")
        self.rows.append(
            (
                t,
                s,
                delta.norm().item(),
                _norm(grads),
                _norm(now),
                _norm(then),
                grads[stem].norm().item(),
                math.prod(ratios),
                max(ratios),
                len(ratios),
            )
        )

    @staticmethod
    def _product(s0, weights, x, state, delta):
        scratch = copy.deepcopy(s0)  # its buffers are copies: the stage's statistics count each sample once
        if weights is not None:
            scratch.load_state_dict(weights)
        sigmas = []
        for m in scratch.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.register_forward_hook(
                    lambda m, i, o: sigmas.append(i[0].detach().var(dim=(0, 2, 3), unbiased=False).add(m.eps).sqrt())
                )
        outer = torch.get_rng_state()
        torch.set_rng_state(state)  # the draws of the sample's own forward
        out = scratch(x.clone())
        torch.set_rng_state(outer)
        return torch.autograd.grad(out, list(scratch.parameters()), delta), sigmas


def _norm(grads) -> float:
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))


def first_nonfinite(losses: list[float]) -> int | None:
    return next((k for k, v in enumerate(losses) if not math.isfinite(v)), None)


def same(a: list[float], b: list[float]) -> bool:
    """Equal to the bit, NaN equal to NaN."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def shown(losses: list[float], k: int = 12) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in losses[:k]) + (", ...]" if len(losses) > k else "]")


def main() -> None:
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "efficientnet_delay.txt")
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    torch.set_num_threads(1)
    seeds, n = range(24), 12
    main_seed, long_n = 16, 50

    model, xs, _ = data(0, 1)
    say(f"EfficientNet-B0 (torchvision's, in plain torch): {sum(p.numel() for p in model.parameters()):,} parameters")
    with Pipeline(model, 2, executor="inline", loss_fn=loss_fn, optimizer=torch.optim.SGD, sample=xs[0]) as pipe:
        say(f"balance=2 picks {pipe.partition.balance} here; every run below uses {BALANCE}, cut by hand as")
        say(f"{BOUNDARY} (the cut timing picked in an earlier run: it moves with the machine's load)")
        say(pipe.partition.summary())

    say(f"\n1. seeds 0..{seeds[-1]}, {n} samples, D = 2, compensation=(), lr {LR}: first non-finite loss (None: none)")
    say("seed  reference  graph-stash  =ref  stash  weight-stash  auto  plain")
    diverging = []
    for seed in seeds:
        ref = reference(seed, n)
        part = piped(seed, n)
        row = [first_nonfinite(ref), first_nonfinite(part), same(ref, part)]
        if row[0] is not None or row[1] is not None:
            diverging.append(seed)
            row += [first_nonfinite(piped(seed, n, grad_mode=m)) for m in ("stash", "weight-stash")]
            row += [first_nonfinite(piped(seed, n, compensation="auto")), first_nonfinite(plain(seed, n))]
        say(f"{seed:4d}  " + "  ".join(f"{v!s:>5}" for v in row))
    say(f"graph-stash diverges on seeds {diverging}; stash, weight-stash, auto and plain on none of them")

    say(f"\n2. seed {main_seed}, {long_n} samples: the loss per sample")
    runs = {
        "plain loop": plain(main_seed, long_n),
        "reference (by hand)": reference(main_seed, long_n),
        "graph-stash, ()": piped(main_seed, long_n),
        "graph-stash, thread": piped(main_seed, long_n, executor="thread"),
        "graph-stash, process": piped(main_seed, long_n, executor="process"),
        "stash, ()": piped(main_seed, long_n, grad_mode="stash"),
        "weight-stash, ()": piped(main_seed, long_n, grad_mode="weight-stash"),
        "graph-stash, auto": piped(main_seed, long_n, compensation="auto"),
        "plain loop, lr 0.001": plain(main_seed, long_n, lr=0.001),
        "graph-stash, (), lr 0.001": piped(main_seed, long_n, lr=0.001),
    }
    for name, losses in runs.items():
        say(
            f"{name:>26}: first non-finite {first_nonfinite(losses)!s:>4}, mean of finite "
            f"{sum(v for v in losses if math.isfinite(v)) / max(1, sum(map(math.isfinite, losses))):.4f}: {shown(losses)}"
        )
    base = runs["graph-stash, ()"]
    say(
        f"inline == reference to the bit: {same(base, runs['reference (by hand)'])}; "
        f"thread == inline: {same(base, runs['graph-stash, thread'])}; "
        f"process == inline: {same(base, runs['graph-stash, process'])}"
    )

    say(f"\n3. D = 1 against the plain loop, seed {main_seed}, {long_n} samples (equal to the bit?)")
    ref = runs["plain loop"]
    for mode in ("graph-stash", "stash", "weight-stash", "partime"):
        for comp in ((), "auto"):
            losses = piped(main_seed, long_n, depth=1, grad_mode=mode, compensation=comp)
            say(f"  {mode:>12}, compensation={comp!r:>6}: {same(losses, ref)}")

    say(f"\n4. seed {main_seed}, where it blows up: at each tick t stage 0 applies the gradient of sample t - 2;")
    say("   |g| of its product formed three ways, the stem conv's part of it, and the BatchNorms' input")
    say("   scale sigma with the weights now over sigma with the weights it went forward with")
    say("   (median over channels; product and largest over stage 0's BatchNorms)")
    say("  t  s  |delta|  |g| graph-stash  |g| stash  |g| weight-stash  |g stem| g-s  prod s_now/s_then  max  BNs")
    probe = Products()
    reference(main_seed, 9, probe=probe)
    for t, s, d, g, g_now, g_then, stem, prod, big, count in probe.rows:
        say(
            f"{t:3d} {s:2d}  {d:7.3f}  {g:15.4g}  {g_now:9.4g}  {g_then:16.4g}  {stem:12.4g}  {prod:17.4g}  "
            f"{big:7.4g}  {count}"
        )

    say(
        f"\n5. the default compensation at lr 0.03 (step-scale: stage 0 steps with 0.01), {n} samples: first non-finite"
    )
    say("seed  plain  graph-stash auto  stash auto  weight-stash auto")
    for seed in diverging:
        row = [first_nonfinite(plain(seed, n, lr=0.03))]
        row += [first_nonfinite(piped(seed, n, lr=0.03, grad_mode=m, compensation="auto")) for m in MODES]
        say(f"{seed:4d}  " + "  ".join(f"{v!s:>5}" for v in row))

    with open(out_path, "w") as f:
        f.write(f"$ .venv/bin/python experiments/learning/efficientnet_delay.py  (torch {torch.__version__})\n")
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""The bench models: the five kinds of network the runtime issue names, small enough for
CPU tests, with activations that outweigh parameters so that budgets bite.

Each entry builds a model and deterministic batches from seeds; ``loss(model, batch)``
runs one forward pass. Tests, benchmarks and the demo share them (``tests`` imports this
module through ``tests/conftest.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """A deep MLP with dropout after every hidden layer."""

    def __init__(self, width: int = 32, depth: int = 10, classes: int = 10, p: float = 0.2):
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(p)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.body(x))


class Block(nn.Module):
    """ResNet basic block: BatchNorm, ReLU(inplace=True) and a residual ``+=``."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class CNN(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        self.blocks = nn.Sequential(
            Block(width, width),
            Block(width, width),
            Block(width, width),
            Block(width, 2 * width, 2),
            Block(2 * width, 2 * width),
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x):
        h = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class LSTMLM(nn.Module):
    """A two-layer LSTM language model with tied embedding and output weights."""

    def __init__(self, vocab: int = 50, dim: int = 32, layers: int = 4, p: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, layers, batch_first=True, dropout=p)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        h, _ = self.lstm(self.drop(self.embed(tokens)))
        return self.out(self.drop(h))


class Transformer(nn.Module):
    def __init__(
        self,
        vocab: int = 50,
        dim: int = 32,
        heads: int = 4,
        layers: int = 4,
        p: float = 0.1,
        max_len: int = 64,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, p, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.out(self.encoder(h))


class TreeNet(nn.Module):
    """A recursive net over a binary tree whose shape depends on the data: each split
    point is read from the values being combined (``.item()`` on a managed tensor), and
    a gate decides per node whether to apply an extra layer."""

    def __init__(self, vocab: int = 30, dim: int = 16, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.leaf = nn.Linear(dim, dim)
        self.combine = nn.Linear(2 * dim, dim)
        self.gate = nn.Linear(dim, 1)
        self.extra = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def node(self, leaves: list[torch.Tensor]) -> torch.Tensor:
        n = len(leaves)
        if n == 1:
            return torch.tanh(self.leaf(leaves[0]))
        probe = torch.stack([leaf[0, 0] for leaf in leaves]).abs().sum()
        split = 1 + int(probe.item() * 1000) % (n - 1)
        h = torch.cat([self.node(leaves[:split]), self.node(leaves[split:])], dim=-1)
        h = torch.tanh(self.combine(h))
        if self.gate(h).mean().item() > 0:
            h = h + torch.relu(self.extra(h))
        return h

    def forward(self, tokens):
        # tokens: [leaves, batch]; one embedded state [batch, dim] per leaf
        return self.head(self.node([self.embed(t) for t in tokens]))


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    build: Callable[[int], nn.Module]  # scale -> model
    batch: Callable[[torch.Generator, int, int], tuple]  # (generator, scale, size) -> batch
    loss: Callable[[nn.Module, tuple], torch.Tensor]
    batch_size: Callable[[int], int]  # scale -> the default batch size


def _classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _lm(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _tokens(g, batch, seq, vocab=50):
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


# scale 1: the test size (seconds on a CPU). Larger scales grow the tensors, not the
# depth, so that each op's compute dominates the per-op dispatch cost (benchmarks).
# The batch size is the first dimension of every batch tensor (the tree's second: its
# tokens are [leaves, batch]); bench/max_batch.py varies it.
MODELS: dict[str, Spec] = {
    "mlp": Spec(
        "mlp",
        lambda s: MLP(width=32 * s),
        lambda g, s, n: (
            torch.randn(n, 32 * s, generator=g),
            torch.randint(0, 10, (n,), generator=g),
        ),
        _classify,
        lambda s: 256 * s,
    ),
    "cnn": Spec(
        "cnn",
        lambda s: CNN(width=8 * s),
        lambda g, s, n: (
            torch.randn(n, 3, 16 * s, 16 * s, generator=g),
            torch.randint(0, 10, (n,), generator=g),
        ),
        _classify,
        lambda s: 16,
    ),
    "lstm": Spec(
        "lstm",
        lambda s: LSTMLM(dim=32 * s),
        lambda g, s, n: _tokens(g, n, 16 * s),
        _lm,
        lambda s: 16 * s,
    ),
    "transformer": Spec(
        "transformer",
        lambda s: Transformer(dim=32 * s, max_len=64 * s),
        lambda g, s, n: _tokens(g, n, 16 * s),
        _lm,
        lambda s: 16,
    ),
    "tree": Spec(
        "tree",
        lambda s: TreeNet(dim=16 * s),
        lambda g, s, n: (
            torch.randint(0, 30, (12, n), generator=g),
            torch.randint(0, 4, (n,), generator=g),
        ),
        _classify,
        lambda s: 32 * s,
    ),
}


def build(name: str, seed: int = 0, scale: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name].build(scale)


def batches(
    name: str, steps: int, seed: int = 1, scale: int = 1, size: int | None = None
) -> list[tuple]:
    """`steps` batches of `size` examples (default: the model's batch size at `scale`)."""
    spec = MODELS[name]
    n = spec.batch_size(scale) if size is None else size
    g = torch.Generator().manual_seed(seed)
    return [spec.batch(g, scale, n) for _ in range(steps)]

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


class VectorTree(nn.Module):
    """A recursive net over single vectors: one ``nn.Linear`` combines two children at
    every node of a random binary tree (TreeLSTM-style). Each node's activation is one
    vector while its piece of the weight gradient is a whole matrix, so backward sums
    one large piece per node."""

    def __init__(self, vocab: int = 64, dim: int = 96, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.combine = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, classes)

    def node(self, leaves: list[torch.Tensor], splits: list[float]) -> torch.Tensor:
        n = len(leaves)
        if n == 1:
            return leaves[0]
        k = 1 + int(splits[n] * (n - 1)) % (n - 1)
        h = torch.cat([self.node(leaves[:k], splits), self.node(leaves[k:], splits)])
        return torch.tanh(self.combine(h))

    def forward(self, tokens, splits):
        # tokens: [leaves]; splits: where each subtree of n leaves splits (plain floats,
        # read on the host: the tree's shape is data, not computation)
        root = self.node(list(self.embed(tokens)), splits.tolist())
        return self.head(root).unsqueeze(0)


class LSTMCellLM(nn.Module):
    """A language model unrolled over time with ``nn.LSTMCell``: every step's gates are
    chunks of one buffer the CPU kernel writes in place."""

    def __init__(self, vocab: int = 96, dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.cell = nn.LSTMCell(dim, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        h = c = x.new_zeros(x.shape[0], x.shape[2])
        outs = []
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(h)
        return self.out(torch.stack(outs, 1))


class TiedGRULM(nn.Module):
    """A two-layer GRU language model whose output layer shares the embedding's weight."""

    def __init__(self, vocab: int = 96, dim: int = 64, p: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, dim, 2, batch_first=True, dropout=p)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        h, _ = self.gru(self.embed(tokens))
        return self.out(h)


class LoopedTransformer(nn.Module):
    """One transformer layer applied `loops` times: every use reads the same weights."""

    def __init__(self, vocab: int = 96, dim: int = 64, heads: int = 4, loops: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, 0.1, batch_first=True)
        self.loops = loops
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for _ in range(self.loops):
            h = self.layer(h)
        return self.out(h)


class GCN(nn.Module):
    """A graph convolutional network over a sparse (COO) row-normalized adjacency."""

    def __init__(self, features: int = 32, width: int = 64, depth: int = 6, classes: int = 8):
        super().__init__()
        sizes = [features] + [width] * (depth - 1) + [classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, adj, x):
        for k, layer in enumerate(self.layers):
            x = torch.sparse.mm(adj, layer(x))
            if k < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def random_graph(g: torch.Generator, nodes: int, degree: int = 8) -> torch.Tensor:
    """A random graph with self loops as a COO tensor, rows normalized (each node averages
    its neighbours)."""
    src = torch.randint(0, nodes, (nodes * degree,), generator=g)
    dst = torch.randint(0, nodes, (nodes * degree,), generator=g)
    loops = torch.arange(nodes)
    index = torch.stack([torch.cat([src, loops]), torch.cat([dst, loops])])
    ones = torch.ones(index.shape[1])
    adj = torch.sparse_coo_tensor(index, ones, (nodes, nodes), check_invariants=True).coalesce()
    deg = torch.sparse.sum(adj, 1).to_dense()
    values = adj.values() / deg[adj.indices()[0]]
    return torch.sparse_coo_tensor(adj.indices(), values, adj.shape, check_invariants=True).coalesce()


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


def _tree_batch(g, s, n):
    leaves = 24 * s
    return (
        torch.randint(0, 64, (leaves,), generator=g),
        torch.rand(leaves + 1, generator=g),
        torch.randint(0, 4, (1,), generator=g),
    )


def _tree_loss(model, batch):
    tokens, splits, y = batch
    return F.cross_entropy(model(tokens, splits), y)


def _graph_batch(g, s, n):
    return (
        random_graph(g, n),
        torch.randn(n, 32, generator=g),
        torch.randint(0, 8, (n,), generator=g),
    )


def _graph_loss(model, batch):
    adj, x, y = batch
    return F.cross_entropy(model(adj, x), y)


def _token_lm(name: str, model: type[nn.Module], batch_size: Callable[[int], int]) -> Spec:
    """A language model of width 64 x scale over 24 x scale tokens of a 96-word vocabulary."""
    return Spec(
        name,
        lambda s: model(dim=64 * s),
        lambda g, s, n: _tokens(g, n, 24 * s, vocab=96),
        _lm,
        batch_size,
    )


# Programs in the shapes third-party models take and the five above do not: recursion
# over single vectors, an unrolled LSTMCell, a GRU with tied weights, a weight-shared
# loop, a sparse graph. bench.zoo measures them with the third-party models.
SHAPES: dict[str, Spec] = {
    "vector_tree": Spec(
        "vector_tree", lambda s: VectorTree(dim=96 * s), _tree_batch, _tree_loss, lambda s: 1
    ),
    "lstmcell_lm": _token_lm("lstmcell_lm", LSTMCellLM, lambda s: 8 * s),
    "tied_gru_lm": _token_lm("tied_gru_lm", TiedGRULM, lambda s: 8 * s),
    "looped_transformer": _token_lm("looped_transformer", LoopedTransformer, lambda s: 8),
    "gcn": Spec("gcn", lambda s: GCN(width=64 * s), _graph_batch, _graph_loss, lambda s: 1000 * s),
}


def spec_of(name: str) -> Spec:
    if name in MODELS:
        return MODELS[name]
    if name in SHAPES:
        return SHAPES[name]
    raise KeyError(f"no bench model named {name!r}: {sorted(MODELS) + sorted(SHAPES)}")


def build(name: str, seed: int = 0, scale: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return spec_of(name).build(scale)


def batches(
    name: str, steps: int, seed: int = 1, scale: int = 1, size: int | None = None
) -> list[tuple]:
    """`steps` batches of `size` examples (default: the model's batch size at `scale`)."""
    spec = spec_of(name)
    n = spec.batch_size(scale) if size is None else size
    g = torch.Generator().manual_seed(seed)
    return [spec.batch(g, scale, n) for _ in range(steps)]

"""Held-out models: programs outside the bench suite, traced once for the simulator.

Our own heuristics were chosen on the eight prototype traces and the five bench models'
traces (bench/simulate.py's sweep); the comparison is only worth something if the choice carries
over to programs it was not chosen on. These seven differ from the bench models in
structure: skip connections across scales (U-Net), token mixing by transposes (MLP-Mixer),
a fused recurrent kernel (GRU), sparse message passing (GCN), depthwise convolutions, and
two Hugging Face models (GPT-2, BERT; skipped when ``transformers`` is not installed).
Each is traced for one Adam step with the roofline cost model, as the bench models are.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import dtr


class UNet(nn.Module):
    """Three scales down, two up, each up-step concatenating the skip of its scale."""

    def __init__(self, c: int = 16):
        super().__init__()

        def conv(cin, cout, norm=True):
            layers = [nn.Conv2d(cin, cout, 3, padding=1)]
            return nn.Sequential(*layers, *([nn.BatchNorm2d(cout)] if norm else []), nn.ReLU())

        self.d1, self.d2, self.d3 = conv(3, c), conv(c, 2 * c), conv(2 * c, 4 * c)
        self.u2, self.u1 = conv(6 * c, 2 * c, norm=False), conv(3 * c, c, norm=False)
        self.head = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        c = self.d3(F.max_pool2d(b, 2))
        u = self.u2(torch.cat([F.interpolate(c, scale_factor=2.0), b], 1))
        u = self.u1(torch.cat([F.interpolate(u, scale_factor=2.0), a], 1))
        return self.head(u)


class Mixer(nn.Module):
    """MLP-Mixer blocks: an MLP across tokens (through transposes), then across channels."""

    def __init__(self, tokens: int = 64, dim: int = 128, depth: int = 6):
        super().__init__()

        def mlp(n, hidden):
            return nn.Sequential(nn.Linear(n, hidden), nn.GELU(), nn.Linear(hidden, n))

        self.blocks = nn.ModuleList(
            nn.ModuleList(
                [nn.LayerNorm(dim), mlp(tokens, 2 * tokens), nn.LayerNorm(dim), mlp(dim, 4 * dim)]
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        for norm1, tokens, norm2, channels in self.blocks:
            x = x + tokens(norm1(x).transpose(1, 2)).transpose(1, 2)
            x = x + channels(norm2(x))
        return self.head(x.mean(1))


class GRUTagger(nn.Module):
    def __init__(self, vocab: int = 100):
        super().__init__()
        self.emb = nn.Embedding(vocab, 64)
        self.gru = nn.GRU(64, 128, 2, batch_first=True)
        self.out = nn.Linear(128, vocab)

    def forward(self, x):
        h, _ = self.gru(self.emb(x))
        return self.out(h)


class GCN(nn.Module):
    """Graph convolutions over a CSR adjacency: 5 random neighbours and a self loop each."""

    def __init__(self, nodes: int = 2000, width: int = 32, layers: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        rows = torch.arange(nodes).repeat_interleave(5)
        cols = torch.randint(0, nodes, (5 * nodes,), generator=g)
        loops = torch.arange(nodes).repeat(2, 1)
        idx = torch.cat([torch.stack([rows, cols]), loops], 1)
        values = torch.full((idx.shape[1],), 1 / 6.0)
        coo = torch.sparse_coo_tensor(idx, values, (nodes, nodes)).coalesce()
        self.adj = coo.to_sparse_csr()
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for lin in self.lins:
            x = torch.tanh(self.adj @ lin(x))
        return self.head(x)


class DepthwiseNet(nn.Module):
    """Depthwise-separable convolution blocks (MobileNet-style), batch norm and SiLU."""

    def __init__(self, c: int = 32, depth: int = 6):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, c, 3, padding=1)]
        for _ in range(depth):
            layers += [nn.Conv2d(c, c, 3, padding=1, groups=c), nn.BatchNorm2d(c), nn.SiLU()]
            layers += [nn.Conv2d(c, c, 1), nn.BatchNorm2d(c), nn.SiLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def _hugging_face(kind: str) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    if kind == "gpt2":
        config = GPT2Config(vocab_size=200, n_positions=64, n_embd=64, n_layer=4, n_head=4)
        return GPT2LMHeadModel(config)
    config = BertConfig(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    return BertForMaskedLM(config)


def _program(name: str) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The model and a function computing its loss on a fixed batch."""
    g = torch.Generator().manual_seed(1)
    if name == "unet":
        model, x = UNet(), torch.randn(4, 3, 32, 32, generator=g)
        return model, lambda: F.mse_loss(model(x), x[:, :1])
    if name == "mixer":
        model, x = Mixer(), torch.randn(8, 64, 128, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        return model, lambda: F.cross_entropy(model(x), y)
    if name == "gru":
        model, x = GRUTagger(), torch.randint(0, 100, (8, 32), generator=g)
        return model, lambda: F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    if name == "gcn":
        model, x = GCN(), torch.randn(2000, 32, generator=g)
        y = torch.randint(0, 4, (2000,), generator=g)
        return model, lambda: F.cross_entropy(model(x), y)
    if name == "dwconv":
        model, x = DepthwiseNet(), torch.randn(8, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        return model, lambda: F.cross_entropy(model(x), y)
    if name in ("gpt2", "bert"):
        model, ids = _hugging_face(name), torch.randint(0, 200, (4, 48), generator=g)
        return model, lambda: model(input_ids=ids, labels=ids).loss
    raise ValueError(f"unknown held-out model {name!r}; known: {', '.join(HELDOUT)}")


HELDOUT = ("unet", "mixer", "gru", "gcn", "dwconv", "gpt2", "bert")


def available() -> list[str]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return [m for m in HELDOUT if m not in ("gpt2", "bert")]
    return list(HELDOUT)


def record_heldout(folder: str, models: list[str] | None = None) -> list[tuple[str, str]]:
    """One Adam step of each held-out model under dtr (no budget, roofline costs),
    traced to folder/<model>.jsonl.gz; returns (label, path) pairs."""
    os.makedirs(folder, exist_ok=True)
    out = []
    for name in models or available():
        torch.manual_seed(0)
        model, loss = _program(name)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        path = os.path.join(folder, f"{name}.jsonl.gz")
        with dtr.enable(trace=path, cost_model="roofline"):
            loss().backward()
            opt.step()
            opt.zero_grad()
        out.append((f"held-out {name}", path))
    return out

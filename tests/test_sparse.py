"""Sparse tensors next to managed ones, on both engines, against eager.

dtr manages no sparse tensor's parts; a plain sparse tensor a managed op reads (a graph
network's adjacency in `torch.sparse.mm(adj, h)` or `adj @ h`) is a constant of the op's
recipe, so the op's output is evicted and recomputed like any other
(dtr/storage_keys.py). Sparse results stay plain: an embedding's sparse gradient, whose
values are a managed tensor's memory, pins that tensor on the native engine. Until the
seventh session each of these raised "mixes a managed tensor with a non-strided one",
and SparseAdam's sparse update to a parameter was a write dtr did not see.
"""

from __future__ import annotations

import csv

import pytest
import torch
from torch import nn

import dtr

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
]


def _adjacency(n: int, layout) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    dense = torch.rand(n, n, generator=g) * (torch.rand(n, n, generator=g) < 0.05)
    dense += torch.eye(n)
    return dense.to_sparse().coalesce() if layout is torch.sparse_coo else dense.to_sparse_csr()


def _gcn(layout):
    """An eight-layer graph convolutional net, trained two steps with Adam."""
    n, width, depth = 400, 32, 8
    adj = _adjacency(n, layout)

    def program():
        torch.manual_seed(0)
        layers = nn.ModuleList(
            [nn.Linear(16, width)]
            + [nn.Linear(width, width) for _ in range(depth - 2)]
            + [nn.Linear(width, 4)]
        )
        opt = torch.optim.Adam(layers.parameters(), lr=0.01)
        x, y = torch.randn(n, 16), torch.randn(n, 4)
        losses = []
        for _ in range(2):
            h = x
            for k, layer in enumerate(layers):
                h = layer(h)
                h = torch.sparse.mm(adj, h) if layout is torch.sparse_coo else adj @ h
                if k < depth - 1:
                    h = torch.tanh(h)
            loss = (h - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses + [p.detach().clone() for p in layers.parameters()]

    return program


def _embedding_bag_of_words():
    """A sparse-gradient embedding trained with SparseAdam (its update is a sparse tensor
    added to the weight), the dense head with Adam."""

    def program():
        torch.manual_seed(0)
        emb = nn.Embedding(500, 64, sparse=True)
        head = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
        opts = [
            torch.optim.SparseAdam(list(emb.parameters()), lr=0.05),
            torch.optim.Adam(head.parameters(), lr=0.01),
        ]
        words = torch.randint(0, 500, (64, 12))
        labels = torch.randint(0, 3, (64,))
        losses = []
        for _ in range(3):
            logits = head(torch.tanh(emb(words)).mean(1))
            loss = nn.functional.cross_entropy(logits, labels)
            loss.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach())
        params = [emb.weight, *head.parameters()]
        return losses + [p.detach().clone() for p in params]

    return program


# each program, and the fraction of its unbudgeted peak it is run at. The COO network
# trains under a budget on the default engine, which takes autograd's adj.t() again from
# adj rather than hold a copy per backward product (dtr/fresh.py); the native engine
# holds those copies and torch.sparse.mm's zeros, plain tensors its recipes read as
# constants (pinned), so every fraction of its peak down to 0.9 is infeasible there and
# stress mode checks it. README, Limits.
PROGRAMS = {
    "gcn_coo": (lambda: _gcn(torch.sparse_coo), 0.7),
    "gcn_csr": (lambda: _gcn(torch.sparse_csr), 0.7),
    "embedding_sparse_grad": (_embedding_bag_of_words, 0.8),
}
NATIVE_WITHOUT_BUDGET = {"gcn_coo"}
SETUPS = ["subclass", "subclass-python-core", "native"]
RUNS = [
    (name, mode, setup)
    for name in sorted(PROGRAMS)
    for mode in ("stress", "budget")
    for setup in SETUPS
    if mode == "stress" or not (setup == "native" and name in NATIVE_WITHOUT_BUDGET)
]


@pytest.mark.parametrize("name,mode,setup", RUNS)
def test_programs_with_sparse_tensors_match_eager(name, mode, setup, monkeypatch):
    engine = setup.split("-")[0]
    if engine == "native":
        pytest.importorskip("dtr._C", reason="the native engine is C++")
    monkeypatch.setenv("DTR_FORCE_PYTHON", "1" if setup.endswith("python-core") else "0")
    make, ratio = PROGRAMS[name]
    program = make()
    want = program()
    if mode == "stress":
        kwargs = {"stress": True}
    else:
        with dtr.enable(engine=engine) as free:
            program()
        kwargs = {"budget": int(free.stats().peak_resident_bytes * ratio)}
    with dtr.enable(engine=engine, **kwargs) as session:
        got = [dtr.materialize(t) for t in program()]
    stats = session.stats()
    assert stats.evictions > 0 and stats.remats > 0
    if mode == "budget":
        assert stats.peak_resident_bytes <= kwargs["budget"]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_sparse_constant_written_later_is_not_read_by_recomputation(engine):
    # torch.sparse.mm's recipe reads adj; the program then scales adj in place. The
    # product, evicted at once in stress mode, must keep the value it had.
    adj = _adjacency(50, torch.sparse_coo)
    x = torch.randn(50, 8, requires_grad=True)
    want = torch.sparse.mm(adj, x * 2).detach()
    with dtr.enable(engine=engine, stress=True) as session:
        h = torch.sparse.mm(adj, x * 2).detach()
        adj.mul_(3)
        got = dtr.materialize(h + 0)
    assert session.stats().evictions > 0
    assert torch.equal(got, want)


def test_a_sparse_result_built_on_a_managed_value_keeps_it(engine):
    # The sparse tensor's values are the managed tensor's memory (no copy, as in eager):
    # evicting that tensor would free them under the sparse one.
    indices = torch.tensor([[0, 1, 3], [2, 0, 1]])
    with dtr.enable(engine=engine, stress=True):
        values = (torch.arange(3.0, requires_grad=True) * 2).detach()  # managed
        s = torch.sparse_coo_tensor(indices, values, (4, 4))
        for _ in range(3):
            torch.randn(64, 64) @ torch.randn(64, 64)  # other tensors come and go
        got = s.to_dense()
    want = torch.sparse_coo_tensor(indices, torch.arange(3.0) * 2, (4, 4)).to_dense()
    assert torch.equal(dtr.materialize(got), want)


def test_writing_a_sparse_tensor_from_a_managed_one_is_a_clear_error(engine):
    s = torch.randn(4, 4).to_sparse()
    with dtr.enable(engine=engine):
        w = (torch.randn(4, 4, requires_grad=True) * 2).sum().detach()
        with pytest.raises(dtr.UnsupportedError, match="dtr: aten.mul_.Tensor .*sparse"):
            s.mul_(w)


def test_a_product_of_plain_tensors_autograd_needs_is_managed(engine):
    # adj @ W with W a parameter (a graph network without input features): as for dense
    # ops on plain tensors, the result is managed when autograd will need it.
    adj = _adjacency(60, torch.sparse_csr)
    torch.manual_seed(0)
    weight = torch.randn(60, 8, requires_grad=True)

    def program():
        h = torch.tanh(adj @ weight)
        return (adj @ h).square().sum()

    want = program()
    want.backward()
    want_grad, weight.grad = weight.grad, None
    with dtr.enable(engine=engine, stress=True) as session:
        h = adj @ weight
        if engine == "subclass":
            managed = isinstance(h, dtr.CheckpointTensor)
        else:
            managed = dtr.native.is_managed(h)
        got = program()
        got.backward()
        got = dtr.materialize(got)
    assert managed
    assert session.stats().remats > 0
    assert torch.equal(got, want.detach()) and torch.equal(weight.grad, want_grad)


def test_the_gcn_benchmark_runs_and_reports_what_it_measured(tmp_path):
    # bench/sparse_gcn.py at test size: eager and dtr rows for both layouts; the budget
    # point fits (below eager's memory) or is reported infeasible, never raised.
    from bench import sparse_gcn

    out = tmp_path / "gcn.csv"
    sparse_gcn.main(
        ["--nodes", "1000", "--depth", "8", "--width", "32", "--steps", "1"]
        + ["--fractions", "0.8", "--out", str(out)]
    )
    rows = list(csv.DictReader(out.open()))
    assert [(r["layout"], r["method"]) for r in rows] == [
        (layout, method)
        for layout in ("csr", "coo")
        for method in ("eager", "dtr no budget", "dtr 0.8 x P")
    ]
    csr_budget = rows[2]
    assert csr_budget["peak_mib"] != "infeasible" and float(csr_budget["peak_vs_eager"]) < 1
    assert int(csr_budget["evictions"]) > 0


def test_torch_sparse_mm_holds_no_zeros_tensor_per_product(core):
    # torch.sparse.mm(adj, h) is _sparse_addmm(torch.zeros(...), adj, h): the recipe of
    # each product reads a zeros tensor of its size. Held as a constant, that was one
    # product-sized tensor per layer from forward to backward (1.76x eager's memory for
    # bench/sparse_gcn.py's COO network with no budget); the default engine now reads a
    # managed zeros instead (dtr/fresh.py), rebuilt at no cost. (The native engine still
    # holds it: README, Limits.)
    adj = _adjacency(400, torch.sparse_coo)
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32) for _ in range(6)]
    x = torch.randn(400, 32)
    with dtr.enable() as session:
        h = x
        for layer in layers:
            h = torch.tanh(torch.sparse.mm(adj, layer(h)))
        held = session.stats().constant_bytes
        h.sum().backward()
    params = sum(p.untyped_storage().nbytes() for layer in layers for p in layer.parameters())
    graph = adj._indices().untyped_storage().nbytes() + adj._values().untyped_storage().nbytes()
    assert held == params + graph + x.untyped_storage().nbytes()


def test_coo_backward_holds_no_transpose_per_product(core):
    # torch.sparse.mm's backward is mm(adj.t(), grad), and a COO adj.t() copies adj's
    # indices and values. Each product's recipe held its copy as a constant for the rest
    # of backward (here 5 copies by the first layer's gradient: 1.07 MB against 0.24 MB,
    # and no budget below the peak could be met); it now takes adj.t() again from adj
    # when it replays (dtr/fresh.py), so backward holds what forward held. (The native
    # engine still holds them: README, Limits.)
    adj = _adjacency(400, torch.sparse_coo)
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32) for _ in range(6)]
    x = torch.randn(400, 32)
    seen = []
    with dtr.enable() as session:
        h = x
        for k, layer in enumerate(layers):
            h = torch.tanh(torch.sparse.mm(adj, layer(h)))
            if k == 0:
                h.register_hook(lambda g: seen.append(session.stats().constant_bytes))
        forward = session.stats().constant_bytes
        h.sum().backward()
    params = sum(p.untyped_storage().nbytes() for layer in layers for p in layer.parameters())
    graph = adj._indices().untyped_storage().nbytes() + adj._values().untyped_storage().nbytes()
    assert forward == params + graph + x.untyped_storage().nbytes()
    assert seen == [forward]


def _transposed_product(adj, x):
    # a recipe that reads adj.t(), a sparse transpose dtr takes again from adj
    return torch.sparse.mm(adj.t(), x * 2).detach()


def test_a_transpose_taken_again_sees_its_source_as_it_was(core):
    # adj is scaled in place after the product that read adj.t() (a write dtr sees):
    # the product, evicted at once in stress mode, must keep the value it had.
    adj = _adjacency(50, torch.sparse_coo)
    x = torch.randn(50, 8, requires_grad=True)
    want = _transposed_product(adj, x)
    with dtr.enable(stress=True) as session:
        h = _transposed_product(adj, x)
        adj.mul_(3)
        got = dtr.materialize(h + 0)
    assert session.stats().evictions > 0
    assert torch.equal(got, want)


def test_a_transpose_whose_source_was_written_unseen_is_a_clear_error(core):
    # A write dtr cannot see (dispatch bypassed, as another thread's would be): the
    # product cannot be rebuilt from adj any more, and says so rather than use the new
    # values.
    adj = _adjacency(50, torch.sparse_coo)
    x = torch.randn(50, 8, requires_grad=True)
    with pytest.raises(dtr.UnsupportedError, match="written in place where dtr could not"):
        with dtr.enable(stress=True):
            h = _transposed_product(adj, x)
            with torch._C._DisableTorchDispatch():
                adj.mul_(3)
            dtr.materialize(h + 0)

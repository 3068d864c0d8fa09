"""Sparse tensors next to managed ones, on both engines, against eager.

dtr manages no sparse tensor's parts; a plain sparse tensor a managed op reads (a graph network's
adjacency in `torch.sparse.mm(adj, h)` or `adj @ h`) is a constant of the op's recipe, so the op's
output is evicted and recomputed like any other (dtr/engines/subclass/storage_keys.py). Sparse
results stay plain: an embedding's sparse gradient, whose values are a managed tensor's memory, pins
that tensor on the native engine. SparseAdam's sparse update to a parameter is a write dtr must see.
"""

from __future__ import annotations

import csv
import threading

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


# each program, and the fraction of its unbudgeted peak it is run at. The COO network trains under a
# budget on both engines, which take autograd's adj.t() again from adj rather than hold a copy per
# backward product, and read a managed zeros in torch.sparse.mm rather than hold the plain one
# (dtr/engines/subclass/rebuildable_plain.py); holding those (plain tensors the recipes read as
# constants, pinned), every fraction of its peak down to 0.9 was infeasible.
PROGRAMS = {
    "gcn_coo": (lambda: _gcn(torch.sparse_coo), 0.7),
    "gcn_csr": (lambda: _gcn(torch.sparse_csr), 0.7),
    "embedding_sparse_grad": (_embedding_bag_of_words, 0.8),
}
SETUPS = ["subclass", "subclass-python-core", "native"]
RUNS = [
    (name, mode, setup)
    for name in sorted(PROGRAMS)
    for mode in ("stress", "budget")
    for setup in SETUPS
]


def _engine(setup: str, monkeypatch) -> str:
    """dtr.enable()'s engine for a setup of SETUPS, with that setup's core selected."""
    engine = setup.split("-")[0]
    if engine == "native":
        pytest.importorskip("dtr._C", reason="the native engine is C++")
    monkeypatch.setenv("DTR_FORCE_PYTHON", "1" if setup.endswith("python-core") else "0")
    return engine


@pytest.mark.parametrize("name,mode,setup", RUNS)
def test_programs_with_sparse_tensors_match_eager(name, mode, setup, monkeypatch):
    engine = _engine(setup, monkeypatch)
    make, ratio = PROGRAMS[name]
    program = make()
    want = program()
    if mode == "stress":
        kwargs = {"stress": True}
    else:
        with dtr.enable(engine=engine) as free:
            program()
        # (no budget below the op-level floor can run: the embedding's tanh backward
        # needs all but 0.1% of the peak at once)
        stats = free.stats()
        kwargs = {"budget": max(int(stats.peak_resident_bytes * ratio), stats.op_floor_bytes)}
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
            managed = dtr.engines.native.session.is_managed(h)
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


@pytest.mark.parametrize("setup", SETUPS)
def test_torch_sparse_mm_holds_no_zeros_tensor_per_product(setup, monkeypatch):
    # torch.sparse.mm(adj, h) is _sparse_addmm(torch.zeros(...), adj, h): the recipe of
    # each product reads a zeros tensor of its size. Held as a constant, that was one
    # product-sized tensor per layer from forward to backward (1.76x eager's memory for
    # bench/sparse_gcn.py's COO network with no budget); both engines now read a managed
    # zeros instead (dtr/engines/subclass/rebuildable_plain.py), rebuilt at no cost.
    engine = _engine(setup, monkeypatch)
    adj = _adjacency(400, torch.sparse_coo)
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32) for _ in range(6)]
    x = torch.randn(400, 32)
    with dtr.enable(engine=engine) as session:
        h = x
        for layer in layers:
            h = torch.tanh(torch.sparse.mm(adj, layer(h)))
        held = session.stats().constant_bytes
        h.sum().backward()
    params = sum(p.untyped_storage().nbytes() for layer in layers for p in layer.parameters())
    graph = adj._indices().untyped_storage().nbytes() + adj._values().untyped_storage().nbytes()
    assert held == params + graph + x.untyped_storage().nbytes()


@pytest.mark.parametrize("written_before", [False, True], ids=["as_made", "written_before"])
@pytest.mark.parametrize("setup", SETUPS)
def test_coo_backward_holds_no_transpose_per_product(setup, written_before, monkeypatch):
    # torch.sparse.mm's backward is mm(adj.t(), grad), and a COO adj.t() copies adj's indices and
    # values. Each product's recipe held its copy as a constant for the rest of backward (here 5
    # copies by the first layer's gradient: 1.07 MB against 0.24 MB, and no budget below the peak
    # could be met); it now takes adj.t() again from adj when it replays
    # (dtr/engines/subclass/rebuildable_plain.py), so backward holds what forward held.
    # written_before: adj.t() is a copy that autograd treats as a view, so it takes adj's version
    # counter after the op, and a version read as the op returns (0, its own) is not the one a later
    # read sees (adj's, 1 here). The native engine reads it when the next op comes; the subclass
    # engine accepts the source's counter once the copy is its view (otherwise it would hold one
    # transpose per backward product here).
    engine = _engine(setup, monkeypatch)
    adj = _adjacency(400, torch.sparse_coo)
    if written_before:
        adj.mul_(2)
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32) for _ in range(6)]
    x = torch.randn(400, 32)
    seen = []
    with dtr.enable(engine=engine) as session:
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


@pytest.mark.parametrize("setup", SETUPS)
def test_a_transpose_taken_again_sees_its_source_as_it_was(setup, monkeypatch):
    # adj is scaled in place after the product that read adj.t() (a write dtr sees):
    # the product, evicted at once in stress mode, must keep the value it had. (A COO
    # adj.t() copies adj's parts but shares its version counter, as a view: a recipe
    # holding the copy took the write for one behind dtr's back and could not replay.)
    engine = _engine(setup, monkeypatch)
    adj = _adjacency(50, torch.sparse_coo)
    x = torch.randn(50, 8, requires_grad=True)
    want = _transposed_product(adj, x)
    with dtr.enable(engine=engine, stress=True) as session:
        h = _transposed_product(adj, x)
        adj.mul_(3)
        got = dtr.materialize(h + 0)
    assert session.stats().evictions > 0
    assert torch.equal(got, want)


@pytest.mark.parametrize("setup", SETUPS)
def test_a_transpose_whose_source_was_written_unseen_is_a_clear_error(setup, monkeypatch):
    # A write dtr cannot see (another thread's: a session serves the thread that opened
    # it): the product cannot be rebuilt from adj any more, and says so rather than use
    # the new values.
    engine = _engine(setup, monkeypatch)
    adj = _adjacency(50, torch.sparse_coo)
    x = torch.randn(50, 8, requires_grad=True)
    with pytest.raises(dtr.UnsupportedError, match="written in place where dtr could not"):
        with dtr.enable(engine=engine, stress=True):
            h = _transposed_product(adj, x)
            writer = threading.Thread(target=adj.mul_, args=(3,))
            writer.start()
            writer.join()
            dtr.materialize(h + 0)


@pytest.mark.parametrize("setup", SETUPS)
def test_what_a_recipe_makes_again_is_held_by_nothing(setup, monkeypatch):
    # A sparse transpose a recipe takes again from its source, and a zeros tensor a
    # recipe reads as a managed copy: dtr remembers them weakly and no recipe holds
    # them, so their memory goes when the program drops them (the use count of a storage
    # whose last holder is `storage` itself is 1).
    engine = _engine(setup, monkeypatch)
    adj = _adjacency(50, torch.sparse_coo)
    x = torch.randn(50, 8, requires_grad=True)
    with dtr.enable(engine=engine):
        y = x * 2  # managed
        with torch.no_grad():  # (autograd would save what the products read)
            transposed = adj.t()
            zeros = torch.zeros(50, 8)
            products = [
                torch.sparse.mm(transposed, y),
                torch.ops.aten._sparse_addmm(zeros, adj, y, beta=0, alpha=1),
            ]
        storages = [transposed._values().untyped_storage(), zeros.untyped_storage()]
        del transposed, zeros
        y + 0  # the next op
        counts = [torch._C._storage_Use_Count(s._cdata) for s in storages]
    assert len(products) == 2 and counts == [1, 1]


def test_a_native_coo_run_and_its_trace_replayed_evict_alike(tmp_path):
    # The native engine's trace of the COO network under a budget: the managed zeros
    # (a CALL with no inputs) and the transposes' sources read as constants replay, on
    # both of dtr.sim's cores, to the evictions of the live run (tests/engines/native/test_native.py
    # checks the same for the bench models).
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    from dtr.engines.native import session as native
    from dtr import sim

    program = _gcn(torch.sparse_coo)
    with native.enable(cost_model="roofline") as free:
        program()
    budget = int(free.stats().peak_resident_bytes * 0.7)
    path = str(tmp_path / "gcn_coo.jsonl.gz")
    with native.enable(budget=budget, cost_model="roofline", trace=path) as session:
        session._engine.log_evictions(True)
        program()
        live_log = session._engine.eviction_log()
    stats = session.stats()
    assert stats.evictions == len(live_log) > 0
    prog = sim.load(path)
    for core in ("c++", "python"):
        res = sim.simulate(
            prog, dtr.DEFAULT_HEURISTIC, budget=budget, core=core, log=True, thrash=0
        )
        assert res.status == "ok" and res.eviction_log == live_log
        assert (res.evictions, res.remats) == (stats.evictions, stats.remats)

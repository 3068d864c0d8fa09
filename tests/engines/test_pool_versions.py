"""In-place writes to one member of a storage whose other members are held (Invariant 4's
pool versions): LSTMCell's and GRUCell's gate buffers (`unsafe_chunk` then `sigmoid_`),
slices written in place. Every result equals eager's bitwise under eviction and
recomputation, on both engines; on the native engine the written storages keep their
lineage instead of being pinned."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dtr

from tests.utils import assert_bitwise, eager_and_dtr

MODES = ("stress", "budget")


def _train(step, params: list[torch.Tensor], steps: int = 2) -> list[torch.Tensor]:
    """Losses, every gradient and the parameters after `steps` SGD steps of step()."""
    opt = torch.optim.SGD(params, lr=0.01)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = step()
        loss.backward()
        out.append(loss.detach())
        out += [p.grad.clone() for p in params]
        opt.step()
    return out + [p.detach().clone() for p in params]


def _mode(fn, engine: str, mode: str, fraction: float) -> dict:
    """stress=True, or a budget of the constants and that fraction of the activations
    fn's unbudgeted run peaks at."""
    if mode == "stress":
        return {"stress": True}
    _, _, free, _ = eager_and_dtr(fn, "cpu", engine=engine, cost_model="roofline")
    constants = free.constant_bytes
    return {"budget": constants + int((free.peak_resident_bytes - constants) * fraction)}


def _check(fn, engine: str, mode: str, fraction: float = 0.7):
    """fn() under dtr equal to eager in every value, with evictions and recomputations.
    The subclass engine pins what a write to a shared storage's member reads (Invariant
    4, aliased), which makes these budgets infeasible there: it runs at 95% of its
    activations and is held to recomputing under stress only."""
    pins = engine == "subclass"
    kwargs = _mode(fn, engine, mode, 0.95 if pins else fraction)
    expected, got, stats, _ = eager_and_dtr(fn, "cpu", engine=engine, cost_model="roofline", **kwargs)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_bitwise(g, e, f"value {i}")
    if mode == "stress" or not pins:
        assert stats.evictions > 0 and stats.remats > 0, stats
    return stats


def _cell_lm(cell_type, hidden: int = 16, steps: int = 6):
    """A language-model-like loop over one cell, built afresh for each run."""
    torch.manual_seed(0)
    cell = cell_type(8, hidden)
    head = nn.Linear(hidden, 8)
    xs = torch.randn(steps, 64, 8)
    target = torch.randint(0, 8, (steps, 64))
    params = list(cell.parameters()) + list(head.parameters())

    def step():
        h = torch.zeros(64, hidden)
        state = (h, torch.zeros(64, hidden)) if cell_type is nn.LSTMCell else h
        loss = 0
        for t in range(steps):
            state = cell(xs[t], state)
            h = state[0] if cell_type is nn.LSTMCell else state
            loss = loss + nn.functional.cross_entropy(head(h), target[t])
        return loss

    return _train(step, params)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell_type", [nn.LSTMCell, nn.GRUCell], ids=["lstm", "gru"])
def test_rnn_cell_loop(engine, mode, cell_type):
    _check(lambda: _cell_lm(cell_type), engine, mode)


def _leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def _run(step, *leaves):
    """_train(step) on copies of the leaves (each run starts from the same values)."""
    params = [t.detach().clone().requires_grad_() for t in leaves]
    return _train(lambda: step(*params), params)


def _layers(layer):
    """A step of four layers h = layer(h, w) from x, each writing in place into its own
    buffer (x: 64 x 16, w: 16 x 32)."""

    def step(x, w):
        h = x
        for _ in range(4):
            h = layer(h, w)
        return h.square().mean()

    return step


def _check_layers(layer, engine, mode):
    x, w = _leaf(64, 16), _leaf(16, 32)
    _check(lambda: _run(_layers(layer), x, w), engine, mode)


@pytest.mark.parametrize("mode", MODES)
def test_chunks_written_in_place(engine, mode):
    def layer(h, w):
        a, b = (h @ w).unsafe_chunk(2, 1)
        a.sigmoid_()
        b.tanh_()
        return a * b + a

    _check_layers(layer, engine, mode)


@pytest.mark.parametrize("mode", MODES)
def test_slice_relu_on_non_leaf(engine, mode):
    def layer(h, w):
        y = (h @ w).sin()
        s = y[:, :5]
        y[:, :5].relu_()
        return y[:, :16] * y[:, 16:] + s.exp().sum()

    _check_layers(layer, engine, mode)


@pytest.mark.parametrize("mode", MODES)
def test_write_while_other_member_saved(engine, mode):
    def layer(h, w):
        a, b = (h @ w).unsafe_chunk(2, 1)
        saved = b.sin()  # sin's backward reads b
        a.tanh_()
        return saved * a + b

    _check_layers(layer, engine, mode)


@pytest.mark.parametrize("mode", MODES)
def test_write_spanning_two_members(engine, mode):
    def layer(h, w):
        buf = (h @ w).cos()
        a, b = buf[:, :16], buf[:, 16:]
        buf[:, 8:24].mul_(3)
        return a.exp() * b + buf[:, 4:20]

    _check_layers(layer, engine, mode)


@pytest.mark.parametrize("mode", MODES)
def test_old_value_read_by_recipe(engine, mode):
    def layer(h, w):
        a, b = (h @ w).unsafe_chunk(2, 1)
        before = a * 3  # reads a's value before the write: recomputed from it
        a.sigmoid_()
        b.mul_(2)
        return (before.sin() * (a + b)).tanh()

    _check_layers(layer, engine, mode)


@pytest.mark.parametrize("mode", MODES)
def test_write_reading_another_member(engine, mode):
    def layer(h, w):
        a, b = (h @ w).unsafe_chunk(2, 1)
        a.mul_(b.sigmoid())
        b.add_(a)  # reads the member written just before, in the same storage
        return (a * b).tanh()

    _check_layers(layer, engine, mode)


@pytest.mark.parametrize("mode", MODES)
def test_random_write_to_a_member(engine, mode):
    def layer(h, w):
        a, b = (h @ w).tanh().unsafe_chunk(2, 1)
        mask = torch.empty_like(a).bernoulli_(0.5)
        b.mul_(mask)
        a.mul_(torch.rand_like(a))
        return a + b

    _check_layers(layer, engine, mode)


@pytest.mark.parametrize("mode", MODES)
def test_foreach_writes_to_members_of_two_storages(engine, mode):
    def layer(h, w):
        a, b = (h @ w).unsafe_chunk(2, 1)
        c, d = (h @ w.flip(1)).unsafe_chunk(2, 1)
        torch._foreach_mul_([a, c], 0.5)
        torch._foreach_add_([b, d], [a, c])
        return (a * d + b * c).tanh()

    _check_layers(layer, engine, mode)


def test_writes_keep_lineage_on_the_native_engine():
    """LSTMCell's gate buffers stay recomputable: after a forward under stress nothing
    but constants is pinned."""
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    torch.manual_seed(0)
    cell = nn.LSTMCell(16, 32)
    xs = torch.randn(4, 4, 16)
    with dtr.enable(engine="native", stress=True, cost_model="roofline") as session:
        state = (torch.zeros(4, 32), torch.zeros(4, 32))
        for t in range(4):
            state = cell(xs[t], state)
        stats = session.stats()
        assert stats.pinned_bytes == stats.constant_bytes, stats
        loss = state[0].sum()
        loss.backward()


def test_native_trace_replays_pool_versions_as_live(tmp_path):
    """A native trace names a pool version's followers (FOLLOWS): both replay cores make
    them again and evict what the live run evicted, in the same order."""
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    from dtr import sim

    run = lambda: _cell_lm(nn.LSTMCell)  # noqa: E731
    _, _, free, _ = eager_and_dtr(run, "cpu", engine="native", cost_model="roofline")
    budget = free.constant_bytes + (free.peak_resident_bytes - free.constant_bytes) * 7 // 10
    path = str(tmp_path / "lstmcell.jsonl")
    torch.manual_seed(0)
    with dtr.enable(engine="native", budget=budget, cost_model="roofline", trace=path) as session:
        session._engine.log_evictions(True)
        run()
        live_log = session._engine.eviction_log()
    stats = session.stats()
    assert stats.evictions == len(live_log) > 0 and stats.remats > 0
    with open(path) as f:
        assert any('"FOLLOWS":"1"' in line for line in f)
    prog = sim.load(path)
    for core in ("c++", "python"):
        res = sim.simulate(prog, None, budget=budget, core=core, log=True, thrash=0)
        assert res.status == "ok"
        assert res.eviction_log == live_log
        assert (res.evictions, res.remats) == (stats.evictions, stats.remats)

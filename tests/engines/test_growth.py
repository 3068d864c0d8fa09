"""Long runs stay flat: nothing dtr keeps grows with the number of steps or of ops.

A value carried from step to step (a running mean of the loss), a leaf that requires
grad made every step, and Python numbers in every op of a long recurrence each made
something grow without bound; each test runs the pattern long enough to see growth, and
compares the results with eager PyTorch bit for bit."""

from __future__ import annotations

import gc
import itertools
import tracemalloc
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import dtr


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 32), nn.Tanh()]
    for _ in range(8):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(128, 16, generator=g), torch.randn(128, 1, generator=g)


def _train(model, steps, session=None, end_step=False):
    """SGD on a fixed batch with a running mean of the loss (the usual logging line).
    Returns the running mean every ten steps, and the session's stats after each step
    when a session is given."""
    x, y = _data()
    params = list(model.parameters())
    opt = None if end_step else torch.optim.SGD(params, lr=0.05)
    running = None
    means, per_step = [], []
    for step in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        else:  # a hand-written update closes its step itself
            with torch.no_grad():
                for p in params:
                    p -= 0.05 * p.grad
                    p.grad = None
            if session is not None:
                session.end_step()
        d = loss.detach()
        running = d if running is None else 0.99 * running + 0.01 * d
        if step % 10 == 9:  # logged now and then
            means.append(running.item())
        if session is not None:
            per_step.append(session.stats())
    return means, per_step


@pytest.fixture
def native_engine():
    """For the native engine's own machinery (it needs the C++ extension)."""
    pytest.importorskip("dtr._C", reason="the native engine is C++")


def _unbudgeted_peak(engine: str) -> int:
    with dtr.enable(engine=engine, cost_model="roofline") as session:
        _train(_mlp(), 3)
    return session.stats().peak_resident_bytes


@pytest.mark.parametrize("update", ["optimizer", "end_step"])
def test_running_mean_of_the_loss_stays_flat(engine, update):
    steps = 80
    eager_means, _ = _train(eager_model := _mlp(), steps, end_step=update == "end_step")
    model = _mlp()
    budget = _unbudgeted_peak(engine) // 2
    with dtr.enable(engine=engine, budget=budget, cost_model="roofline") as session:
        means, stats = _train(model, steps, session, end_step=update == "end_step")
    assert means == eager_means
    for a, b in zip(model.parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(a, b)
    evictions = [b.evictions - a.evictions for a, b in itertools.pairwise(stats)]
    remats = [b.remats - a.remats for a, b in itertools.pairwise(stats)]
    assert min(evictions) > 0 and min(remats) > 0  # the budget made dtr recompute
    # A value is cut at most every other step: compare windows of equal length.
    early, late = slice(8, 12), slice(steps - 5, steps - 1)
    for name, series in [
        ("pinned", [s.pinned_bytes for s in stats]),
        ("constants", [s.constant_bytes for s in stats]),
        ("resident", [s.resident_bytes for s in stats]),
        ("evictions", evictions),
        ("remats", remats),
    ]:
        assert max(series[late]) <= max(series[early]), (name, series[early], series[late])


def _live(kinds: tuple[type, ...]) -> Counter:
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects() if issubclass(type(o), kinds))


def test_carried_value_keeps_no_python_objects(subclass_engine):
    # Without a budget too: the subclass engine mirrors the core's lineage in Python
    # (nodes, recipes, values), which would grow with the running mean's lineage.
    from dtr.engines.subclass.recipe import Recipe
    from dtr.engines.subclass.tensor import Node

    kinds = (Node, Recipe, torch.Tensor)
    model = _mlp()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    live, traced = [], []
    with dtr.enable(cost_model="roofline"):
        running = None
        for step in range(350):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            d = loss.detach()
            running = d if running is None else 0.99 * running + 0.01 * d
            if step == 49:
                tracemalloc.start()
            if step in (199, 349):  # 150 steps apart, well after warm-up
                live.append(_live(kinds))
                traced.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
    before, after = live
    grown = {k: after[k] - before[k] for k in after if after[k] > before[k]}
    assert not grown, grown
    assert traced[1] - traced[0] < 64 * 1024, traced  # what Python allocated and still holds


def _handles() -> int:
    gc.collect()
    return sum(type(o) is RemovableHandle for o in gc.get_objects())


def test_hooks_of_per_step_input_leaves_are_pruned(native_engine):
    # Input saliency / adversarial training: a new leaf that requires grad every step.
    # (The subclass engine shares the pruning: dtr/leaf_hooks.py.)
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    batch = torch.randn(8, 16)
    eager = []
    for _ in range(3):
        x = batch.clone().requires_grad_()
        (x @ w).tanh().sum().backward()
        eager.append(x.grad)
    w.grad = None
    counts, grads = [], []
    with dtr.enable(engine="native", stress=True, cost_model="roofline") as session:
        for step in range(200):
            x = batch.clone().requires_grad_()
            (x @ w).tanh().sum().backward()
            if step < 3:
                grads.append(x.grad)
            if step % 25 == 24:
                counts.append(_handles())
    assert session.stats().remats > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, eager, strict=True))
    assert max(counts) <= counts[0] + 140, counts  # pruned when the list doubles (64+)


def _recurrence(w, h, steps):
    for _ in range(steps):
        h = torch.tanh(h @ w * 1.0001 + 0.5)
    return h


def _unrolled(engine, budget):
    torch.manual_seed(0)
    w = (torch.randn(32, 32) / 6).requires_grad_()
    h0 = torch.randn(16, 32)
    with dtr.enable(engine=engine, budget=budget, cost_model="roofline") as session:
        out = _recurrence(w, h0, 500)
        constants = session.stats().constant_bytes
        out.sum().backward()
    return w.grad, constants, session.stats()


def test_python_numbers_in_a_long_recurrence_are_not_memory(native_engine):
    # Four ops per step, two of them with a Python number: 2,000 ops, under a budget
    # the subclass engine meets.
    torch.manual_seed(0)
    w = (torch.randn(32, 32) / 6).requires_grad_()
    h0 = torch.randn(16, 32)
    _recurrence(w, h0, 500).sum().backward()
    budget = "64KiB"
    for engine in ("subclass", "native"):
        grad, constants, stats = _unrolled(engine, budget)
        assert torch.equal(grad, w.grad), engine
        # the constants are w and h0, however long the recurrence
        assert constants == w.nbytes + h0.nbytes, (engine, constants)
        assert stats.evictions > 0 and stats.remats > 0, engine

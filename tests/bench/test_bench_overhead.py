"""bench/overhead.py, quickly: the no-op dispatch mode it uses as the floor of a mode-based
design computes what eager computes, and the training-step comparison runs end to end on
test-size models and leaves no mode or session behind."""

from __future__ import annotations

import math

import torch

import dtr
from bench import overhead
from bench.models import MODELS, batches, build
from tests.utils import make_optimizer

STEP_TIMES = ("eager_ms", "mode_ms", "dtr_ms", "python_ms", "native_ms")


def _trained(name: str, context) -> list[torch.Tensor]:
    model = build(name)
    opt = make_optimizer("adam", model.parameters())
    torch.manual_seed(0)
    with context():
        for batch in batches(name, 2):
            overhead._train_step(MODELS[name], model, opt, batch)
    return [p.detach().clone() for p in model.parameters()]


def test_noop_mode_is_eager_bit_for_bit():
    for name in ("mlp", "tree"):
        eager = _trained(name, overhead._step_contexts()["eager"])
        floor = _trained(name, overhead._step_contexts()["no-op mode"])
        assert all(torch.equal(a, b) for a, b in zip(eager, floor, strict=True)), name


def _ops_per_step(name: str, steps: int) -> int:
    """The ops dtr serves per training step of `name` (test size), counted on its own."""
    model = build(name, scale=1)
    opt = make_optimizer("adam", model.parameters())
    with dtr.enable(engine="subclass") as session:
        for batch in batches(name, steps, scale=1):
            overhead._train_step(MODELS[name], model, opt, batch)
    return session.stats().ops // steps


def test_step_comparison_end_to_end():
    rows = overhead.steps(["mlp", "tree"], n=1, rounds=1, scale=1)
    assert [r["model"] for r in rows] == ["mlp", "tree"]
    for r in rows:
        assert set(r) == {"model", "scale", "ops", *STEP_TIMES}, r
        assert all(math.isfinite(r[key]) and r[key] > 0 for key in STEP_TIMES), r
        assert r["scale"] == 1
    # the op count is dtr's, per step (the MLP runs the same ops every step)
    assert rows[0]["ops"] == _ops_per_step("mlp", 2)
    assert torch._C._len_torch_dispatch_stack() == 0


def test_small_ops_table_has_the_native_engine():
    rows = overhead.small_ops(n=20, repeats=1)
    assert [r["op"] for r in rows] == list(overhead.SMALL_OPS)
    for r in rows:  # NaN: the native engine refused the op
        assert not math.isnan(r["native_us"]), f"the native engine refused {r['op']}"
        times = ("eager_us", "dtr_us", "budget_us", "python_us", "native_us")
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in times), r
        assert r["added_us"] == r["dtr_us"] - r["eager_us"], r

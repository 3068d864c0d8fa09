"""bench/overhead.py, quickly: the no-op dispatch mode it uses as the floor of a mode-based
design computes what eager computes, and the training-step comparison runs end to end on
test-size models and leaves no mode or session behind."""

from __future__ import annotations

import torch

from bench import overhead
from bench.harness import make_optimizer
from bench.models import MODELS, batches, build


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


def test_step_comparison_end_to_end():
    rows = overhead.steps(["mlp", "tree"], n=1, rounds=1, scale=1)
    assert [r["model"] for r in rows] == ["mlp", "tree"]
    for r in rows:
        for key in ("eager_ms", "mode_ms", "dtr_ms", "python_ms", "native_ms"):
            assert r[key] > 0, (r["model"], key)
        assert r["ops"] > 0 and r["scale"] == 1
    assert torch._C._len_torch_dispatch_stack() == 0


def test_small_ops_table_has_the_native_engine():
    rows = overhead.small_ops(n=20, repeats=1)
    assert [r["op"] for r in rows] == list(overhead.SMALL_OPS)
    assert all(r["native_us"] > 0 for r in rows)

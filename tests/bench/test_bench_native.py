"""bench/native.py end to end on the smallest bench model: every method runs in its own
process under both allocator settings, and each is compared with eager under the same
one."""

from __future__ import annotations

import pytest

from bench import native as bench_native

pytest.importorskip("dtr._C", reason="the native engine is C++")


def test_every_method_under_both_allocators():
    rows = bench_native.run(["tree"], [1.0], rounds=1, steps=1)
    got = {(r["allocator"], r["method"]) for r in rows}
    assert got == {(a, m) for a in bench_native.ALLOCATORS for m in bench_native.METHODS}
    assert all("error" not in r for r in rows), rows
    assert all(r["seconds"] > 0 and r["x_eager"] > 0 for r in rows)
    for allocator in bench_native.ALLOCATORS:
        (eager,) = [r for r in rows if r["method"] == "eager" and r["allocator"] == allocator]
        assert eager["x_eager"] == 1.0


def test_a_failing_run_is_a_row_not_a_crash():
    row = bench_native._measure("no-such-model", "eager", 1.0, 1, "held")
    assert "error" in row and "no-such-model" in row["error"]

"""bench/native.py end to end on the smallest bench model: every method runs in its own
process under both allocator settings, each is timed against eager under the same one,
and a budget of half an engine's own peak makes every engine evict and recompute."""

from __future__ import annotations

import pytest

from bench import native as bench_native

pytest.importorskip("dtr._C", reason="the native engine is C++")

# A row of a method that ran (an "x_eager" is added where eager ran too).
ROW_KEYS = {"model", "allocator", "ratio", "method", "seconds", "faults", "evictions", "remats"}


def test_every_method_under_both_allocators():
    rows = bench_native.run(["tree"], [1.0], rounds=1, steps=1)
    got = {(r["allocator"], r["method"]) for r in rows}
    assert got == {(a, m) for a in bench_native.ALLOCATORS for m in bench_native.METHODS}
    assert all("error" not in r for r in rows), rows
    for r in rows:
        assert set(r) == ROW_KEYS | {"x_eager"}, r
        assert r["evictions"] == 0 and r["remats"] == 0, r  # no budget: nothing evicted
        assert r["faults"] >= 0 and r["seconds"] > 0, r
    for allocator in bench_native.ALLOCATORS:
        (eager,) = [r for r in rows if r["method"] == "eager" and r["allocator"] == allocator]
        for r in rows:
            if r["allocator"] == allocator:
                assert r["x_eager"] == r["seconds"] / eager["seconds"], r


def test_a_budget_makes_every_engine_evict_and_recompute():
    # Below 1 the methods are the engines alone (eager has no budget), each at half of
    # its own unbudgeted peak, measured in the same process.
    rows = bench_native.run(["tree"], [0.5], rounds=1, steps=1, allocators=("glibc",))
    assert [r["method"] for r in rows] == [m for m in bench_native.METHODS if m != "eager"]
    for r in rows:
        assert set(r) == ROW_KEYS, r
        assert r["evictions"] > 0 and r["remats"] > 0, r


def test_a_failing_run_is_a_row_not_a_crash():
    row = bench_native._measure("no-such-model", "eager", 1.0, 1, "held")
    assert "error" in row and "no-such-model" in row["error"]

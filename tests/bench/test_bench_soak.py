"""bench/soak.py, briefly: a short soak on each engine samples every column, stays
within its budget, and finds dtr's counts and the process's memory flat."""

from __future__ import annotations

import pytest

from bench import soak


@pytest.mark.parametrize("engine", soak.ENGINES)
def test_short_soak_is_flat(engine):
    if engine == "native":
        pytest.importorskip("dtr._C", reason="the native engine is C++")
    rows = soak.run(engine, steps=60, every=10)
    assert [r["step"] for r in rows] == list(range(10, 61, 10))
    for r in rows:
        assert set(soak.COLUMNS) <= set(r)
        assert r["resident_bytes"] <= r["budget_bytes"]
    assert min(r["evictions_per_step"] for r in rows) > 0  # the budget binds
    flat = soak.flatness(rows)
    assert set(flat) == set(soak.COLUMNS)
    assert all(flat.values()), (flat, rows[1], rows[-1])
    assert rows[-1]["rss_kib"] - rows[1]["rss_kib"] < 4096

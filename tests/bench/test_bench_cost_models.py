"""bench/cost_models.py, briefly: on each engine, GPT-2 at half its memory above the
parameters meets the budget with the default cost model (roofline) in every run, with
the same evictions and recomputations each time; every run that meets it, with either
cost model, is bitwise as eager."""

from __future__ import annotations

import csv

import pytest

from bench import cost_models


@pytest.mark.parametrize("engine", ["native", "subclass"])
def test_the_default_repeats_its_decisions_and_both_match_eager(engine, tmp_path):
    if engine == "native":
        pytest.importorskip("dtr._C", reason="the native engine is C++")
    pytest.importorskip("transformers")
    out = tmp_path / "cost_models.csv"
    args = ["--models", "gpt2", "--ratios", "0.5", "--repeats", "2", "--timed", "1"]
    cost_models.main([*args, "--engines", engine, "--out", str(out)])
    with open(out) as f:
        rows = {r["cost_model"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["roofline", "time"]
    for row in rows.values():  # (measured costs may miss the budget in some runs)
        met = row["feasible"].split("/")[0]
        assert row["bitwise"] == f"{met}/{met}", row
    default = rows["roofline"]
    assert default["feasible"] == "2/2", default
    assert default["distinct"] == "1" and int(default["evictions"]) > 0, default
    assert default["vs_roofline"] == "1.000"

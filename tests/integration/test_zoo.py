"""bench.zoo at test size: three zoo entries (a transformers LM, a timm vision
transformer, the repo's unrolled LSTMCell LM) with no budget and under a budget that
forces evictions, bitwise with eager. The whole zoo is a benchmark (python -m bench.zoo)."""

from __future__ import annotations

import pytest

pytest.importorskip("timm")
pytest.importorskip("transformers")

from bench import zoo  # noqa: E402

# A bench script's smoke run (python -m bench.zoo at test size), and a slow one.
pytestmark = [pytest.mark.bench, pytest.mark.slow]

CASES = [("gpt2", 0.5), ("swin_small_config", 0.7), ("lstmcell_lm", 1.0)]


@pytest.mark.parametrize("engine", ["native", "subclass"])
@pytest.mark.parametrize("name,ratio", CASES, ids=[c[0] for c in CASES])
def test_zoo_entry_trains_bitwise_under_a_budget(engine, name, ratio):
    rows, _ = zoo.sweep(zoo.ZOO[name], engine, [ratio], timed=0, timeout=300, progress=lambda n=1: None)
    by_config = {r[3]: dict(zip(zoo.HEADER, r, strict=True)) for r in rows}
    assert set(by_config) == {"eager", "no budget", f"a{ratio:g}"}
    for config, row in by_config.items():
        assert row["status"] == "ok", f"{name} {config}: {row['status']} {row['detail']}"
        assert row["bitwise"] == "yes", f"{name} {config} differs from eager: {row['detail']}"
    budgeted = by_config[f"a{ratio:g}"]
    if ratio < 1:
        assert budgeted["evictions"] > 0 and budgeted["remats"] > 0
    assert float(budgeted["dtr_peak_mib"]) <= float(budgeted["budget_mib"]) + 0.05

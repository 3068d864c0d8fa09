"""CUDA's memory history inside a dtr.enable() session: torch.cuda.memory's
_record_memory_history() and _snapshot() work around a budgeted training step (the
subclass engine runs on CUDA), the snapshot holds the step's segments and allocation
events, and the step's recomputations are `dtr::remat` ranges in a profiler trace.
Skipped without a CUDA device; bench/gpu_check.sh runs it."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dtr
from bench.models import MODELS, batches, build

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)

NAME = "cnn"


def _step(model, batch):
    MODELS[NAME].loss(model, batch).backward()


def test_memory_history_and_remat_ranges_of_a_budgeted_step(tmp_path):
    torch.manual_seed(0)
    model = build(NAME).cuda()
    (batch,) = batches(NAME, 1)
    batch = tuple(t.cuda() for t in batch)
    with dtr.enable(engine="subclass", cost_model="roofline") as free:
        _step(model, batch)
    budget = int(0.4 * free.stats().peak_resident_bytes)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with dtr.enable(engine="subclass", budget=budget, cost_model="roofline") as session:
                _step(model, batch)
                torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

    stats = session.stats()
    assert stats.evictions > 0 and stats.remats > 0
    assert snapshot["segments"], "no segments in the snapshot"
    events = [e for trace in snapshot["device_traces"] for e in trace]
    # the step's allocations and frees, its recomputations' included, were recorded
    allocs = sum(e["action"] == "alloc" for e in events)
    assert allocs > stats.remats > 0, (allocs, stats.remats)
    assert any(e["action"] == "free_requested" for e in events)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    names = [e.get("name") for e in json.loads(path.read_text())["traceEvents"]]
    assert names.count("dtr::remat") == stats.remats

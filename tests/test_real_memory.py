"""A budget is held in real memory: what the allocator hands out during a training step
under a budget, metered independently by torch.profiler, stays within it.

dtr's own count covers the values it manages and the constants their ops read; a
kernel's own buffers (convolution_backward's workspace, larger than its outputs) are
allocated on top of it. The engines learn what each op had allocated at most, per op and
input shapes, and make room for that before the next such call (dtr/reserve.py). The
first step of a run meets every op for the first time, so it is the step after it that
is metered here.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dtr
from bench.common import profiled_bytes
from bench.models import MODELS, batches, build

# Allocations the profiler sees that are not the program's memory in dtr's sense: the
# allocator's bookkeeping of scalar temporaries and the like, a few KiB a step.
SLACK_BYTES = 64 << 10
STEPS = 3


def _metered_step(name: str, engine: str, budget: int | None):
    """Train STEPS steps under dtr; returns (the real peak of the last step: the
    parameters and the batch plus the most the profiler saw allocated on top of them,
    the session's stats). Gradients exist before the block and are accumulated in place,
    so the step's allocations are its activations, temporaries and workspaces."""
    spec = MODELS[name]
    torch.manual_seed(0)
    model = build(name)
    data = batches(name, STEPS)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.collect()  # garbage freed inside the profile would count as negative allocations
    with dtr.enable(engine=engine, budget=budget, cost_model="roofline") as session:
        for i, batch in enumerate(data):
            if i == STEPS - 1:
                base = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *batch])
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    spec.loss(model, batch).backward()
            else:
                spec.loss(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        stats = session.stats()
    return base + profiled_bytes(prof)[1], stats


@pytest.mark.parametrize("fraction", [0.6, 0.4])
@pytest.mark.parametrize("name", ["cnn", "transformer", "lstm"])
def test_real_peak_of_a_step_stays_within_the_budget(name, fraction, engine):
    _, free = _metered_step(name, engine, None)
    budget = int(fraction * free.peak_resident_bytes)
    real, stats = _metered_step(name, engine, budget)
    assert stats.evictions > 0 and stats.remats > 0
    assert real <= 1.05 * budget + SLACK_BYTES, (
        f"{name} at {fraction} of its peak: the allocator handed out {real} bytes at most "
        f"under a budget of {budget} ({real / budget:.2f}x)"
    )

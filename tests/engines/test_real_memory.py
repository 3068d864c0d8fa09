"""A budget is held in real memory: what the allocator hands out during a training step
under a budget, metered independently by torch.profiler, stays within it.

dtr's own count covers the values it manages and the constants their ops read; a kernel's own
buffers (convolution_backward's workspace, larger than its outputs) are allocated on top of it. The
engines learn what each op had in use at most, per op and input shapes, and make room for that
before the next such call, and a recomputation makes room for what its op had in use when it first
ran (dtr/engines/subclass/kernel_peaks.py). The first step of a run meets every op for the first
time, so it is a later step that is metered here.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dtr
from bench.models import MODELS, batches, build
from tests.utils import profiled_bytes

# Allocations the profiler sees that are not the program's memory in dtr's sense: the
# allocator's bookkeeping of scalar temporaries and the like, a few KiB a step.
SLACK_BYTES = 64 << 10
STEPS = 3


def _train(name: str, engine: str | None, budget: int | None):
    """Train STEPS steps (under dtr unless engine is None); returns (the real peak of the
    last step: the parameters and the batch plus the most the profiler saw allocated on
    top of them, the session's stats or None, the parameters after training).
    Gradients exist before the block and are accumulated in place, so the step's
    allocations are its activations, temporaries and workspaces."""
    spec = MODELS[name]
    torch.manual_seed(0)
    model = build(name)
    data = batches(name, STEPS)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.collect()  # garbage freed inside the profile would count as negative allocations
    session = dtr.enable(engine=engine, budget=budget, cost_model="roofline") if engine else None
    stats = None
    with session if session is not None else contextlib.nullcontext():
        for i, batch in enumerate(data):
            if i == STEPS - 1:
                base = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *batch])
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    spec.loss(model, batch).backward()
            else:
                spec.loss(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        if session is not None:
            stats = session.stats()
    return base + profiled_bytes(prof)[1], stats, [p.detach().clone() for p in model.parameters()]


@functools.cache
def _unbudgeted(name: str, engine: str):
    """(dtr's peak with no budget, the parameters eager PyTorch trains)."""
    _, free, _ = _train(name, engine, None)
    _, _, params = _train(name, None, None)
    return free.peak_resident_bytes, params


# The CNN at 0.4 of its peak is not held: recomputation chains there lock nearly the
# whole budget (832 KiB locked and 98 KiB pinned of 1.01 MiB while batch norm is rebuilt)
# and the convolutions rerun in them allocate their workspaces on top (1.29x the budget).
# Making room for a rerun's workspace as for a first run's does not help: evicting more
# lengthens the chains, and the budget becomes infeasible.
CASES = [
    ("cnn", 0.6),
    pytest.param(
        "cnn", 0.4, marks=pytest.mark.xfail(strict=True, reason="1.29x: workspaces in chains")
    ),
    ("transformer", 0.6),
    ("transformer", 0.4),
    ("lstm", 0.6),
    ("lstm", 0.4),
]


@pytest.mark.parametrize("name, fraction", CASES)
def test_real_peak_of_a_step_stays_within_the_budget(name, fraction, engine):
    peak, eager_params = _unbudgeted(name, engine)
    budget = int(fraction * peak)
    real, stats, params = _train(name, engine, budget)
    assert stats.evictions > 0 and stats.remats > 0
    for got, want in zip(params, eager_params, strict=True):
        assert torch.equal(got, want)
    assert real <= 1.05 * budget + SLACK_BYTES, (
        f"{name} at {fraction} of its peak: the allocator handed out {real} bytes at most "
        f"under a budget of {budget} ({real / budget:.3f}x)"
    )


@pytest.mark.parametrize("name", ["cnn", "lstm"])
def test_stats_real_peak_is_the_allocators_and_covers_dtrs_count(name, engine):
    # One step, profiled from before the block to after it: the profiler's running sum
    # of allocations is an independent meter of the same allocations.
    spec = MODELS[name]
    peak, _ = _unbudgeted(name, engine)
    torch.manual_seed(0)
    model = build(name)
    (batch,) = batches(name, 1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    base = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *batch])
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with dtr.enable(engine=engine, budget=int(0.4 * peak), cost_model="roofline") as s:
            spec.loss(model, batch).backward()
    stats = s.stats()  # (after the block: what it measured stays)
    assert stats.evictions > 0 and stats.remats > 0
    profiled = profiled_bytes(prof)[1]
    # the meter counts large blocks rounded up to pages, the profiler as requested
    assert abs(stats.real_peak_bytes - profiled) <= 0.01 * profiled + (16 << 10), (
        stats.real_peak_bytes,
        profiled,
    )
    # dtr's count also holds the parameters and the batch, allocated before the block
    assert base + stats.real_peak_bytes >= stats.peak_resident_bytes

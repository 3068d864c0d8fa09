"""The op-level floor, live: no budget below the constants plus what one op has resident
at once (its inputs and its outputs) can run a step. Both engines
track it in the core (Stats.op_floor_bytes), refuse a budget below it with a BudgetError
that names it, and a budget at or above it is not refused for that reason."""

from __future__ import annotations

import contextlib
import gc
import re

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dtr
from tests.utils import profiled_bytes
from bench.models import MODELS, batches, build
from dtr import errors
from dtr.units import format_bytes

NAME = "mlp"
ROOMY = 1 << 30  # a budget that evicts nothing, but learns each op's room as a tight one


def _run(engine: str | None, budget: int | None, warm: bool = False):
    """One training step of NAME (under dtr unless engine is None; warm: after a step
    under ROOMY in the same session, which shows dtr every op). Returns (the error's
    message or None, the stats read where it was caught inside the block, the stats
    after it, the gradients)."""
    spec = MODELS[NAME]
    torch.manual_seed(0)
    model = build(NAME)
    (batch,) = batches(NAME, 1)
    if engine is None:
        spec.loss(model, batch).backward()
        return None, None, None, [p.grad for p in model.parameters()]
    message = inside = None
    start = ROOMY if warm else budget
    with dtr.enable(engine=engine, budget=start, cost_model="roofline") as session:
        if warm:
            spec.loss(model, batch).backward()
            model.zero_grad(set_to_none=True)
            session.set_budget(budget)
        try:
            spec.loss(model, batch).backward()
        except RuntimeError as exc:  # the native engine's may come through autograd's
            assert errors.is_budget_error(exc), exc
            message = str(exc)  # (the exception's frames would hold the step's tensors)
            inside = session.stats()
        grads = [None if p.grad is None else dtr.materialize(p.grad) for p in model.parameters()]
    return message, inside, session.stats(), grads


def _floor(engine: str) -> int:
    message, _, stats, _ = _run(engine, ROOMY)
    assert message is None and stats.evictions == 0
    return stats.op_floor_bytes


def test_a_budget_below_the_floor_fails_naming_it(engine):
    # (A first step under it can fail before it reaches the op that sets the floor, and
    # names the floor seen so far: shown every op first, dtr names the whole step's.)
    floor = _floor(engine)
    message, inside, _, _ = _run(engine, floor - 1, warm=True)
    assert message is not None
    # the numbers are the session's: its floor, its constants
    assert inside.op_floor_bytes == floor
    assert f"(constants) take {format_bytes(inside.constant_bytes)};" in message, message
    found = re.search(
        r"No budget below (.+?) can run this step \((aten\.\S+) needs (.+?) at once on top of "
        r"the constants\)\. Raise the budget to at least (\d+) bytes \((.+?)\), or reduce the "
        r"batch size\.$",
        message,
    )
    assert found is not None, message
    assert found[1] == format_bytes(floor) == found[5]
    assert int(found[4]) == floor


def test_above_the_floor_the_message_gives_the_peak_of_a_step_without_eviction(engine):
    # A budget at the floor that the schedule still cannot meet, after a step (closed by
    # the optimizer) that evicted nothing: the advice is to raise it toward that peak.
    floor = _floor(engine)
    spec = MODELS[NAME]
    torch.manual_seed(0)
    model = build(NAME)
    (batch,) = batches(NAME, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dtr.enable(engine=engine, budget=ROOMY, cost_model="roofline") as session:
        spec.loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
        peak = session.stats().max_transient_bytes
        session.set_budget(floor)
        with pytest.raises(RuntimeError) as info:
            spec.loss(model, batch).backward()
    message = str(info.value)
    assert errors.is_budget_error(info.value) and peak > floor
    assert f"No budget below {format_bytes(floor)} can run the steps so far" in message
    assert message.endswith(
        f"A step that evicted nothing peaked at {format_bytes(peak)}. Raise the budget toward "
        f"{format_bytes(peak)} (where nothing is evicted), or reduce the batch size."
    ), message


def test_the_floor_is_at_most_the_smallest_feasible_budget(engine):
    floor = _floor(engine)
    _, _, free, _ = _run(engine, None)
    _, _, _, want = _run(None, None)
    low, high = floor - 1, free.peak_resident_bytes  # infeasible, feasible
    assert _run(engine, low)[0] is not None
    assert _run(engine, high)[0] is None
    while high - low > max(high // 64, 1):
        mid = (low + high) // 2
        if _run(engine, mid)[0] is None:
            high = mid
        else:
            low = mid
    assert floor <= high
    message, _, stats, got = _run(engine, high)
    assert message is None and stats.evictions > 0 and stats.remats > 0
    assert stats.op_floor_bytes == floor
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_the_floor_is_the_simulators(engine, tmp_path):
    """The live floor covers dtr.sim.floor's of the same run's trace, computed offline
    from the same events."""
    from dtr.sim import load
    from dtr.sim.floor import op_floor

    spec = MODELS[NAME]
    torch.manual_seed(0)
    model = build(NAME)
    (batch,) = batches(NAME, 1)
    path = str(tmp_path / "trace.jsonl")
    with dtr.enable(engine=engine, cost_model="roofline", trace=path) as session:
        spec.loss(model, batch).backward()
    assert session.stats().op_floor_bytes == op_floor(load(path)) > 0

SLACK_BYTES = 64 << 10  # the allocator's bookkeeping of scalar temporaries (test_real_memory)


def _profiler():
    gc.collect()  # garbage freed inside the profile would count as negative allocations
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.start()
    return prof


def _stop(prof) -> tuple[int, int]:
    """(what was left allocated, the most allocated at once) while prof ran."""
    prof.stop()
    return profiled_bytes(prof)


@pytest.mark.parametrize("leaves", [False, True], ids=["caught_in_the_block", "leaves_the_block"])
def test_a_failing_step_stays_within_the_budget_and_leaves_nothing_allocated(engine, leaves):
    """A step that fails on a budget below the floor (set after a step that taught dtr
    each op's needs) allocates no more than the budget on the way; caught inside the
    block, the error leaves dtr's count within the budget; and once the block has ended,
    what the step allocated is freed: the program holds nothing new (its gradients exist
    before the block and are accumulated in place). (Caught in the block, what the step
    made stays, within the budget, until the next op releases the handles the program
    dropped: Invariant 5.)"""
    floor = _floor(engine)
    budget = floor - 1
    spec = MODELS[NAME]
    torch.manual_seed(0)
    model = build(NAME)
    (batch,) = batches(NAME, 1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    base = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *batch])
    messages = []

    def failing_step():
        try:
            spec.loss(model, batch).backward()
        except RuntimeError as exc:
            assert errors.is_budget_error(exc), exc
            messages.append(str(exc))
            if leaves:
                raise

    session = dtr.enable(engine=engine, budget=ROOMY, cost_model="roofline")
    with pytest.raises(RuntimeError) if leaves else contextlib.nullcontext():
        with session:
            spec.loss(model, batch).backward()
            session.set_budget(budget)
            prof = _profiler()
            failing_step()
            assert session.stats().resident_bytes <= budget
    gc.collect()  # (the error leaving the block is freed with the frames it holds)
    left, peak = _stop(prof)
    assert len(messages) == 1 and f"No budget below {format_bytes(floor)}" in messages[0]
    assert base + peak <= 1.05 * budget + SLACK_BYTES, (base + peak, budget)
    assert left <= SLACK_BYTES, left


def test_both_cores_track_the_same_floor():
    """The C++ core and its Python twin see the same floor from the same calls: the
    constants, each input pool once, and the fresh outputs; per step and for the session;
    a record the engine makes itself (no name) is no op of the program."""
    from dtr.core.reference import NEW, VERSION, PyCore

    cpp = pytest.importorskip("dtr._C", reason="the C++ core")
    cores = [PyCore("dtr", -1, 0), cpp.Core("dtr", -1, 0)]
    seen = []
    for core in cores:
        w = core.new_constant(100)
        (a,) = core.record([w], 1.0, [NEW], [-1], [40], "aten.a")
        (b,) = core.record([a, a, w], 1.0, [NEW], [-1], [30], "aten.b")
        first = (core.op_floor_bytes, core.floor_need_bytes, core.floor_op, core.step_floor_bytes)
        core.record([b], 0.0, [VERSION], [b], [0])  # (no name: the engine's own, not counted)
        core.end_step()
        core.record([a], 1.0, [NEW], [-1], [10], "aten.c")
        core.budget = 100
        fits = (core.op_fits(), core.op_fits())  # the need is held against one settle
        now = (core.op_floor_bytes, core.floor_step, core.step, core.step_floor_bytes)
        seen.append((first, *now, core.last_need, core.free_peak_bytes, fits))
    assert seen[0] == ((170, 70, "aten.b", 170), 170, 0, 1, 150, 150, 170, (False, True))
    assert all(s == seen[0] for s in seen)

"""Memory: dtr's byte count against an independent measure, budgets that hold, budgets
that cannot, and no growth over many steps."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import dtr
import dtr.device
import dtr.engines.subclass.kernel_peaks
from bench.models import MODELS, batches, build
from tests.utils import profiled_bytes, train, unbudgeted_peak


def _profiled_forward(name: str, dtr_kwargs: dict):
    """A forward pass under dtr inside torch.profiler. Returns (bytes the profiler saw
    still allocated at the end, relative to the start; the largest such value at any
    point; dtr's count of the tensors created in the pass, at the end and at most).
    Parameters and the batch exist before the profile starts: they are in dtr's count
    (as constants) but not in the profiler's, so they are subtracted."""
    spec = MODELS[name]
    model = build(name)
    batch = batches(name, 1)[0]
    before = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *batch])
    torch.manual_seed(0)
    # Garbage of earlier tests (tensors in reference cycles) freed by a collection inside
    # the profile would count as negative allocations: collect it first.
    gc.collect()
    with dtr.enable(**dtr_kwargs) as session:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = spec.loss(model, batch)
            stats = session.stats()
        del loss
    live, peak = profiled_bytes(prof)
    return live, peak, stats.resident_bytes - before, stats.max_transient_bytes - before, stats


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_byte_count_matches_profiler(name, core):
    # Tolerance: 1% of the count plus 1 KiB, for allocations dtr does not track by
    # design (scalar temporaries that die inside an op).
    live, peak, counted, counted_max, _ = _profiled_forward(name, {"cost_model": "roofline"})
    assert abs(live - counted) <= 0.01 * counted + 1024, (live, counted)
    # The profiler also sees workspaces inside ops, so its peak may only be higher.
    assert peak >= counted_max - 1024


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_evictions_really_free_memory(name, core):
    # Under a budget the profiler must see the evicted storages freed: what it finds
    # still allocated agrees with dtr's resident count, which is within the budget.
    free = _profiled_forward(name, {})[-1]
    budget = int(free.peak_resident_bytes * 0.4)
    live, _, counted, _, stats = _profiled_forward(
        name, {"budget": budget, "cost_model": "roofline"}
    )
    assert stats.evictions > 0
    assert stats.resident_bytes <= budget
    assert abs(live - counted) <= 0.01 * counted + 1024, (live, counted)


def test_no_growth_over_200_steps(core):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    resident, counts = [], []
    with dtr.enable(budget=110 * 1024, cost_model="roofline") as session:
        for _ in range(200):
            x = torch.randn(64, 32, generator=g)
            y = torch.randint(0, 10, (64,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            stats = session.stats()
            resident.append(stats.resident_bytes)
            rt = session._runtime
            mirror = (len(rt.storages), len(rt.escaped), len(rt.leaf_hooks))
            counts.append((*rt.core.counts(), *mirror))
    assert stats.evictions > 0
    assert max(resident[100:]) <= max(resident[:10])
    # tensors, pools, recipes, constants, handed-out values, gradient hooks
    for k in range(6):
        assert max(c[k] for c in counts[100:]) <= max(c[k] for c in counts[:10]), k


def test_gradient_hooks_of_dead_leaves_are_forgotten(core):
    # A leaf that requires grad made every step (an adversarial perturbation, a learned
    # input): the hooks dtr puts on leaves must not pile up over a long block.
    w = torch.randn(16, 16, requires_grad=True)
    with dtr.enable(budget="64KiB", cost_model="roofline") as session:
        rt = session._runtime
        sizes = []
        for _ in range(500):
            delta = torch.zeros(8, 16, requires_grad=True)
            (torch.ones(8, 16) + delta).mm(w).tanh().sum().backward()
            sizes.append(len(rt.leaf_hooks))
    assert max(sizes[100:]) <= 130, max(sizes)
    assert w.grad is not None and type(w.grad) is torch.Tensor


def test_parameters_keep_no_trace_of_a_session(core):
    # No weak reference left on a parameter: torch.utils.swap_tensors (load_state_dict
    # and .to() with swap_module_params_on_conversion) refuses tensors that have one.
    model = nn.Linear(4, 4)
    for _ in range(2):
        with dtr.enable():
            model(torch.randn(2, 4)).sum().backward()
            assert weakref.getweakrefcount(model.weight) == 0
    torch.utils.swap_tensors(model.weight, nn.Parameter(torch.zeros(4, 4)))
    assert torch.equal(model.weight, torch.zeros(4, 4))


def test_infeasible_budget_fails_fast_with_the_numbers(core, logged):
    with pytest.raises(dtr.BudgetError) as info:
        train("cnn", steps=1, dtr_kwargs={"budget": "64KiB"})
    # fast: within the first few ops, not after a loop of evictions and recomputations
    assert logged[-1].ops <= 3 and logged[-1].remats == 0
    msg = str(info.value)
    assert msg.startswith("dtr: cannot stay within the memory budget of 64.00 KiB")
    for part in ("resident", "requested", "pinned", "locked", "Largest unevictable"):
        assert part in msg
    assert isinstance(info.value, torch.OutOfMemoryError)
    assert isinstance(info.value, dtr.DTRError)
    # The process stays usable and a later session works.
    got = train("mlp", steps=1, dtr_kwargs={"stress": True})
    assert got.stats.remats > 0


def test_budget_below_one_op_is_reported(core):
    x = torch.randn(256, 256, requires_grad=True)
    with pytest.raises(dtr.BudgetError, match="requested"):
        with dtr.enable(budget="100KB"):
            (x @ x).sum().backward()


def _modelled_allocator(monkeypatch, other_bytes: int) -> list[int]:
    """measure='allocator' on this CPU machine: an allocator whose count is dtr's resident
    bytes plus `other_bytes` of memory dtr does not manage (on CUDA the count is the
    caching allocator's, dtr/device.py). Returns the list of counts it reported."""
    reads: list[int] = []

    def make_meter():
        def meter() -> int:
            reads.append(dtr.session.current()._runtime.core.resident_bytes + other_bytes)
            return reads[-1]

        return meter

    monkeypatch.setattr(dtr.device, "allocator_meter", make_meter)
    return reads


def test_measure_allocator_takes_unmanaged_memory_off_the_budget(core, monkeypatch):
    # The budget counts the whole device: with a quarter of the peak held by memory dtr
    # does not manage, a budget of the peak leaves three quarters for what it does.
    expected = train("cnn", steps=2)
    peak = train("cnn", steps=2, dtr_kwargs={}).stats.peak_resident_bytes
    other = peak // 4
    options = {"budget": peak, "cost_model": "roofline"}
    own = train("cnn", steps=2, dtr_kwargs=options)
    reads = _modelled_allocator(monkeypatch, other)
    got = train("cnn", steps=2, dtr_kwargs={**options, "measure": "allocator"})
    assert len(reads) >= got.stats.ops  # read at every op boundary
    assert got.losses == expected.losses
    assert all(torch.equal(a, b) for a, b in zip(got.params, expected.params, strict=True))
    assert got.stats.unmanaged_bytes == other
    assert got.stats.peak_resident_bytes <= peak - other
    assert got.stats.evictions > own.stats.evictions and got.stats.remats > 0


def test_measure_allocator_when_unmanaged_memory_fills_the_budget(core, monkeypatch):
    _modelled_allocator(monkeypatch, 10 * 2**20)
    with pytest.raises(dtr.BudgetError) as info:
        train("mlp", steps=1, dtr_kwargs={"budget": "8MiB", "measure": "allocator"})
    msg = str(info.value)
    assert msg.startswith("dtr: cannot stay within the memory budget of 8.00 MiB")
    assert "10.00 MiB on it is memory dtr does not manage" in msg
    assert "leaving 0 B for what it does" in msg


@pytest.mark.parametrize("heuristic", dtr.HEURISTICS)
def test_each_heuristic_trains_the_cnn_at_half(heuristic, core):
    expected = train("cnn", steps=2)
    peak = train("cnn", steps=2, dtr_kwargs={}).stats.peak_resident_bytes
    got = train(
        "cnn",
        steps=2,
        dtr_kwargs={"budget": peak // 2, "heuristic": heuristic, "cost_model": "roofline"},
    )
    assert got.losses == expected.losses
    assert all(torch.equal(a, b) for a, b in zip(got.params, expected.params, strict=True))
    assert got.stats.peak_resident_bytes <= peak // 2
    assert got.stats.heuristic == heuristic


@pytest.mark.parametrize("name", ["lstm", "mlp", "transformer"])
def test_room_is_made_before_an_op_that_was_seen(name, core, monkeypatch):
    # An op's fresh outputs exist before the boundary that evicts for them; from the
    # second step on, dtr knows their size (dtr/engines/subclass/kernel_peaks.py) and evicts first, so the
    # transient count stays within 5% of the budget (ops that read no managed value,
    # such as a dropout mask's rand_like, reserve nothing). The LSTM's layer op returns a
    # large workspace: without the reservation its steps overshoot a 40% budget by more
    # than a third of it (checked below). (Its layer op needs 31% of the peak at once,
    # the op-level floor: no lower budget runs it.)
    peak = unbudgeted_peak(name)
    budget = int(peak * (0.4 if name == "lstm" else 0.3))

    def steps():
        with dtr.enable(budget=budget, cost_model="roofline", log_steps=True) as session:
            spec, model = MODELS[name], build(name)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for batch in batches(name, 3):
                spec.loss(model, batch).backward()
                opt.step()
                opt.zero_grad()
        return session.steps()

    later = [s.max_transient_bytes for s in steps()[1:]]
    assert max(later) <= budget * 1.05, (later, budget)
    monkeypatch.setattr(
        dtr.engines.subclass.kernel_peaks.OutputSizes,
        "predict",
        lambda self, func, leaves: ((func,), 0),
    )
    try:
        without = [s.max_transient_bytes for s in steps()[1:]]
    except dtr.BudgetError:
        # Without the reservation the budget may not be feasible at all (the MLP under
        # dtr_held: the outputs made before the boundary leave a recomputation no room);
        # the LSTM must still run, and overshoot (below).
        assert name != "lstm"
        return
    if name == "lstm":
        assert max(without) > budget * 1.35, (without, budget)

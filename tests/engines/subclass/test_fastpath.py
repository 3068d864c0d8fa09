"""The C++ per-op fast path (csrc/subclass/fastpath.cpp) against the Python path it stands in for.

The fast path serves the common op in one call into C++ and hands every other op to
Runtime.handle. It must make the same core calls in the same order, so the same program
under the same budget evicts the same tensors, and compute the same values bit for bit.
The rest of the suite's subclass-engine tests run on it too (every test with the C++ core
and no trace).
"""

from __future__ import annotations

import collections
import gc
import weakref

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dtr
import dtr.engines.subclass.runtime
from bench.models import MODELS as SPECS
from bench.models import batches, build
from tests.conftest import HAVE_CPP
from tests.utils import make_optimizer, mismatches, profiled_peak, train, unbudgeted_peak

# The fast path is the subclass engine's; dtr.enable() here runs that engine.
pytestmark = [
    pytest.mark.skipif(not HAVE_CPP, reason="the C++ core is not built"),
    pytest.mark.usefixtures("subclass_engine"),
]

MODELS = ["mlp", "cnn", "lstm", "transformer", "tree"]


@pytest.mark.parametrize("mode", ["budget", "stress"])
@pytest.mark.parametrize("name", MODELS)
def test_fast_and_python_paths_evict_alike(name, mode, logged, monkeypatch):
    kwargs = {"cost_model": "roofline"}
    if mode == "stress":  # every reuse is a recomputation
        kwargs["stress"] = True
    else:
        kwargs["budget"] = int(unbudgeted_peak(name) * 0.4)
    fast = train(name, dtr_kwargs=kwargs)
    fast_log = logged[-1].eviction_log()
    monkeypatch.setattr(dtr.engines.subclass.runtime, "FAST_PATH", False)
    slow = train(name, dtr_kwargs=kwargs)
    # (stress mode's evictions are not the heuristic's choices: not in the log)
    assert fast.stats.remats > 0 and (len(fast_log) > 0 or mode == "stress")
    assert logged[-1].eviction_log() == fast_log
    for field in ("ops", "evictions", "eager_evictions", "remats", "peak_resident_bytes"):
        assert getattr(fast.stats, field) == getattr(slow.stats, field), field
    assert not mismatches(fast, slow)
    assert not mismatches(train(name), fast)  # and both are eager's, bit for bit


def _profiled_peak(name: str, dtr_kwargs: dict) -> int:
    """The profiler's peak over three Adam steps under dtr (profiling from before the
    session, so every allocation of the run is known)."""
    model = build(name)
    opt = make_optimizer("adam", model.parameters())
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.start()
    try:
        with dtr.enable(**dtr_kwargs):
            for batch in batches(name, 3):
                SPECS[name].loss(model, batch).backward()
                opt.step()
                opt.zero_grad()
    finally:
        prof.stop()
    return profiled_peak(prof)


@pytest.mark.parametrize("name", ["tree", "transformer"])
def test_fast_and_python_paths_hold_the_same_memory(name, monkeypatch):
    # Same decisions, same memory: a replay from C++ once filled the recipe's own list of
    # arguments with the values it ran on (cat's and stack's inputs), which then lived
    # as long as the recipe, evicted or not (test-size tree at 40% of its peak: 92,700
    # against 51,100 bytes; bench scale: 28.2 against 17.7 MiB).
    kwargs = {"budget": int(unbudgeted_peak(name) * 0.4), "cost_model": "roofline"}
    fast = _profiled_peak(name, kwargs)
    monkeypatch.setattr(dtr.engines.subclass.runtime, "FAST_PATH", False)
    assert fast == _profiled_peak(name, kwargs)


def test_replays_leave_their_recipes_as_recorded():
    # A recipe keeps None for each tensor argument, also in lists (cat, stack), after
    # stress mode has replayed it many times.
    model = build("tree")
    with dtr.enable(stress=True, cost_model="roofline") as session:
        loss = SPECS["tree"].loss(model, batches("tree", 1)[0])
        assert session.stats().remats > 0
        recipes = [r for r in session._runtime.recipes if r is not None]
        assert any("cat" in str(r.func) for r in recipes)
        for rec in recipes:
            for arg in (*rec.args, *(rec.kwargs or {}).values()):
                items = arg if isinstance(arg, (list, tuple)) else [arg]
                assert not any(isinstance(x, torch.Tensor) for x in items), rec.func
        loss.backward()


def _fallbacks(monkeypatch) -> collections.Counter:
    """Counts the ops the fast path hands to Runtime.handle, by name."""
    counts: collections.Counter = collections.Counter()
    handle = dtr.engines.subclass.runtime.Runtime.handle

    def counted(self, func, args, kwargs):
        counts[str(func)] += 1
        return handle(self, func, args, kwargs)

    monkeypatch.setattr(dtr.engines.subclass.runtime.Runtime, "handle", counted)
    return counts


@pytest.mark.parametrize("name", ["transformer", "tree"])
def test_fast_path_serves_the_common_ops(name, monkeypatch):
    counts = _fallbacks(monkeypatch)
    budget = int(unbudgeted_peak(name) * 0.5)
    run = train(name, dtr_kwargs={"budget": budget, "cost_model": "roofline"})
    assert run.stats.evictions > 0
    # What handle() serves: dropout's random in-place steps, backward's seed, and ops
    # whose input was evicted (rematerialized there). Detach, of a managed tensor or a
    # plain one, never goes there.
    assert sum(counts.values()) < 0.2 * run.stats.ops, counts
    assert counts["aten.detach.default"] == 0, counts
    for name in ("aten.mm.default", "aten.addmm.default", "aten.t.default", "aten.view.default"):
        assert counts[name] < 0.2 * run.stats.ops, (name, counts)


def _in_place_program(x: torch.Tensor) -> list[torch.Tensor]:
    h = torch.nn.functional.dropout(x * 2, 0.5, training=True)  # bernoulli_, div_
    h = h.add_(1).relu_()  # in-place ops on private values: new versions
    g = torch.rand_like(h).mul_(2)  # random, then in place
    out = (h.sin() + g).tanh()
    out.sum().backward()
    return [out.detach(), x.grad]


@pytest.mark.parametrize("stress", [False, True])
def test_in_place_and_random_ops_on_the_fast_path(stress, monkeypatch):
    # New versions (Invariant 4) and RNG replay (Invariant 1) on the fast path: the same
    # values as eager and as the Python path, every recomputation included (stress).
    torch.manual_seed(0)
    x = torch.randn(32, 32, requires_grad=True)
    torch.manual_seed(1)
    expected = _in_place_program(x)
    results = []
    for fast in (True, False):
        monkeypatch.setattr(dtr.engines.subclass.runtime, "FAST_PATH", fast)
        counts = _fallbacks(monkeypatch)
        x.grad = None
        torch.manual_seed(1)
        with dtr.enable(stress=stress) as session:
            got = _in_place_program(x)
            results.append([dtr.materialize(t) for t in got])
        assert session.stats().remats > 0 or not stress
        if fast:  # (evicted inputs are rebuilt from the fast path too)
            for name in ("bernoulli_.float", "div_.Scalar", "relu_.default", "mul_.Scalar"):
                assert counts["aten." + name] == 0, counts
    for got in results:
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)


def test_recomputations_replay_in_cpp(monkeypatch):
    # With the fast path, every recomputation is made from C++ (random and in-place
    # recipes too, and those the Python path asks for: reading a value with .item(),
    # handing a gradient to the optimizer, an op handle() serves).
    reruns = collections.Counter()
    rerun = dtr.engines.subclass.runtime.Runtime.rerun

    def counted(self, rid, stolen):
        reruns[self.recipes[rid].facts.name] += 1
        return rerun(self, rid, stolen)

    monkeypatch.setattr(dtr.engines.subclass.runtime.Runtime, "rerun", counted)
    for name, kwargs in (
        ("tree", {"budget": int(unbudgeted_peak("tree") * 0.4)}),
        ("mlp", {"stress": True}),  # dropout: RNG state, in-place versions, stand-ins
        ("transformer", {"budget": int(unbudgeted_peak("transformer") * 0.3)}),
    ):
        reruns.clear()
        run = train(name, dtr_kwargs={**kwargs, "cost_model": "roofline"})
        assert run.stats.remats > 0 and not reruns, (name, reruns)
        assert not mismatches(train(name), run), name


def test_plain_ops_run_directly(monkeypatch):
    # Optimizer state updated in place and ops under no_grad never reach handle().
    counts = _fallbacks(monkeypatch)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(16, 16)
    momentum = torch.zeros(16, 16)
    with dtr.enable(budget="1MiB"):
        for _ in range(3):
            (x @ w).tanh().sum().backward()
            with torch.no_grad():
                momentum.mul_(0.9).add_(w.grad)
                w.grad.zero_()
                x.mul(2)
    assert counts["aten.mul_.Tensor"] == counts["aten.zero_.default"] == 0, counts
    assert counts["aten.mul.Tensor"] == 0, counts


def test_a_write_to_a_plain_tensor_dtr_knows_goes_to_handle(monkeypatch):
    # A parameter updated in place while a recipe still reads it: handle() must pin
    # what depends on it first (Invariant 4), so the fast path may not run the write.
    counts = _fallbacks(monkeypatch)
    w = torch.randn(8, 8, requires_grad=True)
    expected = (w.detach() * 2).tanh().sum().item()
    with dtr.enable(budget="1MiB", stress=True):
        h = (w * 2).tanh()
        with torch.no_grad():
            w.add_(1)
        got = h.sum().item()
    assert counts["aten.add_.Tensor"] == 1
    assert got == expected


def test_fast_path_only_with_the_cpp_core_and_no_recording(tmp_path, monkeypatch):
    def kind(**kwargs):
        with dtr.enable(**kwargs) as session:
            return type(session._runtime.dispatch).__name__

    assert kind() == "FastPath"
    assert kind(trace=str(tmp_path / "t.jsonl")) == "method"  # the trace is written there
    assert kind(timeline=True) == "method"
    monkeypatch.setenv("DTR_FORCE_PYTHON", "1")
    assert kind() == "method"


def test_runtime_is_collected_after_the_session():
    # The fast path holds its runtime; the session must not leak either.
    x = torch.randn(8, 8, requires_grad=True)
    with dtr.enable(budget="1MiB") as session:
        (x * 2).relu().sum().backward()
        ref = weakref.ref(session._runtime)
    del session
    gc.collect()
    assert ref() is None


def test_kernel_error_and_allocator_oom_on_the_fast_path(monkeypatch):
    # The fast path calls the op's C++ callable (func._op), read once per session.
    real = torch.ops.aten.mm.default._op
    failures = [0]

    def flaky_mm(*args, **kwargs):
        if failures[0]:
            failures[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.ops.aten.mm.default, "_op", flaky_mm)
    counts = _fallbacks(monkeypatch)
    x = torch.randn(32, 32, requires_grad=True)
    with dtr.enable(budget="64KiB", check=True) as session:
        h = x.tanh()
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            h @ torch.randn(3, 3)
        assert session._runtime.core.locked_bytes() == 0
        # An allocator out-of-memory error from the kernel: evict, then run it again.
        g = h.tanh()
        spare = h.sin()  # what can be evicted
        failures[0] = 1
        y = (g @ h).sum()
        assert failures == [0]
        assert session._runtime.oom_retries == 1
        assert not session._runtime.core.is_materialized(spare._dtr_ref.node.tid)
        assert counts["aten.mm.default"] == 0  # both calls were the fast path's
    assert torch.equal(dtr.materialize(y), (x.tanh().tanh() @ x.tanh()).sum())
    assert torch.equal(dtr.materialize(spare), x.tanh().sin())


def test_an_evicted_value_read_twice_by_one_op(monkeypatch):
    # x * x with x evicted: rebuilt once, as on the Python path (same core calls).
    x = torch.randn(16, 16, requires_grad=True)
    results, remats = [], []
    for fast in (True, False):
        monkeypatch.setattr(dtr.engines.subclass.runtime, "FAST_PATH", fast)
        with dtr.enable(stress=True) as session:
            h = x.tanh().sin()
            y = torch.cat([h * h, h + h])
            results.append(dtr.materialize(y))
            remats.append(session.stats().remats)
    assert remats[0] == remats[1]
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], torch.cat([x.tanh().sin() ** 2, x.tanh().sin() * 2]))


@pytest.fixture(scope="module")
def optional_list_op():
    """A custom op returning a list of optional tensors, None between them."""
    lib = torch.library.Library("dtr_fastpath_test", "DEF")
    lib.define("pair(Tensor x) -> Tensor?[]")
    lib.impl("pair", lambda x: [None, x * 2, None, x + 1], "CPU")
    yield torch.ops.dtr_fastpath_test.pair
    lib._destroy()


@pytest.mark.parametrize("fast", [True, False])
def test_a_returned_list_with_none_between_tensors(fast, optional_list_op, monkeypatch):
    monkeypatch.setattr(dtr.engines.subclass.runtime, "FAST_PATH", fast)
    x = torch.randn(3, requires_grad=True)
    with dtr.enable(stress=True):
        y = x * 1  # managed
        with torch.no_grad():  # (the op has no autograd kernel: refused where y needs grad)
            out = optional_list_op(y)
        assert [o is None for o in out] == [True, False, True, False]
        got = [dtr.materialize(out[1]), dtr.materialize(out[3])]
    assert torch.equal(got[0], x.detach() * 2) and torch.equal(got[1], x.detach() + 1)

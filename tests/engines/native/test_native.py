"""The native engine (dtr/engines/native/, csrc/native/): training bitwise equal to eager
with and without a budget tight enough to evict and recompute (in-place writes given versions,
random ops replayed from their generator's state, batch norm's hidden writes), gradients
handed out plain, direct reads of evicted values refused with dtr's message, tensors
usable after the block, and what it does not serve refused by name."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import pickle
import re
import threading

import pytest
import torch
import torch.nn.functional as F

import dtr
import dtr.engines.native.session as native
from dtr.errors import DTRError
from tests.utils import eager_chain_grad

pytest.importorskip("dtr._C", reason="the native engine is C++")


class _Residual(torch.nn.Module):
    """A branch and a join: autograd sums two gradients into one input."""

    def __init__(self, width: int):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.b(torch.relu(self.a(x))))


def _model(kind: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "inplace":  # ReLU(inplace=True), dropout (a random op writing in place)
        layers = [torch.nn.Linear(32, 64), torch.nn.ReLU(inplace=True)]
        for _ in range(4):
            layers += [torch.nn.Linear(64, 64), torch.nn.ReLU(inplace=True), torch.nn.Dropout(0.2)]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 4))
    elif kind == "mlp":
        layers = [torch.nn.Linear(32, 64), torch.nn.ReLU()]
        for _ in range(6):
            layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 4))
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), *[_Residual(64) for _ in range(4)], torch.nn.Linear(64, 4)
        )
    x = torch.randn(256, 32)
    y = torch.randint(0, 4, (256,))
    return model, x, y


def _train(model, x, y, steps: int = 3):
    torch.manual_seed(1)  # dropout's draws
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _peak(kind: str) -> int:
    with native.enable() as session:
        _train(*_model(kind))
    return session.stats().peak_resident_bytes


@pytest.mark.parametrize("kind", ["mlp", "residual", "inplace"])
def test_trains_bitwise_as_eager(kind):
    expect = _train(*_model(kind))
    with native.enable() as session:
        got = _train(*_model(kind))
    assert got[0] == expect[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expect[1], strict=True))
    stats = session.stats()
    assert stats.ops > 0 and stats.evictions == 0 and stats.core == "c++"


# (each feasible down to 0.5 of its peak, as under dtr.enable(): in-place ReLU and dropout
# give versions, not pins)
@pytest.mark.parametrize("kind, ratio", [("mlp", 0.7), ("residual", 0.7), ("inplace", 0.6)])
def test_under_a_budget_evicts_recomputes_and_stays_bitwise(kind, ratio):
    expect = _train(*_model(kind))
    budget = int(_peak(kind) * ratio)
    with native.enable(budget=budget) as session:
        got = _train(*_model(kind))
    stats = session.stats()
    assert stats.evictions > 0 and stats.remats > 0, stats
    assert stats.peak_resident_bytes <= budget and stats.budget_bytes == budget
    assert got[0] == expect[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expect[1], strict=True))


def test_budget_below_the_parameters_gives_dtr_enables_numbers():
    """The message of tests/engines/test_faults.py's first-op failure, word for word."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
    with pytest.raises(dtr.BudgetError) as info:
        with native.enable(budget="64KiB", cost_model="roofline") as session:
            model(torch.randn(8, 256)).sum().backward()
    assert session.stats().ops == 1
    assert str(info.value).startswith(
        "dtr: cannot stay within the memory budget of 64.00 KiB while running "
        "aten.addmm.default: 273.00 KiB resident, 8.00 KiB requested, 265.00 KiB pinned"
    ), str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_infeasible_budget_is_a_budget_error_with_the_numbers():
    model, x, y = _model("mlp")
    with pytest.raises(dtr.BudgetError) as info:
        with native.enable(budget=1000):
            F.cross_entropy(model(x), y).backward()
    assert isinstance(info.value, torch.OutOfMemoryError)  # what OOM handlers catch
    msg = str(info.value)
    assert msg.startswith("dtr: cannot stay within the memory budget of 1000 B while ")
    assert re.search(r"resident, .* requested, .* pinned .* locked by the running op", msg)
    assert "Largest unevictable: " in msg
    assert "a budget below that cannot work; give at least" in msg  # below the parameters
    # the process stays usable: another session works
    with native.enable():
        assert _train(*_model("mlp"), steps=1)[0] == _train(*_model("mlp"), steps=1)[0]


def test_values_are_managed_and_readable_after_the_block():
    model, x, _ = _model("mlp")
    with native.enable():
        out = model(x)
        assert native.is_managed(out)
        assert not native.is_managed(x)
        assert out.device == x.device and out.is_cpu and type(out) is torch.Tensor
    expect = model(x)
    assert torch.equal(out.detach(), expect.detach())
    assert out.detach().numpy().shape == (256, 4)
    assert torch.equal(out + 1, expect + 1)  # ops after the block: plain results
    assert not native.is_managed(out + 1)


def test_direct_reads_of_an_evicted_value_recompute_it():
    # tolist() reads a copy of the value, recomputed; data_ptr() recomputes and pins it (an address
    # must hold for the tensor's life), as numpy() does (dtr/engines/native/undispatched_reads.py).
    model, x, _ = _model("mlp")
    with torch.no_grad():
        want = [x]
        for layer in model:
            want.append(layer(want[-1]))
    with native.enable(budget=int(_peak("mlp") * 0.45)) as session:
        h = [x]
        for layer in model:
            h.append(layer(h[-1]))
        evicted = [k for k, t in enumerate(h) if k and native.is_managed(t) and _evicted(t)]
        assert len(evicted) >= 2, "too little was evicted"
        k, j = evicted[:2]
        pinned = session.stats().pinned_bytes
        assert h[k].tolist() == want[k].tolist()
        assert session.stats().pinned_bytes == pinned  # read as a copy: nothing pinned
        assert torch.isfinite(h[k].clone()).all()  # an op rebuilds it
        address = h[j].data_ptr()
        assert address != 0 and not _evicted(h[j])
        assert session.stats().pinned_bytes >= pinned + h[j].nbytes
        # (that it stays there under pressure: test_runtime's data_ptr test, stress mode)
        assert h[j].data_ptr() == address and torch.equal(h[j].detach(), want[j])


def test_numpy_of_a_managed_tensor_pins_its_memory():
    # numpy() hands out the value's raw address; evicting it afterwards freed that
    # memory under the array (it then read reused memory: a silently different array).
    # The value is pinned instead, as dtr.materialize does; PyTorch's methods are put
    # back after the block.
    names = ("tolist", "numpy", "__dlpack__", "data_ptr", "const_data_ptr", "new")
    names += ("new_tensor", "is_shared", "share_memory_", "apply_", "map_", "map2_")
    names += ("__reduce_ex__", "__deepcopy__")
    methods = {n: torch.Tensor.__dict__.get(n) for n in names}
    x = torch.randn(256, 256, requires_grad=True)
    with native.enable(budget=5 * 256 * 256 * 4 + 1000, heuristic="lru") as session:
        h = (x * 2).tanh()
        with pytest.raises(RuntimeError, match="requires grad"):
            h.numpy()  # as in eager
        a = h.detach().numpy()
        ref = a.copy()
        assert session.stats().pinned_bytes >= a.nbytes
        hs = [h]
        for _ in range(8):  # under LRU, h would be the first victim
            hs.append(hs[-1] * 1.0001)
        junk = [(hs[-1] + 7.0) * 1 for _ in range(3)]
        assert session.stats().evictions > 0 and not _evicted(h)
        assert (a == ref).all() and torch.equal(torch.from_dlpack(h.detach()), h.detach())
        del junk
    assert {n: torch.Tensor.__dict__.get(n) for n in methods} == methods


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # as in eager
@pytest.mark.parametrize("stress", [False, True])
def test_legacy_new_and_shared_memory_of_a_managed_tensor(stress):
    # The legacy constructors take their device from the tensor's dispatch keys, and the
    # engine's key names none: they must still make plain CPU tensors. is_shared() of an
    # evicted value is False (a shared value is pinned).
    x = torch.randn(4, 5, requires_grad=True)
    with native.enable(stress=stress):
        t = (x * 2).detach()
        assert native.is_managed(t)
        for made, shape in ((t.new(), (0,)), (t.new(3), (3,)), (t.new([1.0, 2.0]), (2,))):
            assert made.shape == shape and made.dtype == t.dtype and made.device == t.device
        assert t.new([1.0, 2.0]).tolist() == [1.0, 2.0]
        assert t.new_tensor([1.0, 2.0]).tolist() == [1.0, 2.0]
        assert torch.equal(t.new_tensor(t), (x * 2).detach())
        assert t.new_empty(3).shape == (3,)
        assert not t.is_shared()
        assert t.share_memory_() is t and t.is_shared()
        [t * k for k in range(3)]  # stress: what can be evicted is; t is pinned
        assert t.is_shared() and torch.equal(t.detach(), (x * 2).detach())


def test_save_pickle_and_deepcopy_of_an_evicted_value():
    # They read the memory directly and failed on an evicted value; now a copy of the
    # value, recomputed, as the subclass engine's wrapper reduces to its plain value.
    x = torch.randn(16, 16, requires_grad=True)
    want = (x * 2).tanh().detach()
    with native.enable(stress=True):
        t = (x * 2).tanh()
        d = t.detach()
        assert _evicted(t)
        buf = io.BytesIO()
        torch.save({"t": t, "d": d}, buf)
        buf.seek(0)
        loaded = torch.load(buf)
        for copied in (loaded["t"], loaded["d"], pickle.loads(pickle.dumps(d)), copy.deepcopy(d)):
            assert type(copied) is torch.Tensor and not native.is_managed(copied)
            assert torch.equal(copied.detach(), want)


def _evicted(t: torch.Tensor) -> bool:
    try:
        torch._C.TensorBase.data_ptr(t)  # PyTorch's own: no recomputation, no pin
    except RuntimeError:
        return True
    return False


def test_what_it_does_not_serve_is_refused_by_name():
    model, x, _ = _model("mlp")
    with native.enable():
        h = model(x).detach() * 1
        with pytest.raises(dtr.UnsupportedError, match="aten.resize_.default replaces the"):
            h.resize_(3)
        sparse = torch.eye(4).to_sparse()
        with pytest.raises(dtr.UnsupportedError, match="mixes a managed tensor with a non-str"):
            sparse.mul_(h.sum())  # (a sparse tensor only read is served: test_sparse.py)
        # sparse tensors alone are left plain, as by dtr.enable()
        assert torch.equal(torch.sparse.mm(sparse, torch.ones(4, 2)), torch.ones(4, 2))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_sparse_and_quantized_results_of_managed_tensors_stay_what_they_are():
    """An op on a managed tensor whose result is sparse or quantized leaves it plain (a
    quantized value wrapped as a managed tensor read as its integers)."""
    x = torch.randn(4, 4, requires_grad=True)
    h0 = (x * 2).detach()
    with native.enable(stress=True):
        h = (x * 2).detach()
        q = torch.quantize_per_tensor(h, 0.1, 0, torch.qint8)
        s = h.to_sparse()
        assert q.is_quantized and not native.is_managed(q)
        assert s.is_sparse and not native.is_managed(s)
        assert torch.equal(
            q.int_repr(), torch.quantize_per_tensor(h0, 0.1, 0, torch.qint8).int_repr()
        )
        assert torch.equal(s.to_dense(), h0)


def _in_place_views(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w + 0.5  # 8 x 6 (add saves nothing: h may change in place)
    saved = h.detach()  # an alias taken before: keeps its geometry
    h.t_()  # 6 x 8
    h.unsqueeze_(0)  # 1 x 6 x 8
    h.transpose_(1, 2)  # 1 x 8 x 6
    h.squeeze_(0)
    h.as_strided_((4, 6), (6, 1), 6)
    return (h * saved[2:6]).sum() + saved.sum()


@pytest.mark.parametrize("stress", [False, True])
def test_in_place_view_ops_are_the_view_ops(stress):
    """x.t_(), x.squeeze_() and kin change x's geometry, not its data: served as the view
    op, with x naming the result; gradients through them as eager's, and an alias taken
    before keeps its own geometry."""
    torch.manual_seed(0)
    x = torch.randn(8, 5, requires_grad=True)
    w = torch.randn(5, 6, requires_grad=True)
    expect = _in_place_views(x, w)
    expect.backward()
    eager_grads = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    with native.enable(stress=stress, check=True) as session:
        got = _in_place_views(x, w)
        got.backward()
    assert torch.equal(got, expect)
    assert torch.equal(x.grad, eager_grads[0]) and torch.equal(w.grad, eager_grads[1])
    assert not stress or session.stats().remats > 0


def test_conjugate_and_negative_views_keep_their_bit():
    """A lazy conjugate (ifft's result, conj()) read through a managed tensor is the
    conjugate: the engine's tensors carry the value's Conjugate and Negative keys."""
    x = torch.randn(4, dtype=torch.float64)  # ihfft: 3 values
    z = torch.randn(3, dtype=torch.complex128)

    def run(x, z):
        a = torch.fft.ihfft(x * 1)
        b = (z * 1).conj()
        c = torch.neg((z * 1).conj()).conj()  # a negative view somewhere in between
        return a, b, c, a * b + c

    expect = run(x, z)
    with native.enable(stress=True):
        got = run(x, z)
        assert got[0].is_conj() and got[1].is_conj()
    for e, g in zip(expect, got, strict=True):
        assert torch.equal(dtr.materialize(g).resolve_conj(), e.resolve_conj())


def test_materialize_hands_out_a_plain_tensor():
    with native.enable(stress=True) as session:
        h = torch.arange(6.0, requires_grad=True) * 2  # managed, evicted at once (stress)
        assert native.is_managed(h)
        plain = dtr.materialize(h)
        assert not native.is_managed(plain) and torch.equal(plain, torch.arange(6.0) * 2)
        assert session.stats().pinned_bytes >= h.numel() * 4  # the program may write it now
    assert not native.is_managed(dtr.materialize(h))


def test_does_not_nest_with_the_subclass_engine():
    with dtr.enable(engine="subclass"):
        with pytest.raises(dtr.DTRError, match="do not nest"):
            with native.enable():
                pass


def test_bad_heuristic_is_a_config_error():
    with pytest.raises(dtr.ConfigError, match="unknown heuristic"):
        native.enable(heuristic="nope")


def test_evicted_values_are_materialized_when_the_block_ends():
    model, x, _ = _model("mlp")
    expect = [x]
    for layer in model:
        expect.append(layer(expect[-1]))
    with native.enable(budget=int(_peak("mlp") * 0.45)) as session:
        h = [x]
        for layer in model:
            h.append(layer(h[-1]))
        assert any(_evicted(t) for t in h[1:])
    assert session.stats().evictions > 0
    for got, want in zip(h, expect, strict=True):
        assert torch.equal(torch.from_numpy(got.detach().numpy()), want.detach())


def _bench_run(name: str, context):
    from bench.models import MODELS, batches, build
    from tests.utils import make_optimizer

    torch.manual_seed(0)
    model = build(name)
    opt = make_optimizer("adam", model.parameters())
    with context:
        for batch in batches(name, 2):
            MODELS[name].loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


@pytest.mark.parametrize("name", ["mlp", "cnn", "lstm", "transformer", "tree"])
def test_bench_models_train_bitwise_as_eager(name):
    """Dropout, batch norm's running statistics, in-place ReLU, nn.LSTM, attention and the
    tree model's .item()-driven recursion: two Adam steps equal eager's."""
    expect = _bench_run(name, contextlib.nullcontext())
    got = _bench_run(name, native.enable())
    assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))


@pytest.mark.parametrize("name", ["mlp", "cnn", "lstm", "transformer", "tree"])
def test_bench_models_under_half_their_peak_stay_bitwise(name):
    """Recomputation replays dropout's masks, batch norm (whose running statistics it
    must not update again), in-place ReLU and the residual +=, attention and the LSTM."""
    expect = _bench_run(name, contextlib.nullcontext())
    with native.enable() as free:
        _bench_run(name, contextlib.nullcontext())
    budget = int(free.stats().peak_resident_bytes * 0.5)
    with native.enable(budget=budget) as session:
        got = _bench_run(name, contextlib.nullcontext())
    stats = session.stats()
    assert stats.evictions > 0 and stats.remats > 0, stats
    assert stats.peak_resident_bytes <= budget
    assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))


@pytest.mark.parametrize("name", ["mlp", "cnn", "lstm", "transformer", "tree"])
def test_bench_models_under_stress_stay_bitwise(name):
    """Stress mode: everything evictable is evicted after every op, so every value read
    again is recomputed (with the core's invariants checked after each op)."""
    expect = _bench_run(name, contextlib.nullcontext())
    with native.enable(stress=True, check=True) as session:
        got = _bench_run(name, contextlib.nullcontext())
    stats = session.stats()
    assert stats.evictions > stats.ops / 4 and stats.remats > 0, stats
    assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))


@pytest.mark.parametrize("kind", ["mlp", "residual", "inplace"])
def test_stress_from_the_environment(kind, monkeypatch):
    monkeypatch.setenv("DTR_STRESS", "1")
    expect = _train(*_model(kind))
    with native.enable() as session:
        got = _train(*_model(kind))
    assert session.config.stress and session.stats().remats > 0
    assert got[0] == expect[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expect[1], strict=True))


def test_unknown_option_is_a_config_error():
    with pytest.raises(dtr.ConfigError, match="dtr: unknown option.*: timelines; valid: stress"):
        native.enable(timelines=10)


def test_timeline_and_per_step_logs_as_dtr_enables(caplog):
    """timeline=N keeps the newest N op boundaries (dtr.timeline's columns); log_steps
    closes a step at every optimizer.step() and logs it; the session's peak is the
    largest step's."""
    model, x, y = _model("mlp")
    budget = int(_peak("mlp") * 0.7)
    with caplog.at_level("INFO", logger="dtr"):
        options = {"timeline": True, "log_steps": True, "cost_model": "roofline"}
        with native.enable(budget=budget, **options) as session:
            _train(model, x, y, steps=3)
            inside = session.timeline()
    stats, steps, timeline = session.stats(), session.steps(), session.timeline()
    assert len(steps) == 3 and [s.step for s in steps] == [1, 2, 3]
    assert sum(s.ops for s in steps) == stats.ops and sum(s.remats for s in steps) == stats.remats
    assert max(s.peak_resident_bytes for s in steps) == stats.peak_resident_bytes <= budget
    assert all(s.budget_bytes == budget for s in steps)
    assert len([r for r in caplog.records if r.getMessage().startswith("dtr step")]) == 3
    assert timeline.as_dict() == inside.as_dict()
    assert timeline.op[-1] == stats.ops and timeline.evictions[-1] == stats.evictions
    assert all(b >= r for b, r in zip(timeline.before_bytes, timeline.resident_bytes, strict=True))
    assert max(timeline.resident_bytes) <= budget < max(timeline.before_bytes)
    assert "aten.addmm.default" in timeline.name and any(timeline.backward)
    with native.enable() as plain:
        with pytest.raises(dtr.DTRError, match="records no timeline"):
            plain.timeline()
        assert plain.end_step().step == 1 and len(plain.steps()) == 1
    with native.enable(timeline=5) as short:
        _train(*_model("mlp"), steps=1)
    assert len(short.timeline()) == 5 and short.timeline().op[-1] == short.stats().ops


def test_bad_stress_flag_is_a_config_error():
    with pytest.raises(dtr.ConfigError, match="dtr: option stress must be a bool, got .yes."):
        native.enable(stress="yes")


@pytest.mark.parametrize("name", ["lstm", "mlp", "transformer", "tree"])
def test_room_is_made_before_an_op_that_was_seen(name):
    """From the second step on, the engine knows what each op allocates (per op and input
    shapes, dtr/engines/subclass/kernel_peaks.py) and evicts that much before running it, so fresh outputs do
    not sit on top of the budget: the transient count stays within 5% of a 30% budget
    (40% for the LSTM: its layer op needs 31% of the peak at once, the op-level floor).
    The LSTM's layer op returns a large workspace; without
    the reservation its steps overshoot the budget by more than a third of it."""
    from bench.models import MODELS, batches, build
    from tests.utils import make_optimizer

    with native.enable() as free:
        _bench_run(name, contextlib.nullcontext())
    budget = int(free.stats().peak_resident_bytes * (0.4 if name == "lstm" else 0.3))

    def later_steps(reserve: bool) -> int:
        torch.manual_seed(0)
        model = build(name)
        opt = make_optimizer("adam", model.parameters())
        with native.enable(budget=budget) as session:
            session._engine.reserve = reserve
            for i, batch in enumerate(batches(name, 3)):
                if i == 1:
                    session.reset_peak()  # the first step learns the sizes
                MODELS[name].loss(model, batch).backward()
                opt.step()
                opt.zero_grad()
        return session.stats().max_transient_bytes

    with_room = later_steps(True)
    assert with_room <= budget * 1.05, (with_room, budget)
    if name == "lstm":
        without = later_steps(False)
        assert without > budget * 1.35, (without, budget)


def _roofline_cases():
    aten = torch.ops.aten
    torch.manual_seed(0)
    a, b, c = torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 4)
    ba, bb, bc = torch.randn(3, 8, 16), torch.randn(3, 16, 4), torch.randn(3, 8, 4)
    x, w, bias = torch.randn(2, 3, 10, 10), torch.randn(5, 3, 3, 3), torch.randn(5)
    wt = torch.randn(3, 5, 3, 3)  # a transposed convolution's weight: (in, out, ...)
    conv = [bias, [1, 1], [1, 1], [1, 1]]
    cases = [
        (aten.mm.default, [a, b]),
        (aten.addmm.default, [c, a, b]),
        (aten.bmm.default, [ba, bb]),
        (aten.baddbmm.default, [bc, ba, bb]),
        (aten.convolution.default, [x, w, *conv, False, [0, 0], 1]),
        (aten.convolution.default, [x, wt, *conv, True, [0, 0], 1]),
        (aten.relu.default, [x]),  # bytes only
        (aten.cat.default, [[a, c], 1]),  # a list of tensors
    ]
    for transposed, weight in ((False, w), (True, wt)):
        y = aten.convolution.default(x, weight, *conv, transposed, [0, 0], 1)
        for mask in ([True, True, True], [True, False, False], [False, True, False]):
            args = [torch.randn_like(y), x, weight, [5], [1, 1], [1, 1], [1, 1], transposed]
            cases.append((aten.convolution_backward.default, [*args, [0, 0], 1, mask]))
    return cases


@pytest.mark.parametrize("case", range(len(_roofline_cases())))
def test_roofline_prices_as_dtr_cost_does(case):
    """The native engine's C++ roofline (csrc/core/roofline.cpp) gives dtr/cost.py's estimate
    of the same call: matmuls and convolutions (forward, transposed, and the backward's
    output masks) by torch's FLOP formulas, everything else by bytes moved."""
    from dtr import _C
    from dtr.cost import flops, roofline

    func, args = _roofline_cases()[case]
    out = func(*args)
    results = list(out) if isinstance(out, tuple) else [out]
    expect = roofline(func, tuple(args), {}, out)
    assert expect > 0
    assert _C.roofline_seconds(func._schema.name, args, results) == pytest.approx(expect, rel=1e-12)
    if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.convolution_backward):
        assert flops(func, tuple(args), {}, out) > 0  # the FLOP side was exercised


def test_flops_are_priced_once_per_op_and_shapes():
    """dtr/cost.py keeps each op's FLOPs by its arguments' shapes: a second call with the
    same shapes is served from the cache with the formula's number, and other shapes (or
    other non-tensor arguments: a convolution's stride) are priced again."""
    from torch.utils.flop_counter import flop_registry

    from dtr import cost

    cost._FLOPS.clear()
    for func, args in _roofline_cases():
        out = func(*args)
        formula = flop_registry.get(func.overloadpacket)
        expect = 0.0 if formula is None else float(formula(*args, out_val=out))
        assert cost.flops(func, tuple(args), {}, out) == expect
        assert cost.flops(func, tuple(args), {}, out) == expect  # from the cache
    assert cost._FLOPS  # the matmuls and convolutions were kept
    mm = torch.ops.aten.mm.default
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert cost.flops(mm, (a, b), {}, mm(a, b)) == 2 * 8 * 16 * 4
    a = torch.randn(3, 16)
    assert cost.flops(mm, (a, b), {}, mm(a, b)) == 2 * 3 * 16 * 4
    conv = torch.ops.aten.convolution.default
    x, w = torch.randn(1, 2, 9, 9), torch.randn(3, 2, 3, 3)
    for stride in ([1, 1], [2, 2]):
        args = (x, w, None, stride, [0, 0], [1, 1], False, [0, 0], 1)
        out = conv(*args)
        assert cost.flops(conv, args, {}, out) == 2 * 3 * 2 * 9 * out.shape[2] * out.shape[3]


def test_roofline_costs_repeat_the_same_evictions():
    """With the deterministic cost model, two runs of one program under one budget evict
    the same tensors in the same order (measured times would let them differ)."""
    budget = int(_peak("residual") * 0.6)

    def logged():
        with native.enable(budget=budget, cost_model="roofline") as session:
            session._engine.log_evictions(True)
            _train(*_model("residual"))
            log = session._engine.eviction_log()
        return log, session.stats()

    (first, stats), (second, _) = logged(), logged()
    assert stats.evictions > 10 and stats.remats > 0, stats
    assert first == second


@pytest.mark.parametrize("name", ["mlp", "cnn", "lstm", "transformer", "tree"])
def test_a_native_run_and_its_trace_replayed_evict_alike(name, tmp_path):
    """The native engine writes the subclass engine's trace format (trace=, .gz
    compressed): dtr.sim replays it, both of its cores, to the same evictions in the same
    order as the live run, under the same budget and (roofline) costs."""
    import gzip

    from dtr import sim
    from dtr.sim import program as P

    with native.enable(cost_model="roofline") as free:
        _bench_run(name, contextlib.nullcontext())
    budget = int(free.stats().peak_resident_bytes * 0.4)
    path = str(tmp_path / f"{name}.jsonl.gz")
    with native.enable(budget=budget, cost_model="roofline", trace=path) as session:
        session._engine.log_evictions(True)
        _bench_run(name, contextlib.nullcontext())
        live_log = session._engine.eviction_log()
    stats = session.stats()
    assert stats.evictions == len(live_log) > 0
    with gzip.open(path, "rt") as f:
        start = json.loads(f.readline())
    assert start["DTR"] == "1" and start["BUDGET"] == str(budget)
    assert start["COST_MODEL"] == "roofline"
    assert start["HEURISTIC"] == dtr.DEFAULT_HEURISTIC
    prog = sim.load(path)
    assert prog.mode == P.LIVE
    assert any(ins[0] == "RESERVE" for ins in P.disassemble(prog))  # room made before ops
    for core in ("c++", "python"):
        res = sim.simulate(prog, start["HEURISTIC"], budget=budget, core=core, log=True, thrash=0)
        assert res.status == "ok"
        assert res.eviction_log == live_log
        assert (res.evictions, res.remats) == (stats.evictions, stats.remats)


def test_sampled_search_and_min_evict_bytes_are_in_the_trace(tmp_path):
    """search_sample (sampling beyond 8 candidates here) and min_evict_bytes reach the
    engine's core and the trace's START, and a replay follows them to the same evictions."""
    from dtr import sim

    with native.enable(cost_model="roofline") as free:
        _bench_run("tree", contextlib.nullcontext())
    budget = int(free.stats().peak_resident_bytes * 0.5)
    path = str(tmp_path / "tree.jsonl")
    options = {"search_sample": 8, "min_evict_bytes": 2048, "cost_model": "roofline"}
    with native.enable(budget=budget, trace=path, **options) as session:
        session._engine.log_evictions(True)
        _bench_run("tree", contextlib.nullcontext())
        live_log = session._engine.eviction_log()
    with open(path) as f:
        start = json.loads(f.readline())
    assert (start["SEARCH_SAMPLE"], start["MIN_EVICT_BYTES"]) == ("8", "2048")
    assert session.stats().evictions == len(live_log) > 0
    res = sim.simulate(sim.load(path), None, budget=budget, log=True, thrash=0)
    assert res.status == "ok" and res.eviction_log == live_log
    with native.enable(budget=budget, cost_model="roofline") as exact:
        exact._engine.log_evictions(True)
        _bench_run("tree", contextlib.nullcontext())
        assert exact._engine.eviction_log() != live_log  # the options changed the choices


@pytest.mark.parametrize("change", [0.7, None])
def test_set_budget_takes_effect_at_the_next_op_and_is_in_the_trace(change, tmp_path):
    """session.set_budget() between steps: the run stays bitwise as eager, evicts from then
    on (or stops evicting), and a replay of its trace at its first budget follows the
    change to the same evictions."""
    from dtr import sim
    from dtr.sim import program as P

    peak = _peak("residual")
    first = int(peak * 0.9)
    expect = _train(*_model("residual"))
    path = str(tmp_path / "budget.jsonl")
    model, x, y = _model("residual")
    torch.manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    with native.enable(budget=first, cost_model="roofline", trace=path) as session:
        session._engine.log_evictions(True)
        for step in range(3):
            if step == 1:
                session.set_budget(None if change is None else int(peak * change))
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        live_log = session._engine.eviction_log()
    stats = session.stats()
    assert stats.budget_bytes == (None if change is None else int(peak * change))
    assert losses == expect[0]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expect[1], strict=True))
    prog = sim.load(path)
    assert sum(ins[0] == "BUDGET" for ins in P.disassemble(prog)) == 1
    res = sim.simulate(prog, None, budget=first, log=True, thrash=0)
    assert res.eviction_log == live_log and res.evictions == stats.evictions
    if change is not None:
        assert stats.evictions > 0 and stats.remats > 0
    with pytest.raises(DTRError, match="needs an active session"):
        session.set_budget("1GiB")


def test_trace_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("DTR_TRACE", str(path))
    with native.enable() as session:
        _train(*_model("mlp"), steps=1)
    assert session.config.trace == str(path)
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    assert lines[0]["ANNOTATION"] == "START" and lines[-1]["ANNOTATION"] == "END"
    assert any(line.get("ANNOTATION") == "BACKWARD" for line in lines)
    assert sum(line["INSTRUCTION"] == "CALL" for line in lines) > 20


def test_bad_cost_model_is_a_config_error(monkeypatch):
    with pytest.raises(dtr.ConfigError, match="dtr: unknown cost_model 'flops'"):
        native.enable(cost_model="flops")
    assert native.enable().config.cost_model == "roofline"
    monkeypatch.setenv("DTR_COST_MODEL", "time")
    assert native.enable().config.cost_model == "time"


def _chain(x, w, n: int = 8):
    """Matmuls with in-place writes after each: every write gets a version."""
    outs = []
    h = x
    for _ in range(n):
        h = torch.tanh(h @ w)
        h.mul_(2)
        h.add_(1)
        outs.append(h)
    return outs


def test_in_place_writes_keep_lineage_through_versions():
    torch.manual_seed(0)
    x, w = torch.randn(64, 64), (torch.randn(64, 64) / 8).requires_grad_()
    expect = _chain(x, w)
    with native.enable() as free:
        _chain(x, w)
    with native.enable(budget=free.stats().peak_resident_bytes // 2) as session:
        got = _chain(x, w)
        evicted = sum(_evicted(t) for t in got)
        # nothing but the inputs is pinned: each written tensor was the only one of its
        # storage, so it got a new version
        stats = session.stats()
        assert stats.pinned_bytes == stats.constant_bytes
        sums = [t.sum() for t in got]  # rebuilds them, replaying the writes
    assert evicted > 0 and session.stats().remats > 0
    assert all(torch.equal(a, b.sum()) for a, b in zip(sums, expect, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))


def test_a_detached_copy_follows_a_write_and_autograd_sees_it():
    torch.manual_seed(0)
    x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
    with native.enable():
        a = x @ w
        d = a.detach()
        a.mul_(2)
        assert torch.equal(d, a)  # one storage, as in eager
        b = a * a  # saves a for backward
        a.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            b.sum().backward()


def test_random_ops_replay_their_draws_and_leave_the_stream_where_eager_does():
    torch.manual_seed(0)
    x, w = torch.randn(64, 64), (torch.randn(64, 64) / 8).requires_grad_()

    def run():
        torch.manual_seed(3)
        g = torch.Generator().manual_seed(5)
        masks = [torch.bernoulli(torch.sigmoid(x @ w), generator=g)]
        h = x
        for _ in range(6):
            h = F.dropout(torch.tanh(h @ w), 0.3)  # the default generator
            masks.append(h)
        sums = [m.sum() for m in masks]
        return sums, torch.rand(4), torch.rand(4, generator=g)

    expect = run()
    with native.enable() as free:
        run()
    with native.enable(budget=free.stats().peak_resident_bytes // 2) as session:
        got = run()
    assert session.stats().remats > 0
    assert all(torch.equal(a, b) for a, b in zip(got[0], expect[0], strict=True))
    assert torch.equal(got[1], expect[1]) and torch.equal(got[2], expect[2])


def test_gradients_are_handed_out_plain_and_clipping_them_stays_bitwise():
    def run(context):
        model, x, y = _model("residual")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with context:
            for _ in range(2):
                F.cross_entropy(model(x), y).backward()
                grads = [p.grad for p in model.parameters()]
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # writes them
                opt.step()
                opt.zero_grad()
        return grads, [p.detach().clone() for p in model.parameters()]

    expect = run(contextlib.nullcontext())
    with native.enable() as free:
        run(contextlib.nullcontext())
    with native.enable(budget=int(free.stats().peak_resident_bytes * 0.7)) as session:
        grads, params = run(contextlib.nullcontext())
        assert not any(native.is_managed(g) for g in grads)
        assert grads[0].numpy().shape == tuple(grads[0].shape)
    assert session.stats().evictions > 0
    assert all(torch.equal(a, b) for a, b in zip(params, expect[1], strict=True))


def test_empty_like_of_an_evicted_tensor_does_not_rebuild_it():
    model, x, _ = _model("mlp")
    with native.enable(budget=int(_peak("mlp") * 0.45)) as session:
        h = [x]
        for layer in model:
            h.append(layer(h[-1]))
        evicted = next(t for t in h[1:] if native.is_managed(t) and _evicted(t))
        remats = session.stats().remats
        z = torch.zeros_like(evicted)
        assert _evicted(evicted) and session.stats().remats == remats
        assert torch.equal(z, torch.zeros(evicted.shape))


def _profiled(fn) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    from tests.utils import profiled_bytes

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return profiled_bytes(prof)


def test_cpu_cache_reuses_freed_blocks_reports_them_and_goes_away_with_the_session():
    from dtr import _C

    x = torch.randn(256, 256, requires_grad=True)  # 256 KiB: cached sizes

    def work():
        y = (x @ x).tanh() @ x
        y.sum().backward()
        x.grad = None

    with native.enable(cache=0) as plain_session:
        for _ in range(3):
            work()
        uncached = _profiled(work)
    assert plain_session.cache_stats is None
    with native.enable(cache="64MiB") as session:
        for _ in range(3):
            work()
        cached = _profiled(work)
        kept = x @ x  # outlives the session: freed when dropped afterwards
    stats = session.cache_stats
    assert stats["hits"] > stats["misses"] > 0 and stats["idle_bytes"] > 0
    # the profiler sees every block handed out, cached or not
    # (at the end, peak): the same up to a few scalars, which go around the cache
    assert uncached[1] > 0
    assert all(abs(a - b) < 1024 for a, b in zip(cached, uncached, strict=True))
    after = _C.cpu_cache_stats()
    assert not after["active"] and after["idle_bytes"] == 0
    assert torch.equal(kept, x @ x)
    held = after["allocated_bytes"]
    del kept
    assert _C.cpu_cache_stats()["allocated_bytes"] == held - 256 * 256 * 4


def test_bad_cache_size_is_a_config_error():
    with pytest.raises(dtr.ConfigError, match="dtr: invalid cache"):
        native.enable(cache="lots")


def test_a_gradient_viewing_a_larger_buffer_stays_readable():
    """cat's backward hands v1 a slice of one buffer whose other slice still feeds v2's
    gradient: exported, then dropped, its pin ended and the buffer was evicted with the
    program's gradient in it (its memory freed under p.grad) unless the engine keeps
    exported storages."""
    g = torch.Generator().manual_seed(0)
    v1 = torch.randn(24, 4, generator=g).requires_grad_()
    v2 = torch.randn(40, 4, generator=g).requires_grad_()

    def run():
        v4 = torch.cat([v1, v2 * 2], 0)
        parts = torch.unbind(v4, 1)
        grads = []
        for k in range(2):
            (v4.sum() + parts[0].sum() * 0.5).backward(retain_graph=k == 0)
            grads += [v1.grad.clone(), v2.grad.clone()]
        return grads

    expect = run()
    v1.grad = v2.grad = None
    with native.enable(check=True):
        got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))


def test_a_plain_non_leaf_that_requires_grad_is_read_as_a_constant():
    """A plain tensor an in-place copy from a managed one made require grad (a non-leaf
    with no base) is read by a later op: its leaf hook has no leaf to find. Found by the
    fuzz ("Can't get base of non-view Tensor")."""
    w = torch.randn(4, 4, requires_grad=True)

    def run():
        plain = torch.zeros(4, 4)
        plain.t().copy_(w * 2)  # plain now requires grad, not a leaf, not a view
        return (plain.sum() * 3).detach(), torch.autograd.grad(plain.sum(), w)[0]

    expect = run()
    with native.enable(stress=True):
        got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True))


def test_the_peaks_are_the_blocks():
    """What close() materializes with the budget lifted is the program's after the block:
    the reported peak stays within the budget (Runtime.closing_peaks)."""
    model, x, _ = _model("mlp")
    budget = _peak("mlp") * 2 // 5  # (a third is below the forward's op-level floor)
    with native.enable(budget=budget) as session:
        outs = [torch.tanh(layer) for layer in model(x).split(1, dim=1)]  # all held
    stats = session.stats()
    assert stats.resident_bytes > budget  # close() materialized beyond the budget
    assert stats.peak_resident_bytes <= budget
    assert len(outs) == 4


# ---------------------------------------------------------------- faults and threads
def test_one_session_per_process_of_either_engine():
    with native.enable():
        with pytest.raises(dtr.DTRError, match="the two engines do not nest"):
            with dtr.enable(engine="subclass"):
                pass
        with pytest.raises(dtr.DTRError, match="a native session is already open"):
            with dtr.enable():  # "auto": the native engine on this machine
                pass
        errors = []

        def other_thread():
            try:
                with native.enable():
                    pass
            except dtr.DTRError as e:
                errors.append(str(e))

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert len(errors) == 1 and "a native session is already open" in errors[0]
    with dtr.enable(engine="subclass"):  # both free again
        pass
    session = native.enable()
    with session:
        pass
    with pytest.raises(dtr.DTRError, match="entered only once"):
        with session:
            pass


def _tanh_chain(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    hs = [x.tanh()]
    for _ in range(n - 1):
        hs.append(hs[-1].tanh())
    return hs


def test_budget_error_while_recomputing_then_the_session_goes_on():
    x = torch.randn(64, 64, requires_grad=True)
    expect = eager_chain_grad(x, 8)
    with native.enable(cost_model="roofline", check=True) as session:
        hs = _tanh_chain(x, 8)
        # x, one activation and a scalar: the sum runs (and evicts), no recomputation fits
        session.set_budget(2 * 64 * 64 * 4 + 64)
        hs[-1].sum()
        with pytest.raises(dtr.BudgetError, match="while recomputing aten.tanh.default"):
            dtr.materialize(hs[3])
        session.set_budget(None)
        ref = x.detach()
        for h in hs:  # what the program holds reads back as computed
            ref = ref.tanh()
            assert torch.equal(dtr.materialize(h), ref)
        x.grad = None
        hs[-1].sum().backward()
    assert torch.equal(x.grad, expect)


class _Interrupt(KeyboardInterrupt):
    """A KeyboardInterrupt raised on purpose."""


def test_interrupt_during_a_recomputing_backward():
    x = torch.randn(32, 32, requires_grad=True)

    def interrupt(grad):
        raise _Interrupt

    with pytest.raises(_Interrupt):
        with native.enable(stress=True) as session:
            hs = _tanh_chain(x, 7)
            hs[3].register_hook(interrupt)
            hs[-1].sum().backward()
    assert session.stats().remats > 0
    ref = x.detach()
    for h in hs:
        ref = ref.tanh()
        assert torch.equal(dtr.materialize(h).detach(), ref)
    x.grad = None
    with native.enable(stress=True):  # the next session works
        _tanh_chain(x, 3)[-1].sum().backward()
    assert torch.equal(x.grad, eager_chain_grad(x, 3))


def test_a_failing_kernel_leaves_the_engine_consistent():
    x = torch.randn(8, 8, requires_grad=True)
    with native.enable(stress=True, check=True) as session:
        h = x.tanh()
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            h @ torch.randn(3, 3)
        session._engine.check()  # no lock or handle left behind
        (h * 2).sum().backward()
    assert torch.equal(x.grad, torch.autograd.grad((x.tanh() * 2).sum(), x)[0])


def test_tensors_used_from_other_threads():
    """Ops on the session's tensors from other threads are served under its lock."""
    x = torch.randn(64, 64, requires_grad=True)
    ref = x.detach()
    for _ in range(6):
        ref = ref.tanh()
    got = {}
    with native.enable(stress=True, check=True):
        hs = _tanh_chain(x, 6)

        def work(i):
            got[i] = dtr.materialize((hs[-1] * i).sum())

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(torch.equal(got[i], (ref * i).sum()) for i in range(4))


@pytest.mark.parametrize("change", ["other-thread-write", "data", "half", "storage-freed"])
def test_a_plain_tensor_changed_behind_the_engine_is_refused_on_recompute(change):
    """A recipe reads a parameter; then, with no op the engine sees, the parameter is written on
    another thread, gets another storage where the engine cannot see it (PyTorch's own `.data`
    setter, as C++ code reaches it; `p.data = ...` in Python is served,
    tests/engines/test_tensor_identity.py) or has its storage freed (what FSDP2 does when it reshards).
    Recomputing would read the new values (or freed memory) where the program read the old ones:
    refused with the subclass engine's dtr.UnsupportedError (tests/engines/test_faults.py, tests/distributed/test_ddp.py)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)
    expected = {
        "other-thread-write": "written in place where dtr could not see it",
        "data": "storage has since been replaced",
        "half": "storage has since been replaced",
        "storage-freed": "storage has since been freed",
    }[change]

    def write():
        with torch.no_grad():
            w.add_(1)

    with pytest.raises(dtr.UnsupportedError, match=expected) as info:
        with native.enable(stress=True):
            y = (x @ w).tanh()  # evicted at once: reading it recomputes mm, which reads w
            if change == "other-thread-write":
                t = threading.Thread(target=write)
                t.start()
                t.join()
            elif change == "data":
                torch._C.TensorBase.data.__set__(w, w.detach() * 0.5)
            elif change == "half":
                torch._C.TensorBase.data.__set__(w, w.detach().half())
            else:
                # as FSDP2 frees it, from torch's own code (the program's own call hands
                # the memory out: what read it is pinned, and nothing is recomputed)
                torch._C.TensorBase.untyped_storage(w).resize_(0)
            y.sum().item()
    assert "dtr: cannot recompute aten.mm.default" in str(info.value)


def test_torch_compiled_code_runs_eagerly_in_the_block():
    # Managed tensors are plain torch.Tensors to Dynamo: compiled, inductor's kernels read
    # an evicted input's memory directly ("dtr: this tensor's value is evicted ..."). In
    # the block compiled functions run eagerly (torch.compiler's force_eager stance), as
    # under dtr.enable(); after it they compile again.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def g(x):
        return ((x.sin() * 2).cos() + 1).sum()

    f = torch.compile(g, backend=backend)
    x0 = torch.randn(8, 8)
    x = x0.clone().requires_grad_()
    want = g(x)
    want.backward()
    want_grad = x.grad
    torch._dynamo.reset()
    with native.enable(stress=True) as session:
        x = x0.clone().requires_grad_()
        got = f(x * 1)
        got.backward()
        got = dtr.materialize(got).detach()
    assert graphs == [] and session.stats().remats > 0
    assert torch.equal(got, want.detach()) and torch.equal(x.grad, want_grad)
    assert torch.equal(f(x0), g(x0)) and len(graphs) == 1


# ---------------------------------------------------------------- dtr.enable(engine=...)
def test_dtr_enable_selects_the_native_engine(monkeypatch):
    """engine="native" (or DTR_ENGINE=native) runs the block on this engine, with
    dtr.enable's reading of the environment (DTR_MEMORY_BUDGET included)."""
    expect = _train(*_model("mlp"))
    budget = int(_peak("mlp") * 0.7)
    monkeypatch.setenv("DTR_MEMORY_BUDGET", str(budget))
    with dtr.enable(engine="native", cost_model="roofline") as session:
        got = _train(*_model("mlp"))
    assert isinstance(session, native.NativeSession) and not session.active
    stats = session.stats()
    assert stats.core == "c++" and stats.budget_bytes == budget and stats.evictions > 0
    assert got[0] == expect[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expect[1], strict=True))
    monkeypatch.setenv("DTR_ENGINE", "native")
    with dtr.enable() as from_env:
        assert from_env.active and dtr.session.current() is from_env
    assert isinstance(from_env, native.NativeSession)
    monkeypatch.setenv("DTR_ENGINE", "c++")
    with pytest.raises(dtr.ConfigError, match="unknown engine 'c..' in DTR_ENGINE; valid: auto"):
        dtr.enable()
    with pytest.raises(dtr.ConfigError, match="unknown engine 'fast'; valid: auto, native, sub"):
        dtr.enable(engine="fast")
    monkeypatch.setenv("DTR_ENGINE", "subclass")
    assert isinstance(dtr.enable(), dtr.Session)
    monkeypatch.setenv("DTR_ENGINE", "default")  # the subclass engine's old name
    with pytest.warns(DeprecationWarning, match="engine 'default' is now called 'subclass'"):
        assert dtr.enable().engine == "subclass"


def test_the_native_engine_without_the_extension_is_a_config_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "dtr._C", None)  # import dtr._C raises ImportError
    monkeypatch.delattr(dtr, "_C")
    with pytest.raises(dtr.ConfigError, match="engine 'native' needs dtr's C.. extension"):
        dtr.enable(engine="native")

"""Memory written where dtr cannot see it: a managed value handed out by address and
written through that handle, and a plain input whose foreign memory (NumPy's) is refilled
in place. Recomputations must give what eager computed: readers from before a write keep
the old contents, readers from after it the new ones (bitwise, both engines, evicting)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import dtr
import dtr.engines.native.session
import dtr.sim as sim

N = 32
STRESS = {"stress": True}


def _numpy(a, value):
    a.numpy()[:] = value


def _dlpack(a, value):
    torch.from_dlpack(a).fill_(value)


def _data_ptr_ctypes(a, value):
    src = np.full(a.numel(), value, dtype=np.float32)
    ctypes.memmove(a.data_ptr(), src.ctypes.data, src.nbytes)


def _data_ptr_numpy(a, value):
    array = (ctypes.c_float * a.numel()).from_address(a.data_ptr())
    np.ctypeslib.as_array(array)[:] = value


def _storage_tensor(a, value):
    torch.empty(0).set_(a.untyped_storage()).fill_(value)


def _storage_numpy(a, value):
    torch.empty(0).set_(a.untyped_storage()).numpy()[:] = value


ROUTES = {
    "numpy": _numpy,
    "dlpack": _dlpack,
    "data_ptr_ctypes": _data_ptr_ctypes,
    "data_ptr_numpy": _data_ptr_numpy,
    "storage_tensor": _storage_tensor,
    "storage_numpy": _storage_numpy,
}


def _exported_program(write):
    torch.manual_seed(0)
    w = torch.randn(N, N, requires_grad=True)
    v = torch.randn(N, N, requires_grad=True)
    x = torch.randn(N, N)
    a = (x @ w).tanh().detach()
    b = a.exp()  # read before the first write
    write(a, 0.5)
    c = a.sin()  # read after it
    write(a, -0.25)
    d = a.cos()  # after a second write
    e = (a * 2).exp()
    loss = (b * v).sum() + (c * v).sum() + (d * v).sum() + (e * v).square().sum()
    loss.backward()
    return [loss.detach(), b, c, d, e, a, v.grad, w.grad is None]


def _check(engine, options, program, *args, trace=None):
    """program(*args) under dtr gives eager's results, recomputing; with a trace path,
    the simulator's replay of the run (both of its engines) evicts and recomputes as the
    run did."""
    expected = program(*args)
    with dtr.enable(engine=engine, cost_model="roofline", trace=trace, **options) as session:
        got = program(*args)
    stats = session.stats()  # the block's end included, as in a replay
    assert stats.remats > 0
    for want, have in zip(expected, got, strict=True):
        if isinstance(want, torch.Tensor):
            assert torch.equal(dtr.materialize(have), want)
        else:
            assert have == want
    if trace is not None:
        prog = sim.load(trace)
        for replay in ("c++", "python"):
            res = sim.simulate(prog, None, core=replay, thrash=0, **options)
            assert res.status == "ok"
            assert (res.evictions, res.remats) == (stats.evictions, stats.remats)


# about 80% of the program's peak without a budget
@pytest.mark.parametrize("options", [STRESS, {"budget": 46 * 1024}], ids=["stress", "budget"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_writes_through_exported_memory_match_eager(engine, options, route, tmp_path):
    trace = str(tmp_path / "run.jsonl") if route == "numpy" else None
    _check(engine, options, _exported_program, ROUTES[route], trace=trace)


def test_a_reader_from_before_an_export_stays_recomputable(engine):
    # The value handed out becomes a new version (pinned); the reader computed before
    # keeps its lineage through the old value and is recomputed, not pinned.
    def program(on):
        torch.manual_seed(0)
        w = torch.randn(64, 64, requires_grad=True)
        a = (torch.randn(64, 64) @ w).tanh().detach()
        b = a.exp()
        pinned = on.stats().pinned_bytes if on else 0
        a.numpy()[:] = 3.0
        if on:
            assert on.stats().pinned_bytes == pinned + a.nbytes
        return b, a.sin()

    want = program(None)
    with dtr.enable(engine=engine, stress=True) as session:
        got = program(session)
        remats = session.stats().remats
        assert torch.equal(got[0].clone(), want[0])
        assert session.stats().remats >= remats + 3  # b, old a and the product before it
        assert torch.equal(got[1].clone(), want[1])


def _train_refilled(accumulate):
    """Two SGD steps of two micro-batches each, of a small model whose batch is a NumPy
    buffer refilled in place before each micro-batch. With `accumulate` both forwards run
    before one backward, so the first one's activations outlive the refill; without it
    each micro-batch runs its backward, and only its loss (kept for logging) does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(N, 2 * N), torch.nn.Tanh(), torch.nn.Linear(2 * N, 2 * N),
        torch.nn.Tanh(), torch.nn.Linear(2 * N, 4),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    buf = np.zeros((16, N), dtype=np.float32)
    x = torch.from_numpy(buf)
    out = []
    for _ in range(2):
        losses = []
        for _ in range(2):
            buf[:] = rng.standard_normal(buf.shape, dtype=np.float32)
            loss = model(x).square().mean()
            if accumulate:
                losses.append(loss)
            else:
                loss.backward()
            out.append(loss.detach())
        if accumulate:
            sum(losses).backward()
        out.extend(p.grad.clone() for p in model.parameters())
        opt.step()
        opt.zero_grad()
    out.extend(p.detach().clone() for p in model.parameters())
    return out


# about 80% of the program's peak without a budget, above its op-level floor (77.5 KiB)
@pytest.mark.parametrize("options", [STRESS, {"budget": 78 * 1024}], ids=["stress", "budget"])
def test_numpy_batch_refilled_between_accumulated_micro_batches_matches_eager(engine, options):
    _check(engine, options, _train_refilled, True)


def test_numpy_batch_refilled_with_earlier_losses_kept_matches_eager(engine):
    _check(engine, STRESS, _train_refilled, False)


def test_reads_of_an_unchanged_foreign_buffer_share_one_snapshot(engine):
    # Each recipe reading the buffer holds a copy of it, taken when its op ran: one copy
    # while the bytes stay the same, a new one after a refill.
    buf = np.ones((64, 64), dtype=np.float32)
    x = torch.from_numpy(buf)
    w = torch.randn(64, 64, requires_grad=True)
    with dtr.enable(engine=engine, stress=True) as session:
        ys = [x @ w for _ in range(3)]
        once = session.stats().constant_bytes
        buf[:] = 2.0
        ys.append(x @ w)
        twice = session.stats().constant_bytes
        assert once == w.nbytes + x.nbytes
        assert twice == once + x.nbytes
        assert torch.equal(ys[0] * 2, ys[3])  # recomputed (stress) from the copies


def _aliased_export_program():
    # a is one of two views of a buffer the program holds: the export cannot move the
    # storage to a new version, so what read either view is materialized and pinned.
    torch.manual_seed(0)
    w = torch.randn(N, N, requires_grad=True)
    v = torch.randn(N // 2, N, requires_grad=True)
    h = (torch.randn(N, N) @ w).tanh().detach()
    a, rest = h[: N // 2], h[N // 2 :]
    b, r = a.exp(), rest.exp()
    a.numpy()[:] = 0.5
    c = h.sin()
    loss = (b * v).sum() + (r * v).sum() + (c[: N // 2] * v).sum()
    loss.backward()
    return [loss.detach(), b, r, c, h, v.grad]


def test_writes_through_an_exported_view_match_eager(engine):
    _check(engine, STRESS, _aliased_export_program)


def _exported_leaf_program(write):
    # A parameter made before the block: a plain tensor that recipes read. Its memory is
    # handed out in the block and written through the handle; what read it before each
    # write is recomputed from what it read then.
    torch.manual_seed(0)
    p = _leaf[0].clone().requires_grad_()
    c = p.clone()  # read before the first write
    s = p * 2
    write(p.detach(), 0.5)
    d = p.sin()  # read after it
    write(p.detach(), -0.25)
    e = (p * 3).exp()  # after a second write
    loss = (c * s).sum() + d.sum() + e.sum()
    loss.backward()
    return [loss.detach(), c, s, d, e, p.detach(), p.grad]


_leaf = [torch.randn(N, N, generator=torch.Generator().manual_seed(1))]


# numpy() and DLPack hand out a writable array; a raw pointer or storage of a plain
# tensor is not taken as an export (dtr/plain_exports.py, README Limits)
@pytest.mark.parametrize("route", ["dlpack", "numpy"])
def test_writes_through_an_exported_plain_leaf_match_eager(engine, route):
    _check(engine, STRESS, _exported_leaf_program, ROUTES[route])


def _exported_alias_program(write):
    # The value requires grad, so the program exports a detached alias of it (as
    # `v.detach().numpy()` must be written): readers of the value itself, taken before
    # the write, are recomputed from what they read then.
    torch.manual_seed(0)
    x = torch.randn(N, N, requires_grad=True)
    v = x * 2.0 + 1.0
    r = v.exp()  # read before the write
    write(v.detach(), 0.5)
    w = v * 3.0  # read after it
    loss = r.sum() + w.square().sum()
    loss.backward()
    return [loss.detach(), r, w, v.detach(), x.grad]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_writes_through_an_exported_alias_of_a_value_that_requires_grad_match_eager(
    engine, route
):
    _check(engine, STRESS, _exported_alias_program, ROUTES[route])


class _GradFromAStash(torch.autograd.Function):
    """w * 2, whose backward returns w's gradient as the first rows of a bigger buffer
    that it also keeps (something other than .grad holding the gradient's memory)."""

    stash: list = []

    @staticmethod
    def forward(ctx, w):
        return w * 2

    @staticmethod
    def backward(ctx, g):
        big = torch.cat([g * 2, g * 3])
        _GradFromAStash.stash.append(big)
        return big[: g.shape[0]]


def test_a_gradient_sharing_memory_with_a_live_tensor_is_handed_out_as_a_copy(engine):
    # Exporting the shared memory would pin the buffer and its readers for good; .grad
    # gets a plain copy instead, equal to eager's, and the buffer stays dtr's to evict.
    def step():
        _GradFromAStash.stash.clear()
        w = torch.linspace(-1, 1, 4 * N).reshape(4, N).requires_grad_()
        (_GradFromAStash.apply(w).exp() * 0.5).sum().backward()
        return w

    want = step().grad
    with dtr.enable(engine=engine, stress=True) as session:
        w = step()
        pinned = session.stats().pinned_bytes
        grad = w.grad
        assert type(grad) is torch.Tensor and not dtr.engines.native.session.is_managed(grad)
        assert torch.equal(grad, want)
        grad.zero_()  # a copy: the buffer keeps the gradient it held
        kept = dtr.materialize(_GradFromAStash.stash[0])
        assert torch.equal(kept[: want.shape[0]], want)
    assert pinned < 2 * 4 * N * 4  # not the buffer (twice the gradient), pinned in place


class _Scale(torch.autograd.Function):
    """x * w.t() with a hand-written backward: w is read only here, with grad mode off."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.mm(w.t())

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g.mm(w), g.t().mm(x)


@pytest.mark.parametrize("first_layer", [False, True], ids=["on_activations", "on_the_input"])
def test_a_parameter_read_only_by_a_custom_functions_forward_gets_a_plain_grad(engine, first_layer):
    # An autograd.Function's forward runs with grad mode off; its backward still
    # accumulates a managed gradient into the parameter, which optimizers must see plain.
    # On the input batch (a plain tensor) the forward's ops read no managed value at all.
    def train():
        torch.manual_seed(0)
        w = torch.randn(N, N, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        x = torch.randn(8, N)
        grads = []
        for _ in range(2):
            h = _Scale.apply(x if first_layer else x.exp(), w)
            (h.tanh() * 0.5).sum().backward()
            grads.append(w.grad.clone())
            assert type(w.grad) is torch.Tensor and not dtr.engines.native.session.is_managed(w.grad)
            opt.step()
            opt.zero_grad(set_to_none=False)
        return w.detach().clone(), grads

    want_w, want_grads = train()
    with dtr.enable(engine=engine, stress=True) as session:
        got_w, got_grads = train()
        assert session.stats().remats > 0
    assert all(torch.equal(g, h) for g, h in zip(got_grads, want_grads, strict=True))
    assert torch.equal(got_w, want_w)

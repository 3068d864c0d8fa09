"""Semantics of the live runtime, each checked against plain eager PyTorch: views,
in-place updates, aliasing, RNG replay, multi-output and out= ops, what leaves the block,
optimizers, and behaviour on errors.

The comparisons run on every device in ``tests.utils.DEVICES`` (CPU, and CUDA when there
is one). On CPU they are bitwise. On CUDA they are bitwise too, under deterministic
algorithms, unless a kernel without a deterministic implementation ran (then within a few
ulps; ``tests.utils.deterministic``). Tests of CPU-only features (``.numpy()``, sparse
tensors) and of bookkeeping that no device changes run on CPU only.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import pickle
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtr
from tests.utils import DEVICES, assert_matches, deterministic, eager_and_dtr, eager_chain_grad


def _check(fn, device, **kwargs):
    """_run, then every value fn returned equals eager's (bitwise where exact)."""
    expected, got, stats, exact = eager_and_dtr(fn, device, **kwargs)
    assert len(got) == len(expected)
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert_matches(g, e, exact, f"value {i}")
    return stats


STRESS = {"stress": True, "check": True}
on_devices = pytest.mark.parametrize("device", DEVICES)


@on_devices
def test_views_and_inplace_chain(device, core):
    def fn():
        x = torch.randn(6, 8, device=device, requires_grad=True)
        h = x * 2
        v = h[1:4].t()  # view of a managed tensor
        w = v.relu()
        h2 = h.clone()
        h2.mul_(3).add_(1)  # private in-place chain: versions
        y = (w.sum() + h2.sum()) * h2.mean()
        y.backward()
        return [y.detach(), x.grad, w, h2]

    stats = _check(fn, device, **STRESS)
    assert stats.remats > 0


@on_devices
def test_inplace_on_aliased_view_pins_and_matches(device, core):
    # Writing through a view while the base is held: the pool cannot keep its lineage,
    # so it is pinned; results must still match eager.
    pinned = []

    def fn():
        x = torch.randn(5, 5, device=device, requires_grad=True)
        base = x * 3  # mul by a scalar saves nothing for backward
        row = base[2]
        row.mul_(0.5)  # base sees the write too
        if dtr.session.current() is not None:
            pinned.append(dtr.session.current().stats().pinned_bytes)
        y = base.sum() + row.sum()
        y.backward()
        return [base.detach(), row.detach(), x.grad]

    _check(fn, device, **STRESS)
    assert pinned[0] >= 5 * 5 * 4  # the base's storage can no longer be evicted


@on_devices
def test_dropout_rng_replay(device, core):
    # On CUDA the generator is Philox (a seed and an offset): replay restores both.
    def fn():
        x = torch.randn(32, 16, device=device, requires_grad=True)
        a = F.dropout(x, 0.5, training=True)
        b = F.dropout(a * 2, 0.3, training=True)
        noise = torch.randn_like(b)
        y = (b + noise).pow(2).sum()
        y.backward()
        after = torch.rand(3, device=device)  # the stream after the block: the eager one
        return [y.detach(), x.grad, after]

    stats = _check(fn, device, **STRESS)
    assert stats.remats > 0


@on_devices
def test_explicit_generator_replay(device, core):
    def fn():
        g = torch.Generator(device=device).manual_seed(7)
        x = torch.randn(16, 16, device=device, requires_grad=True)
        m = torch.empty_like(x).bernoulli_(0.5, generator=g)
        y = (x * m).sum() + torch.rand(4, device=device, generator=g).sum()
        y.backward()
        return [y.detach(), x.grad, g.get_state()]

    _check(fn, device, **STRESS)


@on_devices
def test_multi_output_and_out_variants(device, core):
    def fn():
        x = torch.randn(7, 9, device=device, requires_grad=True)
        values, indices = (x * 3).max(dim=1)
        parts = torch.split(x.exp(), [2, 3, 4], dim=1)
        s = torch.empty(7, 9, device=device)
        torch.add(x.detach(), 1, out=s)  # out= into a plain tensor
        y = values.sum() + sum(p.sum() for p in parts) + s.sum()
        y.backward()
        return [y.detach(), x.grad, indices, s]

    _check(fn, device, **STRESS)


@on_devices
def test_out_into_managed_tensor(device, core):
    def fn():
        x = torch.randn(4, 4, device=device)
        buf = x * 0
        torch.mul(x, 2, out=buf)
        return [buf + 1]

    _check(fn, device, **STRESS)


@on_devices
def test_batchnorm_running_stats_updated_once(device, core):
    # Recomputing batch norm must not update the running statistics again (on CUDA the
    # op is cudnn_batch_norm, or native_batch_norm where cuDNN does not apply).
    def fn():
        torch.manual_seed(1)
        bn = nn.BatchNorm1d(8, device=device)
        x = torch.randn(16, 8, device=device, requires_grad=True)
        y = bn(x).relu().sum() + bn(x * 2).sum()
        y.backward()
        return [y.detach(), x.grad, bn.running_mean, bn.running_var, bn.num_batches_tracked]

    stats = _check(fn, device, **STRESS)
    assert stats.remats > 0


@on_devices
def test_data_dependent_item_and_tolist(device, core):
    def fn():
        x = torch.randn(10, device=device, requires_grad=True)
        h = x.sigmoid()
        out = h * 2 if h.sum().item() > 5 else h * 3
        lst = out.tolist()
        y = out.sum()
        y.backward()
        return [y.detach(), x.grad, torch.tensor(lst)]

    _check(fn, device, **STRESS)


@on_devices
def test_ops_that_read_a_tensor_argument_in_cpp_get_its_value(device, core, engine, tmp_path):
    """tensor_split's indices and ctc_loss's lengths are read by PyTorch's composite kernels through
    data_ptr() before any op reaches dtr (dtr/engines/subclass/undispatched_reads.py; the native
    engine's read_values_first): they are handed over as values, recomputed when evicted (READ in
    the trace), and the run equals eager and replays in the simulator to the same recomputations."""
    from dtr import sim

    if engine == "native" and device != "cpu":
        pytest.skip("the native engine runs on the CPU")

    def fn():
        x = torch.randn(10, 4, device=device, requires_grad=True)
        lp = torch.randn(12, 2, 5, device=device).log_softmax(2).detach().requires_grad_()
        h, z = x * 2, lp * 1
        # computed from managed values, so managed (and evicted at once under stress)
        indices = (h[:3, 0] * 0).long().cpu() + torch.tensor([1, 4, 7])
        sections = (h[0, 0] * 0).long().cpu() + 3  # 0-d: a number of sections
        parts = torch.tensor_split(h, indices) + torch.tensor_split(h, sections, 1)
        loss = sum((p**2).sum() * (i + 1) for i, p in enumerate(parts))
        targets = torch.randint(1, 5, (2, 4), device=device)
        zero = (z[:2, 0, 0] * 0).long()
        lengths = zero + 12 - torch.tensor([0, 2], device=device)
        loss = loss + F.ctc_loss(z, targets, lengths, zero + 4 - 1)
        loss.backward()
        return [loss.detach(), x.grad, lp.grad, *parts]

    path = str(tmp_path / "reads.jsonl")
    stats = _check(fn, device, stress=True, cost_model="roofline", trace=path, engine=engine)
    assert stats.remats > 0
    records = [json.loads(line) for line in open(path)]
    assert sum(r["INSTRUCTION"] == "READ" for r in records) >= 3  # indices, both lengths
    res = sim.simulate(sim.load(path), stress=True, thrash=0)
    assert res.status == "ok" and res.remats == stats.remats

    # Plain arguments, and bad ones, get PyTorch's own composite and its errors.
    plain = torch.tensor_split(torch.ones(7), torch.tensor([1, 3]))
    assert [p.shape[0] for p in plain] == [1, 2, 4]
    with dtr.enable(stress=True, engine=engine):
        floats = torch.tensor([1.0, 3.0]) * 1
        with pytest.raises(RuntimeError, match="dtype of long"):
            torch.tensor_split(torch.ones(7) * 1, floats)


def test_tracing_tensor_split_after_a_session(core):
    # The kernels dtr/engines/subclass/undispatched_reads.py registers stay after the block; under
    # the Python dispatcher (AOTAutograd's tracing with fake tensors) they must take the Python
    # decomposition the dispatcher took before, not the C++ composite that reads memory.
    with dtr.enable():
        pass

    def g(x, i):
        return sum(p.sum() * (k + 1) for k, p in enumerate(torch.tensor_split(x, i)))

    x = torch.randn(8, requires_grad=True)
    i = torch.tensor([1, 5])
    torch._dynamo.reset()
    got = torch.compile(g, backend="aot_eager", fullgraph=True, dynamic=False)(x, i)
    assert torch.equal(got, g(x, i))


@pytest.mark.parametrize("stress", [False, True])
def test_a_numpy_array_aliases_the_tensor_as_in_eager(core, engine, stress):
    # t.numpy() shares memory with t: a write through the array is seen by the tensor,
    # an in-place op on the tensor by the array, whatever dtr evicts and recomputes in
    # between (stress: everything, after every op). The native engine pins the value
    # (dtr/engines/native/undispatched_reads.py).

    def program():
        x = torch.arange(6.0, requires_grad=True)
        t = x * 2  # managed (it requires grad)
        a = t.detach().numpy()
        a[0] = 100.0
        u = x + 1  # another op: t may be evicted at its boundary
        seen = t.sum().item()
        with torch.no_grad():
            t.add_(1)
            t.mul_(3)
        return seen, a.copy(), dtr.materialize(t).detach().clone(), u.sum().item()

    want = program()
    with dtr.enable(engine=engine, stress=stress):
        got = program()
    assert got[0] == want[0] and got[3] == want[3]
    assert (got[1] == want[1]).all() and torch.equal(got[2], want[2])


EXPORTERS = {
    "torch.to_dlpack": lambda t: torch.from_dlpack(torch.to_dlpack(t)),
    "torch.utils.dlpack": lambda t: torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t)),
    "torch.from_dlpack": lambda t: torch.from_dlpack(t),
    "np.from_dlpack": lambda t: torch.from_numpy(np.from_dlpack(t)),
}


@pytest.mark.parametrize("stress", [False, True])
@pytest.mark.parametrize("export", list(EXPORTERS))
def test_a_dlpack_capsule_shares_the_tensors_memory_as_in_eager(core, engine, stress, export):
    # DLPack hands out the memory itself. On the subclass engine's wrapper (address 0)
    # every route crashed the process or read garbage; the native engine's value could
    # be evicted under the capsule. Now the value is pinned, as numpy() pins it
    # (dtr/dlpack.py, CheckpointTensor.__dlpack__, dtr/engines/native/undispatched_reads.py).

    def program():
        x = torch.arange(6.0, requires_grad=True)
        t = (x * 2).detach()
        r = EXPORTERS[export](t)
        r[0] = 100.0
        u = x + 1  # another op: t may be evicted at its boundary
        seen = t.sum().item()
        t.add_(1)
        return seen, r.clone(), t.clone(), u.sum().item()

    want = program()
    with dtr.enable(engine=engine, stress=stress):
        got = [dtr.materialize(v) if isinstance(v, torch.Tensor) else v for v in program()]
    assert got[0] == want[0] and got[3] == want[3]
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_data_ptr_is_the_values_address_for_the_tensors_life(core, engine):
    # The subclass engine's wrapper answered 0 for every managed tensor (code comparing
    # addresses saw them all alias); the native engine raised for an evicted value.
    x = torch.randn(64, 64, requires_grad=True)
    with dtr.enable(engine=engine, stress=True) as session:
        t = (x * 2).detach()
        u = (x * 3).detach()
        p = t.data_ptr()
        assert p != 0 and p != u.data_ptr() and t.const_data_ptr() == p
        assert t[1:].data_ptr() == p + 64 * t.element_size()  # a view: the same memory
        [t * k for k in range(3)]  # stress: everything evictable is evicted
        assert t.data_ptr() == p  # pinned: never evicted and rebuilt elsewhere
        assert session.stats().pinned_bytes >= t.nbytes
        assert torch.equal(dtr.materialize(t), (x * 2).detach())


def test_a_wrappers_storage_is_its_values(core):
    # The wrapper's own storage has no memory: share_memory_() (which goes through it)
    # and a plain tensor set_ on it crashed the process. Now the value's, pinned.
    x = torch.randn(64, 64, requires_grad=True)
    with dtr.enable(stress=True) as session:
        t = (x * 2).detach()
        storage = t.untyped_storage()
        assert storage.data_ptr() == t.data_ptr() and storage.nbytes() == t.nbytes
        alias = torch.empty(0).set_(storage).view(64, 64)
        alias[0, 0] = 100.0
        [t * k for k in range(3)]  # stress: everything evictable is evicted
        assert (t + 0)[0, 0].item() == 100.0
        assert t.share_memory_() is t and t.is_shared()
        assert (t + 0)[0, 0].item() == 100.0 and session.stats().pinned_bytes >= t.nbytes


@pytest.mark.parametrize("stress", [False, True])
def test_python_functions_applied_in_place_are_writes_as_in_eager(core, engine, stress):
    # apply_/map_/map2_ loop over the memory below dispatch: apply_ crashed the process
    # on the subclass engine's wrapper; on the native engine a write dtr did not see was
    # lost at the next recomputation, and an evicted value raised.

    def program():
        x = torch.arange(6.0, requires_grad=True)
        with pytest.raises(RuntimeError, match="apply_.. on Variable that requires grad"):
            (x * 2).apply_(lambda v: v)
        t = (x * 2).detach()
        o = (x * 3).detach()
        t.apply_(lambda v: v + 1)
        u = x + 1  # another op: t may be evicted at its boundary
        t.map_(o, lambda a, b: a * b)
        t.map2_(o, u.detach(), lambda a, b, c: a - b + c)
        return t.clone(), (t + o).sum().item()

    want = program()
    with dtr.enable(engine=engine, stress=stress):
        got = program()
        got = (dtr.materialize(got[0]), got[1])
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def _tanh_loss(w, x):
    return torch.tanh(x @ w).sum()


FUNCTIONAL = {
    "vmap": lambda h, w: torch.func.vmap(lambda row: (row * 2).sin())(h),
    "grad": lambda h, w: torch.func.grad(_tanh_loss)(w.detach(), h.detach()),
    "jacrev": lambda h, w: torch.func.jacrev(torch.sin)(h[0].detach()),
    "jvp": lambda h, w: torch.func.jvp(torch.sin, (h[0].detach(),), (torch.ones(8),))[1],
    "per-sample grads": lambda h, w: torch.func.vmap(
        torch.func.grad(_tanh_loss), in_dims=(None, 0)
    )(w.detach(), h.detach()),
    "autograd.functional.jacobian": lambda h, w: torch.autograd.functional.jacobian(
        torch.sin, h[0].detach()
    ),
    "autograd.functional.hessian": lambda h, w: torch.autograd.functional.hessian(
        lambda v: v.sin().sum(), h[0].detach()
    ),
}


@pytest.mark.parametrize("transform", list(FUNCTIONAL))
def test_function_transforms_of_managed_tensors_match_eager(core, engine, transform):
    # torch.func's transforms wrap tensors in functorch's own (batched, gradient) levels;
    # a managed tensor below them must read and recompute as any other.

    def program():
        torch.manual_seed(0)
        w = torch.randn(8, 8, requires_grad=True)
        h = (torch.randn(4, 8) @ w).tanh()  # managed
        return FUNCTIONAL[transform](h, w)

    want = program()
    with dtr.enable(engine=engine, stress=True):
        got = dtr.materialize(program()).clone()
    assert torch.equal(got, want)


def test_tensor_and_module_hooks_run_as_in_eager(core, engine):
    # Hooks see and change values dtr evicts and recomputes: a tensor hook scaling a
    # gradient, retain_grad on an activation, forward and forward-pre hooks that
    # replace outputs and inputs, full backward and backward-pre hooks.
    def program():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)])
        seen = []
        model[1].register_forward_hook(lambda m, i, o: o * 0.5)
        model[2].register_forward_pre_hook(lambda m, i: (i[0] + 1,))
        model[3].register_full_backward_hook(lambda m, gi, go: (gi[0] * 2,))
        model[4].register_full_backward_pre_hook(lambda m, go: (go[0] * 0.25,))
        x = torch.randn(16, 32, requires_grad=True)
        h = model[0](x)
        h.register_hook(lambda g: g * 3)
        h.retain_grad()
        out = model[1:](h)
        out.register_hook(lambda g: seen.append(g.sum().item()))
        out.square().sum().backward()
        return [p.grad for p in model.parameters()] + [x.grad, h.grad, torch.tensor(seen)]

    want = program()
    with dtr.enable(engine=engine, stress=True) as session:
        got = program()
    assert session.stats().evictions > 0
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_python_level_methods_inside_the_block(core):
    with dtr.enable(stress=True) as session:
        x = torch.arange(6.0, requires_grad=True)
        t = (x * 2).reshape(2, 3)
        assert isinstance(t, dtr.CheckpointTensor)
        assert t.tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
        with pytest.raises(RuntimeError, match="requires grad"):  # as eager
            t.numpy()
        assert (t.detach().numpy() == [[0, 2, 4], [6, 8, 10]]).all()
        assert (t.numpy(force=True) == [[0, 2, 4], [6, 8, 10]]).all()
        assert repr(t).startswith("tensor([[ 0.,  2.,  4.],")
        assert "grad_fn=<ViewBackward0>" in repr(t)
        assert f"{t.sum():.1f}" == "30.0"
        assert t.sum().item() == 30.0
        buf = io.BytesIO()
        torch.save({"t": t}, buf)
        buf.seek(0)
        loaded = torch.load(buf)["t"]
        assert type(loaded) is torch.Tensor and loaded.tolist() == t.tolist()
        copied = copy.deepcopy(t.detach())
        assert type(copied) is torch.Tensor and torch.equal(copied, loaded)
        assert pickle.loads(pickle.dumps(t.detach())).tolist() == t.tolist()
    assert session.stats().ops > 0


@on_devices
def test_everything_leaving_the_block_is_plain(device, core):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        with dtr.enable(stress=True):
            out = model(torch.randn(3, 4, device=device))
            loss = out.pow(2).sum()
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            opt.step()
            return loss, out, grads

    loss, out, grads = step()
    assert all(type(g) is torch.Tensor for g in grads)
    assert all(type(v) is torch.Tensor for v in model.state_dict().values())
    # Returned wrappers behave as plain tensors once the block has ended.
    assert isinstance(out, dtr.CheckpointTensor)
    doubled = out * 2
    assert type(doubled) is torch.Tensor
    assert torch.equal(doubled, dtr.materialize(out) * 2)
    assert type(dtr.materialize(loss)) is torch.Tensor
    assert loss.item() == dtr.materialize(loss).item()
    buf = io.BytesIO()
    torch.save(out, buf)
    buf.seek(0)
    assert type(torch.load(buf)) is torch.Tensor


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
        lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
        lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    ],
    ids=["sgd-foreach", "sgd-loop", "adam-foreach", "adam-fused", "adamw-foreach", "adamw-fused"],
)
@on_devices
def test_optimizers_see_plain_grads(make_opt, device, core):
    def train(use_dtr):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
        model.to(device)
        opt = make_opt(list(model.parameters()))
        ctx = (
            dtr.enable(stress=True)
            if use_dtr
            else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        )
        with ctx:
            for _ in range(3):
                loss = model(torch.randn(5, 8, device=device)).pow(2).mean()
                loss.backward()
                assert all(type(p.grad) is torch.Tensor for p in model.parameters())
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], opt.state_dict()

    with deterministic(device) as nondeterministic:
        (expected, _), (got, state) = train(False), train(True)
    for e, g in zip(expected, got, strict=True):
        assert_matches(g, e, not nondeterministic, "parameter")
    for per_param in state["state"].values():
        for v in per_param.values():
            assert not isinstance(v, dtr.CheckpointTensor)


@pytest.mark.parametrize("name", ["Adagrad", "Adam", "RMSprop"])
def test_optimizer_made_inside_the_block_keeps_plain_state(name, core):
    # Adagrad fills its state in __init__ with full_like(p) outside no_grad: a value no
    # gradient flows from, which stays plain (it was managed, counted in the budget).
    def train(use_dtr):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        with (
            dtr.enable(budget="4KiB", cost_model="roofline")
            if use_dtr
            else contextlib.nullcontext()
        ):
            opt = getattr(torch.optim, name)(model.parameters(), lr=1e-2)
            for _ in range(3):
                model(torch.randn(5, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        states = [v for per in opt.state.values() for v in per.values()]
        assert all(type(v) is torch.Tensor for v in states if isinstance(v, torch.Tensor))
        return [p.detach().clone() for p in model.parameters()]

    for e, g in zip(train(False), train(True), strict=True):
        assert torch.equal(g, e)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@on_devices
def test_parameters_in_one_flat_buffer_updated_by_a_foreach_optimizer(optimizer, device, core):
    # cuDNN keeps every weight of an nn.LSTM as a view of one flat buffer, so a foreach
    # optimizer writes several views of one storage in one op while recipes (the losses
    # kept below) still read it: invalidating those for the first view must not drop
    # the constant the other views name (it did: "dtr: no tensor 6" on CUDA).
    def fn():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        offset = 0
        for p in model.parameters():
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        params = list(model.parameters())
        if optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
        else:
            opt = torch.optim.Adam(params, lr=1e-2, foreach=True)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 6, device=device)).pow(2).mean()
            loss.backward()
            # every parameter has its own gradient hook, though they share a storage
            assert all(type(p.grad) is torch.Tensor for p in params)
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        return losses + [flat.clone()]

    stats = _check(fn, device, **STRESS)
    assert stats.remats > 0


@on_devices
def test_gradient_accumulation_and_zero_grad_without_none(device, core):
    def fn():
        torch.manual_seed(3)
        model = nn.Linear(6, 3, device=device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            for _ in range(3):  # micro-batches
                (model(torch.randn(4, 6, device=device)).pow(2).mean() / 3).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        return [model.weight.detach().clone(), model.bias.detach().clone(), model.weight.grad]

    _check(fn, device, **STRESS)


@on_devices
def test_no_grad_evaluation_inside_block(device, core):
    def fn():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5), nn.ReLU()).to(device)
        x = torch.randn(8, 5, device=device)
        model(x).sum().backward()
        model.eval()
        with torch.no_grad():
            y = model(x)
        return [y, model[0].weight.grad]

    _check(fn, device, **STRESS)


def test_model_built_inside_block_stays_plain(core):
    with dtr.enable(stress=True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
        model.register_buffer("mask", torch.ones(3, 3).tril())
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
    for t in list(model.parameters()) + list(model.buffers()):
        assert type(t) in (torch.Tensor, nn.Parameter)
    for per_param in opt.state.values():
        assert all(not isinstance(v, dtr.CheckpointTensor) for v in per_param.values())


@on_devices
def test_exception_inside_block_leaves_no_state(device, core):
    x = torch.randn(4, 4, device=device, requires_grad=True)
    kept = []
    with pytest.raises(ZeroDivisionError):
        with dtr.enable(stress=True):
            h = (x * 2).exp()
            kept.append(h)
            raise ZeroDivisionError("user error in a training step")
    assert torch.equal(dtr.materialize(kept[0]), (x * 2).exp().detach())
    assert type(kept[0] + 1) is torch.Tensor
    with dtr.enable(stress=True) as session:  # a later session works
        (x * 3).sum().backward()
    assert session.stats().ops > 0
    assert torch.equal(x.grad, torch.full((4, 4), 3.0, device=device))


def test_nested_enable_is_rejected_and_outer_survives(core):
    with dtr.enable() as outer:
        y = torch.randn(3, requires_grad=True) * 2
        with pytest.raises(dtr.DTRError, match="already active"):
            with dtr.enable():
                pass
        assert outer.active
        y.sum().backward()
    assert not outer.active


@on_devices
def test_set_budget_inside_block(device, core):
    x = torch.randn(64, 64, device=device, requires_grad=True)
    with dtr.enable() as session:
        hs = [x.tanh()]
        for _ in range(10):
            hs.append(hs[-1].tanh())
        session.set_budget(8 * 64 * 64 * 4)
        hs[-1].sum().backward()
        stats = session.stats()
    assert stats.budget_bytes == 8 * 64 * 64 * 4
    assert stats.evictions > 0
    assert_matches(x.grad, eager_chain_grad(x, 11))  # tanh: deterministic everywhere


@on_devices
def test_wrappers_used_from_another_thread(device, core):
    # dtr's mode is per thread; a managed tensor used on another thread is served by
    # the same runtime under its lock.
    x = torch.randn(32, 32, device=device, requires_grad=True)
    with dtr.enable(budget=40 * 1024, cost_model="roofline", check=True) as session:
        hs = [x.sin()]
        for _ in range(8):
            hs.append(hs[-1].sin())
        results = {}

        def worker(i):
            results[i] = (hs[i] * 2).sum().item()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = hs[-1].sum()
        total.backward()
    ref = x.detach()
    for i in range(4):
        ref_i = ref
        for _ in range(i + 1):
            ref_i = ref_i.sin()
        assert results[i] == (ref_i * 2).sum().item()
    assert session.stats().peak_resident_bytes <= 40 * 1024


def test_metadata_inplace_on_managed_tensor_is_a_clear_error(core):
    with dtr.enable():
        x = torch.randn(4, 4, requires_grad=True) * 1
        with pytest.raises(dtr.UnsupportedError, match="dtr: .*resize_"):
            x.detach().resize_(16)


@on_devices
def test_double_backward_gradient_penalty(device, core):
    def fn():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1)).to(device)
        x = torch.randn(8, 6, device=device, requires_grad=True)
        out = model(x).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        loss = out + gx.pow(2).sum()
        loss.backward()
        return [loss.detach(), model[0].weight.grad, model[2].weight.grad, x.grad]

    stats = _check(fn, device, **STRESS)
    assert stats.remats > 0


@on_devices
def test_data_attribute_and_requires_grad_leaf(device, core):
    def fn():
        a = torch.randn(5, 5, device=device, requires_grad=True)
        h = (a * 2).tanh()
        d = h.data  # no history, same values
        leaf = (h * 3).detach().requires_grad_()
        y = (leaf * d).sum()
        y.backward()
        return [d, leaf.grad, y.detach()]

    _check(fn, device, **STRESS)


@on_devices
def test_in_place_view_ops_and_group_norm(device, core):
    def fn():
        torch.manual_seed(0)
        gn = nn.GroupNorm(2, 4, device=device)
        x = torch.randn(3, 4, 5, device=device, requires_grad=True)
        z = gn(x * 2).unsqueeze(0).clone()
        z.squeeze_(0)
        z.transpose_(0, 2)
        m = (z[0] * 1).t_()
        (z.sin().sum() + m.sum()).backward()
        return [x.grad, gn.weight.grad, z.detach(), m.detach()]

    _check(fn, device, **STRESS)


@on_devices
def test_conjugate_bit_is_carried(device, core):
    def fn():
        x = torch.randn(6, dtype=torch.complex64, device=device, requires_grad=True)
        y = (x * 2).conj()
        z = torch.view_as_real(y.resolve_conj()).sum() + torch.fft.hfft(x * 1).sum()
        z.backward()
        return [z.detach(), x.grad]

    _check(fn, device, **STRESS)


def test_sparse_tensors_pass_through_and_writing_one_from_a_managed_one_is_an_error(core):
    # (tests/engines/test_sparse.py: sparse tensors read by managed ops, both engines)
    s = torch.randn(3, 3).to_sparse()
    with dtr.enable():
        assert (s * 2).to_dense().sum().item() == pytest.approx((s.to_dense() * 2).sum().item())
        w = torch.randn(3, 3, requires_grad=True) * 1
        assert (w.to_sparse().to_dense() == dtr.materialize(w)).all()
        assert isinstance(torch.sparse.mm(s, w), dtr.CheckpointTensor)  # recorded
        with pytest.raises(dtr.UnsupportedError, match="dtr: .*writes to a sparse tensor"):
            s.mul_(w.sum().detach())


def test_asynchronous_copies_are_replayed_blocking(core):
    # A recomputed value is read at once, without the synchronization the program wrote
    # after its own non_blocking copy: recipes keep the op but replay it blocking.
    def fn(managed):
        torch.manual_seed(0)
        x = torch.randn(8, 8, requires_grad=True)
        y = (x * 2).to(torch.float64, non_blocking=True)
        z = (x * 1).copy_(x + 1, True)  # non_blocking as a positional argument
        if managed:
            rt = y._dtr_ref.runtime
            for t, name in ((y, "aten._to_copy.default"), (z, "aten.copy_.default")):
                rec = rt.recipes[rt.core.recipe_of(t._dtr_ref.node.tid)]
                assert rec.facts.name == name
                assert rec.kwargs.get("non_blocking", False) is False
                assert True not in rec.args
        out = (y.sin() * 2).sum() + (z.cos() * 3).sum()
        out.backward()
        return out.detach(), x.grad

    want = fn(False)
    with dtr.enable(stress=True, check=True) as session:
        got = fn(True)
    assert session.stats().remats > 0
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("graph_break", [False, True])
def test_torch_compile_inside_a_session(core, graph_break):
    # dtr's mode opts out of PyTorch's per-op torch._disable_dynamo wrapper (15 us an op)
    # and keeps Dynamo's frame hook away from its handler itself: a compiled function
    # (with a graph break, so compiled code and eager frames interleave) runs under dtr
    # bitwise, with no Dynamo warning about tracing dtr's code.
    import warnings

    def g(x):
        y = x.sin() * 2
        if graph_break:
            torch._dynamo.graph_break()
        return (y.cos() + 1).sum()

    f = torch.compile(g, backend="eager")
    torch.manual_seed(0)
    x0 = torch.randn(8, 8)
    x = x0.clone().requires_grad_()
    want = f(x)
    want.backward()
    want_grad = x.grad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dtr.enable(stress=True, check=True) as session:
            x = x0.clone().requires_grad_()
            got = f(x * 1)
            got.backward()
            got = dtr.materialize(got).detach()
    assert session.stats().remats > 0
    assert torch.equal(got, want.detach()) and torch.equal(x.grad, want_grad)
    assert not [str(w.message) for w in caught if "ynamo" in str(w.message)]


@pytest.mark.filterwarnings("ignore::UserWarning")  # export's own notes
def test_torch_export_inside_a_budgeted_block_counts_no_fake_tensors(core, engine):
    # torch.export traces with FakeTensors, whose ops pass through dtr's mode. They hold
    # no memory: managed, they counted phantom bytes (a fake copy of every parameter)
    # against the budget, failed with a BudgetError here, and the failed block's close()
    # then raised "Cannot copy out of meta tensor" over it. Budget: the peak of the same
    # block without the export (the exported module's own run fits by evicting).
    def block(export: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        x = torch.randn(4, 16, requires_grad=True)
        h = model(x * 1.0)
        out = None
        if export:
            ep = torch.export.export(model, (torch.randn(4, 16),))
            out = ep.module()(x.detach())
        h.sum().backward()
        return out, model(x.detach()).detach(), x.grad

    with dtr.enable(engine=engine) as free:
        block(False)
    budget = free.stats().peak_resident_bytes
    with dtr.enable(engine=engine, budget=budget) as session:
        out, want, grad = block(True)
        got = dtr.materialize(out)
    assert session.stats().peak_resident_bytes <= budget
    assert torch.equal(got, want)
    assert torch.equal(grad, block(False)[2])


@pytest.mark.parametrize("stress", [False, True])
def test_record_stream_applies_to_the_value_and_is_not_a_write(core, stress):
    # t.record_stream(s) is CUDA-only (tests/accelerator/test_cuda.py runs it); its schema says it
    # writes t. Its handler, given a stand-in for the op: the resident value's memory is
    # recorded, an evicted value is left alone (not recomputed for it), and no new
    # version is made either way.
    from dtr.engines.subclass.tensor_args import TensorArgs
    from dtr.engines.subclass.runtime import _SPECIAL
    from dtr.schema import op_facts

    op = torch.ops.aten.record_stream.default
    facts = op_facts(op)
    seen = []
    with dtr.enable(stress=stress) as session:
        h = torch.randn(4, requires_grad=True).sin()  # managed (evicted at once in stress)
        node, ops = h._dtr_ref.node, session.stats().ops
        result = _SPECIAL[op](
            session._runtime,
            lambda v, s: seen.append((v, s)),
            facts,
            TensorArgs(facts, (h, 7), {}),
            True,
        )
        assert result is None and h._dtr_ref.node is node and session.stats().ops == ops
        if stress:
            assert seen == [] and node.value is None
        else:
            assert len(seen) == 1 and seen[0][0] is node.value and seen[0][1] == 7


def test_cudnn_rnn_hidden_writes():
    # What _cudnn_rnn and its backward write without a (a!) in their schemas (CUDA-only
    # kernels; tests/accelerator/test_cuda.py replays them): the dropout RNG state in training with
    # dropout (forward and backward), and the forward's reserve space in the backward.
    from dtr.schema import op_facts

    rnn = op_facts(torch.ops.aten._cudnn_rnn.default)
    vals = [None] * len(rnn.arg_names)
    vals[rnn.arg_index["dropout"]] = 0.1
    vals[rnn.arg_index["train"]] = True
    vals[rnn.arg_index["dropout_state"]] = torch.empty(0)
    assert rnn.hidden_writes(vals) == (rnn.arg_index["dropout_state"],)
    vals[rnn.arg_index["train"]] = False
    assert rnn.hidden_writes(vals) == ()
    vals[rnn.arg_index["train"]], vals[rnn.arg_index["dropout"]] = True, 0.0
    assert rnn.hidden_writes(vals) == ()
    back = op_facts(torch.ops.aten._cudnn_rnn_backward.default)
    vals = [None] * len(back.arg_names)
    vals[back.arg_index["reserve"]] = torch.empty(0)
    vals[back.arg_index["dropout"]] = 0.0
    assert back.hidden_writes(vals) == (back.arg_index["reserve"],)
    vals[back.arg_index["dropout"]] = 0.3
    vals[back.arg_index["train"]] = True
    vals[back.arg_index["dropout_state"]] = torch.empty(0)
    assert back.hidden_writes(vals) == (
        back.arg_index["dropout_state"],
        back.arg_index["reserve"],
    )


@pytest.fixture(scope="module")
def views_op():
    """A custom op returning four views of one fresh buffer, as cuDNN's RNN backward
    returns the weight gradients."""
    lib = torch.library.Library("dtr_views_test", "DEF")
    lib.define("quarters(Tensor x) -> Tensor[]")

    def quarters(x):
        buf = torch.empty(4 * x.numel(), dtype=x.dtype)
        out = [buf[i * x.numel() : (i + 1) * x.numel()].view_as(x) for i in range(4)]
        for i, o in enumerate(out):
            o.copy_(x * (i + 1))
        return out

    lib.impl("quarters", quarters, "CPU")
    yield torch.ops.dtr_views_test.quarters
    lib._destroy()


@pytest.mark.parametrize("fast", [True, False])
def test_outputs_that_are_views_of_one_fresh_buffer(fast, views_op, core, monkeypatch, tmp_path):
    # Counted once (one pool: evicted and recomputed together), not once per view, on
    # both cores and both paths; recorded in a trace that the simulator replays alike.
    monkeypatch.setattr(dtr.engines.subclass.runtime, "FAST_PATH", fast)

    def fn():
        w = torch.randn(64, 32, requires_grad=True)
        a, b, c, d = views_op((w * 2).detach())
        y = (a + b) * (c - d)
        return [y, a, d, y.sum()]

    stats = _check(fn, "cpu", **STRESS)
    assert stats.remats > 0
    with dtr.enable() as session:
        x = (torch.randn(64, 32, requires_grad=True) * 2).detach()
        before = session.stats().resident_bytes
        outs = views_op(x)
        assert session.stats().resident_bytes - before == 4 * x.untyped_storage().nbytes()
        del outs

    import dtr.sim as sim

    path = str(tmp_path / "views.jsonl")
    with dtr.enable(stress=True, cost_model="roofline", trace=path) as session:
        fn()
    live = session.stats()
    for core in ("c++", "python"):
        res = sim.simulate(sim.load(path), "dtr", stress=True, core=core, thrash=0)
        assert res.status == "ok"
        assert (res.evictions, res.remats) == (live.evictions, live.remats)

"""dtr on a CUDA device: what a CPU cannot show. Every test here is skipped, with the
reason, on a machine without one (the device-generic runtime tests run on CUDA too,
through ``tests.utils.DEVICES``: ``pytest tests/engines/subclass/test_runtime.py
tests/engines/test_models.py -k cuda``).

Comparisons with eager run under ``tests.utils.deterministic`` (deterministic kernels
where PyTorch has them) and are bitwise, unless PyTorch reported a kernel without a
deterministic implementation; then they are within a few ulps (``assert_matches``).

Covered: a bench model under a tight budget (same values, less memory really allocated),
a budget given as a percentage of the device's memory, a budget that counts the whole
device (``measure="allocator"``: the caching allocator's count, memory dtr does not
manage taken off the budget), RNG replay (Philox dropout, the
fused attention kernels, cuDNN's LSTM dropout) under stress mode, autocast in float16
and bfloat16, pinned memory and non_blocking copies, a side stream, ``record_stream`` of
a managed tensor, evicting when the
caching allocator itself runs out of memory (no budget), and the allocator's
fragmentation counters under a budget (printed; ``pytest -s`` shows them).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtr
import dtr.device
from tests.utils import assert_matches, deterministic, eager_and_dtr, mismatches, train

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
)

DEV = "cuda"
MiB = 2**20
STRESS = {"stress": True, "check": True}


def _check(fn, **kwargs):
    expected, got, stats, exact = eager_and_dtr(fn, DEV, **kwargs)
    assert len(got) == len(expected)
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert_matches(g, e, exact, f"value {i}")
    return stats


# ---------------------------------------------------------------- budgets and memory


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_bench_model_under_a_tight_budget_equals_eager_and_allocates_less(name):
    def allocated_peak(**kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        traj = train(name, optimizer="adam", device=DEV, **kwargs)
        torch.cuda.synchronize()
        return traj, torch.cuda.max_memory_allocated() - base

    with deterministic(DEV) as nondeterministic:
        train(name, optimizer="adam", device=DEV, steps=1)  # cuBLAS/cuDNN workspaces
        # Under dtr the autograd thread also reruns forward ops (an MLP's addmm, which
        # cuBLASLt serves), so it needs library workspaces of its own that eager's
        # backward never asked for: created here, outside the measured peaks.
        before = torch.cuda.memory_allocated()
        train(name, optimizer="adam", device=DEV, steps=1, dtr_kwargs={"stress": True})
        torch.cuda.synchronize()
        workspaces = torch.cuda.memory_allocated() - before
        expected, eager_peak = allocated_peak()
        free, _ = allocated_peak(dtr_kwargs={"cost_model": "roofline"})
        budget = int(free.stats.peak_resident_bytes * 0.3)
        got, dtr_peak = allocated_peak(dtr_kwargs={"budget": budget, "cost_model": "roofline"})
    print(
        f"\n{name} on {torch.cuda.get_device_name()}: dtr's peak P {free.stats.peak_resident_bytes}"
        f" B, budget {budget} B; allocator peak eager {eager_peak} B, under dtr {dtr_peak} B; "
        f"{got.stats.evictions} evictions, {got.stats.remats} remats; "
        f"kept by the dtr warm-up {workspaces} B; "
        f"nondeterministic kernels: {sorted(set(nondeterministic)) or 'none'}"
    )
    assert mismatches(expected, got, not nondeterministic) == []
    assert got.stats.peak_resident_bytes <= budget
    assert got.stats.evictions > 0 and got.stats.remats > 0
    # What the allocator really handed out: eviction frees device memory. (Not asserted
    # for the CNN: at this size cuDNN's transient convolution workspaces, of a size cuDNN
    # picks, can set the peak of both runs; the numbers are printed above.)
    if name != "cnn":
        assert dtr_peak < eager_peak


def test_percent_budget_resolves_against_device_memory():
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    assert dtr.device.total_memory_bytes() == (props.total_memory, f"cuda:{index} ({props.name})")
    with dtr.enable(budget="50%") as session:
        x = torch.randn(64, 64, device=DEV, requires_grad=True)
        (x * 2).tanh().sum().backward()
    budget = session.stats().budget_bytes
    assert budget == int(props.total_memory * 50.0 / 100)
    assert abs(budget - props.total_memory // 2) <= 1


def test_measure_allocator_reads_the_caching_allocator():
    index = torch.cuda.current_device()
    meter = dtr.device.allocator_meter()
    x = torch.empty(8 * MiB, dtype=torch.uint8, device=DEV)
    assert meter() == torch.cuda.memory_allocated(index)
    del x
    assert meter() == torch.cuda.memory_allocated(index)


def test_measure_allocator_holds_the_whole_device_to_the_budget():
    # measure="allocator": what the caching allocator holds beyond dtr's own count (a
    # 64 MiB tensor made outside the block, Adam's state, workspaces, rounding) comes off
    # the budget, which then bounds dtr's resident bytes more tightly; values as eager's.
    with deterministic(DEV) as nondeterministic:
        train("cnn", optimizer="adam", device=DEV, steps=1)  # cuBLAS/cuDNN workspaces
        train("cnn", optimizer="adam", device=DEV, steps=1, dtr_kwargs={"stress": True})
        expected = train("cnn", optimizer="adam", device=DEV)
        free = train("cnn", optimizer="adam", device=DEV, dtr_kwargs={"cost_model": "roofline"})
        peak = free.stats.peak_resident_bytes
        ballast = torch.empty(64 * MiB, dtype=torch.uint8, device=DEV)
        torch.cuda.synchronize()
        budget = torch.cuda.memory_allocated() + peak // 2
        options = {"budget": budget, "cost_model": "roofline", "measure": "allocator"}
        got = train("cnn", optimizer="adam", device=DEV, dtr_kwargs=options)
    print(
        f"\ncnn, measure='allocator': budget {budget} B, P {peak} B; unmanaged at the end "
        f"{got.stats.unmanaged_bytes} B, dtr's peak {got.stats.peak_resident_bytes} B, "
        f"{got.stats.evictions} evictions"
    )
    assert mismatches(expected, got, not nondeterministic) == []
    assert got.stats.unmanaged_bytes >= ballast.numel()
    assert got.stats.peak_resident_bytes <= budget - ballast.numel()
    assert got.stats.evictions > 0


def test_fragmentation_counters_under_a_budget():
    # The allocator's view of a budgeted run next to an eager run's (the heuristics
    # benchmark records the same columns per run): at half of dtr's peak the allocator's
    # own peak is below eager's, and evicting never made it retry an allocation.
    def counters(**kwargs):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
        traj = train("cnn", optimizer="adam", device=DEV, **kwargs)
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        return traj, {
            "inactive_split_bytes.all.current": after["inactive_split_bytes.all.current"],
            "inactive_split_bytes.all.peak": after["inactive_split_bytes.all.peak"],
            "num_alloc_retries": after["num_alloc_retries"] - before.get("num_alloc_retries", 0),
            "allocated_bytes.all.peak": after["allocated_bytes.all.peak"],
            "reserved_bytes.all.peak": after["reserved_bytes.all.peak"],
        }

    _, eager = counters()
    free, _ = counters(dtr_kwargs={"cost_model": "roofline"})
    budget = int(free.stats.peak_resident_bytes * 0.5)
    got, under = counters(dtr_kwargs={"budget": budget, "cost_model": "roofline"})
    print(f"\ncnn eager:          {eager}\ncnn dtr at 50% of P: {under}")
    for values in (eager, under):
        for key, value in values.items():
            assert isinstance(value, int) and value >= 0, key
    assert got.stats.evictions > 0
    assert under["allocated_bytes.all.peak"] < eager["allocated_bytes.all.peak"]
    assert under["num_alloc_retries"] == 0


# ---------------------------------------------------------------- random numbers


def test_dropout_philox_replay_is_bitwise_under_stress():
    # CUDA's generator is Philox: a seed and an offset that each launch advances. A
    # recomputation must restore both, draw the same mask, and leave the offset where
    # eager left it.
    def fn():
        x = torch.randn(256, 128, device=DEV, requires_grad=True)
        a = F.dropout(x, 0.5, training=True)
        b = F.dropout(torch.tanh(a) * 2, 0.3, training=True)
        c = F.dropout(b + torch.randn_like(b), 0.1, training=True)
        y = c.pow(2).sum()
        y.backward()
        after = torch.rand(5, device=DEV)
        return [y.detach(), x.grad, after, torch.cuda.get_rng_state()]

    stats = _check(fn, **STRESS)
    assert stats.remats > 0


@pytest.mark.parametrize("kind", ["sdpa", "lstm"])
def test_fused_kernels_with_dropout_replay_under_stress(kind):
    # sdpa: the fused attention kernels (flash / memory-efficient) draw their dropout
    # from the Philox generator inside the kernel and return its seed and offset.
    # lstm: cuDNN's RNN dropout uses a state buffer of its own (cached by PyTorch and
    # passed to _cudnn_rnn), not the generator: if the kernel advances it, a
    # recomputation would draw another mask unless dtr keeps that state too.
    def fn():
        if kind == "sdpa":
            q, k, v = (torch.randn(2, 4, 64, 32, device=DEV, requires_grad=True) for _ in range(3))
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
            leaves = [q, k, v]
        else:
            lstm = nn.LSTM(32, 32, num_layers=3, dropout=0.3, batch_first=True).to(DEV)
            x = torch.randn(4, 12, 32, device=DEV, requires_grad=True)
            out, _ = lstm(x)
            leaves = [x, *lstm.parameters()]
        loss = (out * out).mean()
        loss.backward()
        return [loss.detach(), out.detach(), *(t.grad for t in leaves)]

    stats = _check(fn, **STRESS)
    assert stats.remats > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_autocast_matches_eager(dtype):
    if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")

    def fn():
        torch.manual_seed(1)
        model = nn.Sequential(
            nn.Linear(64, 128),
            nn.GELU(),
            nn.LayerNorm(128),
            nn.Dropout(0.1),
            nn.Linear(128, 128),
            nn.Tanh(),
            nn.Linear(128, 10),
        ).to(DEV)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        for _ in range(2):
            x = torch.randn(32, 64, device=DEV)
            y = torch.randint(0, 10, (32,), device=DEV)
            with torch.autocast(DEV, dtype=dtype):
                logits = model(x)  # the casts of the weights are ops dtr records too
                loss = F.cross_entropy(logits, y)
            assert logits.dtype == dtype
            loss.backward()
            out += [loss.detach(), logits.detach(), *(p.grad.clone() for p in model.parameters())]
            opt.step()
            opt.zero_grad()
        return out + [p.detach().clone() for p in model.parameters()]

    stats = _check(fn, **STRESS)
    assert stats.remats > 0


# ---------------------------------------------------------------- copies and streams


def test_pinned_memory_and_non_blocking_copies_of_managed_tensors():
    n = 2048

    def fn():
        x = (torch.randn(n, n, device=DEV) / n**0.5).requires_grad_()
        h = x
        for _ in range(4):  # GPU work that a recomputation of `host` must queue again
            h = torch.tanh(h @ x)
        host = h.to("cpu", non_blocking=True)  # into pinned memory, asynchronously
        torch.cuda.synchronize()  # as eager code must, before reading it on the CPU
        # Take the pinned block that copy wrote (free again once stress mode evicts
        # host), so that a recomputed copy lands elsewhere: a recomputation read before
        # its copy ended would show other bytes, not the right ones by luck.
        junk = dtr.materialize(torch.full((n, n), float("nan")).pin_memory())
        host_sum = host.sum()  # a CPU op on host: under stress, recomputes it first
        c = torch.randn(n, n) * 2  # a managed CPU tensor
        pinned = c.pin_memory()
        assert pinned.is_pinned()
        back = pinned.to(DEV, non_blocking=True)  # host to device, from pinned memory
        loss = (h * back).mean() + host_sum.to(DEV) / n**2
        loss.backward()
        torch.cuda.synchronize()
        del junk
        return [loss.detach(), host_sum, x.grad, host, back]

    stats = _check(fn, **STRESS)
    assert stats.remats > 0


def test_side_stream_producer_and_default_stream_consumer_under_a_tight_budget():
    side = torch.cuda.Stream()

    def fn():
        ws = [(torch.randn(256, 256, device=DEV) / 16).requires_grad_() for _ in range(8)]
        x = torch.randn(4096, 256, device=DEV)  # activations of 4 MiB
        side.wait_stream(torch.cuda.current_stream())  # x and ws are ready for side
        with torch.cuda.stream(side):
            h = x
            for w in ws[:4]:
                h = torch.tanh(h @ w)
        torch.cuda.current_stream().wait_stream(side)  # h is ready on the default stream
        for w in ws[4:]:
            h = torch.tanh(h @ w)
        loss = h.pow(2).mean()
        loss.backward()
        torch.cuda.synchronize()
        return [loss.detach(), *(w.grad for w in ws)]

    with deterministic(DEV):
        torch.manual_seed(0)
        with dtr.enable(cost_model="roofline") as session:
            fn()
        torch.cuda.synchronize()
    budget = int(session.stats().peak_resident_bytes * 0.5)
    stats = _check(fn, budget=budget, cost_model="roofline")
    assert stats.evictions > 0 and stats.remats > 0
    assert stats.peak_resident_bytes <= budget


def test_record_stream_on_a_managed_tensor_is_not_a_write():
    # The program tells the allocator that a side stream used a managed tensor: dtr
    # passes that on for the value's memory and makes no new version (the schema says
    # record_stream writes its tensor).
    side = torch.cuda.Stream()
    x = torch.randn(512, 512, device=DEV, requires_grad=True)
    with dtr.enable(cost_model="roofline") as session:
        h = torch.tanh(x * 2)
        node, ops = h._dtr_ref.node, session.stats().ops
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = h * 3
        h.record_stream(side)
        assert h._dtr_ref.node is node and session.stats().ops == ops + 1  # y's op only
        torch.cuda.current_stream().wait_stream(side)
        got = dtr.materialize(y).clone()
    assert torch.equal(got, torch.tanh(x.detach() * 2) * 3)


# ---------------------------------------------------------------- allocator OOM


def test_allocator_oom_without_a_budget_evicts_and_retries():
    # A device fuller than dtr's count says: no budget at all, and a filler allocation
    # that leaves room for 8 of the chain's 16 saved activations. The caching allocator
    # raises torch.OutOfMemoryError ("Tried to allocate 32.00 MiB"); dtr must evict,
    # rerun the op, and end bitwise equal to eager (tanh, mul and sum are deterministic).
    rows, cols, depth = 2048, 4096, 16  # 32 MiB per activation

    def step(x):
        h = x
        for _ in range(depth):
            h = torch.tanh(h * 1.01)  # tanh saves its output: depth x 32 MiB in eager
        loss = h.sum()
        loss.backward()
        return loss

    x = torch.randn(rows, cols, device=DEV, requires_grad=True)
    loss0 = step(x).detach()  # eager, before the device is filled (loads the kernels too)
    grad0, x.grad = x.grad, None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    room = 8 * rows * cols * 4
    assert free > room + 64 * MiB, "the GPU is already nearly full"
    filler = torch.empty(free - room, dtype=torch.uint8, device=DEV)
    try:
        with dtr.enable() as session:
            loss = step(x)
        torch.cuda.synchronize()
        retries = torch.cuda.memory_stats()["num_alloc_retries"]
    finally:  # compare only once the device has room again (kernels load lazily)
        del filler
        torch.cuda.empty_cache()
    stats = session.stats()
    print(
        f"\nOOM retry: {stats.oom_retries} retries, {stats.evictions} evictions, "
        f"{stats.remats} remats; the allocator's num_alloc_retries {retries}"
    )
    assert stats.budget_bytes is None
    assert stats.oom_retries > 0 and stats.evictions > 0 and stats.remats > 0
    assert torch.equal(dtr.materialize(loss), loss0)
    assert type(x.grad) is torch.Tensor and torch.equal(x.grad, grad0)


def test_vs_static_measures_on_the_gpu():
    # bench.vs_static --device cuda: the allocator's peak over a step, the same measure
    # as bench.common.eager_peak_bytes on CUDA; dtr at 60% of it really stays below it
    # and a budget nothing fits in is a row, not a crash.
    from bench import vs_static
    from bench.common import eager_peak_bytes
    from bench.models import MODELS

    def plain(model):
        return lambda batch: MODELS["transformer"].loss(model, batch)

    eager = vs_static.measure("transformer", 1, 2, 1, plain, device="cuda")
    assert eager["status"] == "ok" and eager["step_s"] > 0
    assert eager["peak"] == pytest.approx(
        eager_peak_bytes("transformer", 1, device="cuda"), rel=0.02
    )
    budget = int(0.6 * eager["peak"])
    under = vs_static.measure("transformer", 1, 2, 1, plain, {"budget": budget}, device="cuda")
    assert under["status"] == "ok" and under["stats"].evictions > 0
    assert under["peak"] < eager["peak"]
    tiny = vs_static.measure("transformer", 1, 1, 0, plain, {"budget": 1000}, device="cuda")
    assert tiny["status"] == "infeasible"

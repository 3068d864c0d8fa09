"""dtr on the emulated accelerator (tests/emulated_device.py, csrc/emulated/): the
device-generic paths a CPU run never takes, without a GPU. The emu device is PyTorch's
PrivateUse1 backend with host memory from a capped, counting allocator and its own
generator; its ops run the CPU kernels, so every comparison with eager is bitwise.

First the device itself (counters, the cap, generators, copies, aliasing), then the
subclass engine on it: bench models under stress and under budgets, dropout replay,
evicting when the allocator runs out of memory (no budget), measure="allocator" and a
percentage budget read from the device module. The native engine on emu has a file of
its own (test_native_on_emu.py)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

import dtr
import dtr.device
import dtr.engines.subclass.rng as rng
from bench.models import MODELS, batches, build
from tests import emulated_device
from tests.utils import assert_bitwise, mismatches, to_device, train

try:
    emu = emulated_device.load()
except ImportError as exc:  # the extension is built by setup.py
    pytest.skip(
        f"dtr._emulated is not built (python setup.py build_ext --inplace): {exc}",
        allow_module_level=True,
    )

DEV = "emu"
ROOFLINE = {"engine": "subclass", "cost_model": "roofline"}


@pytest.fixture(autouse=True)
def _emu_attached():
    """The emu device is the machine's accelerator for each test here, with no cap."""
    with emulated_device.attached(), emu.memory_cap(None):
        yield


# ------------------------------------------------------------------ the device itself


def test_the_emu_device_is_the_accelerator_only_while_attached():
    # the other tests of the process see a machine without an accelerator
    assert torch.accelerator.is_available()
    assert dtr.device.accelerator() == torch.device("emu", 0)
    emulated_device._attached[0] = False
    try:
        assert not torch.accelerator.is_available()
        assert dtr.device.accelerator() is None
    finally:
        emulated_device._attached[0] = True


def test_allocator_counts_allocated_and_peak_bytes():
    base = emu.memory_allocated()
    emu.reset_peak_memory_stats()
    x = torch.empty(1000, dtype=torch.float32, device=DEV)
    assert x.device == torch.device("emu", 0)
    assert emu.memory_allocated() == base + 4000
    y = torch.empty(250, dtype=torch.float64, device=DEV)
    assert emu.memory_allocated() == base + 6000
    del x, y
    assert emu.memory_allocated() == base
    assert emu.max_memory_allocated() == base + 6000
    emu.reset_peak_memory_stats()
    assert emu.max_memory_allocated() == base
    # a fresh op result is emu memory too
    z = torch.ones(10, device=DEV)
    w = z + 1
    assert emu.memory_allocated() == base + 40 + 40 and w.device.type == DEV


def test_allocator_raises_out_of_memory_past_its_cap():
    base = emu.memory_allocated()
    with emu.memory_cap(base + 4096):
        x = torch.empty(1024, device=DEV)  # exactly at the cap
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 4 bytes"):
            torch.empty(1, device=DEV)
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 4096 bytes"):
            x * 2  # an op's result, allocated by the fallback
        assert emu.memory_allocated() == base + 4096  # refused allocations count nothing
        del x
        assert (torch.ones(8, device=DEV) * 2).sum().item() == 16
    assert emu.memory_allocated() == base


def test_generator_is_the_devices_own_and_reproducible():
    cpu_state = torch.get_rng_state()
    emu.manual_seed(5)
    a = torch.rand(16, device=DEV)
    mask = F.dropout(torch.ones(16, device=DEV), 0.5)  # native_dropout: no generator argument
    assert torch.equal(torch.get_rng_state(), cpu_state), "emu draws moved the CPU generator"
    emu.manual_seed(5)
    assert torch.equal(torch.rand(16, device=DEV), a)
    assert torch.equal(F.dropout(torch.ones(16, device=DEV), 0.5), mask)
    # torch.manual_seed seeds every device's generator, emu's included
    torch.manual_seed(5)
    assert torch.equal(torch.rand(16, device=DEV), a)
    state = emu.get_rng_state()
    b = torch.randn(16, device=DEV)
    emu.set_rng_state(state)
    assert torch.equal(torch.randn(16, device=DEV), b)
    # a generator made for the device draws the same stream from the same seed
    gen = torch.Generator(device=DEV)
    assert gen.device == torch.device("emu", 0)
    gen.manual_seed(5)
    assert torch.equal(torch.rand(16, device=DEV, generator=gen), a)
    assert rng.default_generator(torch.device(DEV)) is emu.default_generators[0]


def test_copies_between_cpu_and_emu_are_exact():
    x = torch.randn(6, 5, dtype=torch.float64)
    e = x.to(DEV)
    assert e.device.type == DEV and torch.equal(e.cpu(), x)
    t = e.t()  # a view: the same emu memory
    assert t.data_ptr() == e.data_ptr() and torch.equal(t.cpu(), x.t())
    assert torch.equal(t.contiguous().cpu(), x.t().contiguous())
    c = torch.empty(5, 6, dtype=torch.float64).copy_(t)  # emu -> cpu, strided
    assert torch.equal(c, x.t())
    back = torch.zeros(5, 6, dtype=torch.float64, device=DEV)
    back.copy_(x.t())  # cpu -> emu
    assert torch.equal(back.cpu(), x.t())
    assert e[2, 3].item() == x[2, 3].item()


def test_in_place_out_and_views_keep_their_emu_identity():
    x = torch.arange(12.0, device=DEV).view(3, 4)
    same = x.add_(1)
    assert same is x and torch.equal(x.cpu(), torch.arange(1.0, 13.0).view(3, 4))
    row = x.select(0, 1)
    row.mul_(10)  # writes through the view into x's memory
    assert x[1, 0].item() == 50.0 and row.data_ptr() == x.data_ptr() + 16
    out = torch.empty(0, device=DEV)
    res = torch.mul(x, 2, out=out)  # out= of the wrong size: resized, in emu memory
    assert res is out and out.shape == (3, 4) and out.device.type == DEV
    assert torch.equal(out.cpu(), x.cpu() * 2)
    parts = torch.split(x, 2, dim=1)
    assert all(p.data_ptr() == x.data_ptr() + 8 * i for i, p in enumerate(parts))


# ------------------------------------------------------- the subclass engine on emu

MODEL_NAMES = ["mlp", "cnn", "transformer"]
STEPS = 2
# The tightest budget, in percent of the unbudgeted peak, each model trains in (the CNN's
# batch-norm backward needs most of its activations at once).
TIGHT = {"mlp": 30, "cnn": 40, "transformer": 30}


@functools.cache
def _eager(name: str):
    return train(name, steps=STEPS, device=DEV)


@functools.cache
def _unbudgeted_peak(name: str) -> int:
    return train(name, steps=STEPS, device=DEV, dtr_kwargs=ROOFLINE).stats.peak_resident_bytes


@pytest.mark.parametrize("mode", ["stress", "half", "tight"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_bench_model_on_emu_equals_eager_bitwise(name, mode):
    # losses, every gradient of every step, and parameters after two optimizer steps
    if mode == "stress":
        options = {**ROOFLINE, "stress": True}
    else:
        percent = 50 if mode == "half" else TIGHT[name]
        options = {**ROOFLINE, "budget": _unbudgeted_peak(name) * percent // 100}
    got = train(name, steps=STEPS, device=DEV, dtr_kwargs=options)
    assert got.params[0].device.type == DEV
    assert mismatches(_eager(name), got) == []
    assert got.stats.evictions > 0 and got.stats.remats > 0


def test_lstm_on_emu_needs_a_fused_cell_kernel():
    # nn.LSTM on a device other than the CPU calls _thnn_fused_lstm_cell, a CUDA-only
    # kernel the emulated device does not provide: the bench LSTM does not run there.
    with pytest.raises(NotImplementedError, match="_thnn_fused_lstm_cell"):
        train("lstm", steps=1, device=DEV)


def _dropout_chain(x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    h = x
    for _ in range(6):
        h = F.dropout(torch.tanh(h) * 1.5, 0.3)
    h.sum().backward()
    return [h.detach(), x.grad]


def test_dropout_replays_bitwise_under_stress():
    x = torch.randn(16, 16).to(DEV)
    torch.manual_seed(0)
    expected = _dropout_chain(x)
    after_eager = emu.get_rng_state()
    torch.manual_seed(0)
    with dtr.enable(**ROOFLINE, stress=True) as session:
        got = [dtr.materialize(t) for t in _dropout_chain(x)]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_bitwise(g, e, f"value {i}")
    assert session.stats().remats > 0
    # recomputing a dropout never shifts the stream the program sees
    assert torch.equal(emu.get_rng_state(), after_eager)


def _absolute_peak(fn) -> tuple[object, int]:
    emu.reset_peak_memory_stats()
    out = fn()
    return out, emu.max_memory_allocated()


def test_allocator_out_of_memory_without_a_budget_evicts_and_retries():
    # A cap below eager's peak but above what dtr needs under a budget: eager runs out of
    # memory, dtr (no budget) evicts when the allocator raises and trains as eager did.
    name = "mlp"
    expected, eager_peak = _absolute_peak(lambda: train(name, steps=STEPS, device=DEV))
    budget = _unbudgeted_peak(name) // 2
    _, budgeted_peak = _absolute_peak(
        lambda: train(name, steps=STEPS, device=DEV, dtr_kwargs={**ROOFLINE, "budget": budget})
    )
    assert budgeted_peak < eager_peak
    cap = (eager_peak + budgeted_peak) // 2
    with emu.memory_cap(cap):
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            train(name, steps=STEPS, device=DEV)
        got, peak = _absolute_peak(
            lambda: train(name, steps=STEPS, device=DEV, dtr_kwargs=ROOFLINE)
        )
    assert mismatches(expected, got) == []
    assert peak <= cap
    assert got.stats.oom_retries > 0 and got.stats.evictions > 0 and got.stats.remats > 0


def _own_loop(name: str, steps: int = STEPS, **dtr_kwargs):
    """Two SGD steps of bench model `name` on emu, keeping nothing between them but the
    losses (no copies of the gradients, which would be memory dtr never sees an op
    for): (losses, last gradients, parameters, allocator peak, session)."""
    spec = MODELS[name]
    model = build(name, 0).to(DEV)
    data = [to_device(b, DEV) for b in batches(name, steps, 1)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)
    losses = []
    emu.reset_peak_memory_stats()
    ctx = dtr.enable(**dtr_kwargs) if dtr_kwargs else contextlib.nullcontext()
    with ctx as session:
        for i, batch in enumerate(data):
            if i:
                opt.zero_grad()
            loss = spec.loss(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        losses = [dtr.materialize(t) for t in losses] if dtr_kwargs else losses
    params = list(model.parameters())
    grads = [p.grad for p in params]
    return losses, grads, [p.detach() for p in params], emu.max_memory_allocated(), session


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_measure_allocator_holds_the_emu_allocators_peak_to_the_budget(name):
    meter = dtr.device.allocator_meter()
    x = torch.empty(4096, dtype=torch.uint8, device=DEV)
    assert meter() == emu.memory_allocated()
    del x
    base = emu.memory_allocated()  # what earlier tests left on the device
    expected = _own_loop(name)
    budget = base + int((expected[3] - base) * 0.7)
    got = _own_loop(name, **ROOFLINE, budget=budget, measure="allocator")
    for kind in range(3):
        for i, (g, e) in enumerate(zip(got[kind], expected[kind], strict=True)):
            assert_bitwise(g, e, f"{['loss', 'grad', 'param'][kind]} {i}")
    stats = got[4].stats()
    assert stats.evictions > 0 and stats.unmanaged_bytes > 0
    # The allocator's real peak: under eager's, and over the budget by at most what an op
    # allocates beyond the outputs dtr counts before running it (its temporaries).
    assert got[3] < expected[3]
    assert got[3] <= budget * 1.03


def test_percent_budget_is_a_share_of_the_emu_devices_memory():
    with emu.memory_cap(64 * 2**20):
        assert dtr.device.total_memory_bytes() == (64 * 2**20, "emu:0")
        with dtr.enable(engine="subclass", budget="50%") as session:
            x = torch.randn(64, 64, device=DEV, requires_grad=True)
            (x * 2).tanh().sum().backward()
    assert session.stats().budget_bytes == 32 * 2**20


def test_the_native_engine_serves_emu_tensors():
    # the native engine holds values on the emu device too (test_native_on_emu.py trains
    # the bench models with it)
    x = torch.randn(4, 4, device=DEV, requires_grad=True)
    (x * 2).tanh().sum().backward()
    expected = x.grad
    x.grad = None
    with dtr.enable(engine="native", stress=True) as session:
        y = (x * 2).tanh()
        assert y.device == torch.device("emu", 0)
        y.sum().backward()
    assert session.stats().remats > 0
    assert_bitwise(x.grad, expected, "x.grad")

"""The native engine on the emulated accelerator (tests/emulated_device.py): managed
tensors hold emu values and report emu as their device; eviction frees emu memory and
recomputation makes it again, random ops replay from the emu generator, and an op the
emu allocator cannot serve is run again after dtr evicts. Every comparison is with eager
on emu, bitwise."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import dtr
from tests import emulated_device
from tests.utils import _native_managed, assert_bitwise, mismatches, train

try:
    emu = emulated_device.load()
except ImportError as exc:  # the extension is built by setup.py
    pytest.skip(
        f"dtr._emulated is not built (python setup.py build_ext --inplace): {exc}",
        allow_module_level=True,
    )

DEV = "emu"
NATIVE = {"engine": "native", "cost_model": "roofline"}
STEPS = 2
MODEL_NAMES = ["mlp", "cnn", "transformer"]
# The tightest budget, in percent of the unbudgeted peak, each model trains in (the CNN's
# batch-norm backward needs most of its activations at once).
TIGHT = {"mlp": 30, "cnn": 40, "transformer": 30}


@pytest.fixture(autouse=True)
def _emu_attached():
    """The emu device is the machine's accelerator for each test here, with no cap."""
    with emulated_device.attached(), emu.memory_cap(None):
        yield


@functools.cache
def _eager(name: str):
    return train(name, steps=STEPS, device=DEV)


@functools.cache
def _unbudgeted_peak(name: str) -> int:
    return train(name, steps=STEPS, device=DEV, dtr_kwargs=NATIVE).stats.peak_resident_bytes


@pytest.mark.parametrize("mode", ["stress", "half", "tight"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_bench_model_on_emu_with_the_native_engine_equals_eager_bitwise(name, mode):
    # losses, every gradient of every step, and parameters after two optimizer steps
    if mode == "stress":
        options = {**NATIVE, "stress": True}
    else:
        percent = 50 if mode == "half" else TIGHT[name]
        options = {**NATIVE, "budget": _unbudgeted_peak(name) * percent // 100}
    got = train(name, steps=STEPS, device=DEV, dtr_kwargs=options)
    assert got.params[0].device.type == DEV
    assert mismatches(_eager(name), got) == []
    assert got.stats.evictions > 0 and got.stats.remats > 0


def _tanh_chain(x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    z = (x * 2).tanh() * 3
    z.sum().backward()
    return [z.detach(), x.grad]


def test_a_managed_tensor_reports_its_values_device_and_frees_its_memory():
    x = torch.randn(256, 256, device=DEV)
    expected = _tanh_chain(x)
    with dtr.enable(**NATIVE, stress=True) as session:
        h = x.requires_grad_()
        base = emu.memory_allocated()
        y = (h * 2).tanh()
        assert y.device == torch.device("emu", 0) and _native_managed(y)
        # evicted after the op (stress): its 256 KiB are back to the emu allocator
        assert emu.memory_allocated() == base
        x.requires_grad_(False)
        got = [dtr.materialize(t) for t in _tanh_chain(x)]  # recomputes on emu
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.device.type == DEV
        assert_bitwise(g, e, f"value {i}")
    assert session.stats().evictions > 0 and session.stats().remats > 0


def _dropout_chain(x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    h = x
    for _ in range(6):
        h = F.dropout(torch.tanh(h) * 1.5, 0.3)
    h.sum().backward()
    return [h.detach(), x.grad]


def test_dropout_on_emu_replays_from_the_emu_generator_bitwise_under_stress():
    x = torch.randn(16, 16).to(DEV)
    torch.manual_seed(0)
    expected = _dropout_chain(x)
    after_eager = emu.get_rng_state()
    cpu_after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    with dtr.enable(**NATIVE, stress=True) as session:
        got = [dtr.materialize(t) for t in _dropout_chain(x)]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_bitwise(g, e, f"value {i}")
    assert session.stats().remats > 0
    # recomputing a dropout never shifts the stream the program sees, on either device
    assert torch.equal(emu.get_rng_state(), after_eager)
    assert torch.equal(torch.get_rng_state(), cpu_after_eager)


def _reads_and_copies(x: torch.Tensor):
    h = (x.detach().requires_grad_() * 2).tanh()
    item = h[1, 2].item()
    on_cpu = h.cpu()
    back = (on_cpu * 3).to(DEV)
    zeros = torch.zeros(4, 4, device=DEV)
    out = (back + h).sum(0) + zeros.sum()
    printed = str(h[0, :3].detach())
    return item, on_cpu.detach(), back.detach(), out.detach(), printed


def test_item_copies_between_devices_and_factories_inside_the_block():
    x = torch.randn(4, 4, device=DEV)
    expected = _reads_and_copies(x)
    with dtr.enable(**NATIVE, stress=True) as session:
        got = _reads_and_copies(x)
        assert got[1].device.type == "cpu" and got[2].device.type == DEV
        got = (got[0], *[dtr.materialize(t) for t in got[1:4]], got[4])
    assert got[0] == expected[0]
    for i in range(1, 4):
        assert got[i].device == expected[i].device
        assert_bitwise(got[i], expected[i], f"value {i}")
    assert got[4] == expected[4]
    assert session.stats().remats > 0


def _absolute_peak(fn) -> tuple[object, int]:
    emu.reset_peak_memory_stats()
    out = fn()
    return out, emu.max_memory_allocated()


def test_allocator_out_of_memory_without_a_budget_evicts_and_retries():
    # A cap below eager's peak but above what dtr needs under a budget: eager runs out of
    # memory, the native engine (no budget) evicts when the allocator raises and trains as
    # eager did.
    name = "mlp"
    expected, eager_peak = _absolute_peak(lambda: train(name, steps=STEPS, device=DEV))
    budget = _unbudgeted_peak(name) // 2
    _, budgeted_peak = _absolute_peak(
        lambda: train(name, steps=STEPS, device=DEV, dtr_kwargs={**NATIVE, "budget": budget})
    )
    assert budgeted_peak < eager_peak
    cap = (eager_peak + budgeted_peak) // 2
    with emu.memory_cap(cap):
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            train(name, steps=STEPS, device=DEV)
        got, peak = _absolute_peak(lambda: train(name, steps=STEPS, device=DEV, dtr_kwargs=NATIVE))
    assert mismatches(expected, got) == []
    assert peak <= cap
    assert got.stats.oom_retries > 0 and got.stats.evictions > 0 and got.stats.remats > 0


def test_out_of_memory_with_nothing_to_evict_is_a_budget_error():
    x = torch.randn(64, 64, device=DEV, requires_grad=True)
    with emu.memory_cap(emu.memory_allocated() + 4 * 64 * 64):
        with pytest.raises(dtr.BudgetError, match=r"^dtr: the allocator ran out of memory"):
            with dtr.enable(**NATIVE):
                (x * 2).sum()

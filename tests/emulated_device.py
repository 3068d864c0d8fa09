"""The emulated accelerator of the tests: PyTorch's PrivateUse1 backend named ``emu``,
served by dtr._emulated (csrc/emulated/). Its memory is host memory from a capped,
counting allocator (torch.OutOfMemoryError past the cap, as a device allocator raises),
it has its own generator, and every op runs the CPU kernel on the emu tensors' memory.

``load()`` registers it once per process and returns ``torch.emu``, the device module
(the functions torch.cuda offers that dtr and the tests use), or raises ImportError when
the extension is not built (``python setup.py build_ext --inplace``).

Its tensors work once it is loaded, but it reports itself available
(``torch.emu.is_available()``, hence ``torch.accelerator``) only inside ``attached()``:
the other tests of the same process must still see a machine without an accelerator,
since dtr reads from it which engine ``engine="auto"`` picks and which device a
percentage budget or ``measure="allocator"`` refers to."""

from __future__ import annotations

import contextlib
import os
import types

import torch

NAME = "emu"
_attached = [False]


@contextlib.contextmanager
def attached():
    """The emu device is the machine's available accelerator inside the block."""
    before = _attached[0]
    _attached[0] = True
    try:
        yield
    finally:
        _attached[0] = before


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _module(ext) -> types.ModuleType:
    def index_of(device=None) -> int:
        if device is None:
            return ext.current_device()
        device = torch.device(NAME, device) if isinstance(device, int) else torch.device(device)
        return device.index if device.index is not None else ext.current_device()

    def default_generator(device=None) -> torch.Generator:
        return ext.default_generator(index_of(device))

    def manual_seed(seed: int) -> None:
        default_generator().manual_seed(int(seed))

    def manual_seed_all(seed: int) -> None:
        for index in range(ext.device_count()):
            ext.default_generator(index).manual_seed(int(seed))

    @contextlib.contextmanager
    def memory_cap(cap: int | None, device=None):
        """The allocator refuses allocations past ``cap`` bytes inside the block."""
        index = index_of(device)
        before = ext.memory_cap(index)
        ext.set_memory_cap(index, -1 if cap is None else int(cap))
        try:
            yield
        finally:
            ext.set_memory_cap(index, before)

    def mem_get_info(device=None) -> tuple[int, int]:
        """(free, total) bytes: the cap is the device's size when one is set."""
        index = index_of(device)
        cap = ext.memory_cap(index)
        total = cap if cap >= 0 else _host_memory()
        return max(total - ext.memory_allocated(index), 0), total

    module = types.ModuleType(f"torch.{NAME}")
    module.__dict__.update(
        is_available=lambda: _attached[0],
        is_initialized=lambda: True,
        _is_in_bad_fork=lambda: False,
        device_count=ext.device_count,
        current_device=ext.current_device,
        set_device=lambda device: ext.set_device(index_of(device)),
        synchronize=lambda device=None: None,
        memory_allocated=lambda device=None: ext.memory_allocated(index_of(device)),
        max_memory_allocated=lambda device=None: ext.max_memory_allocated(index_of(device)),
        reset_peak_memory_stats=lambda device=None: ext.reset_peak_memory_stats(
            index_of(device)
        ),
        set_memory_cap=lambda cap, device=None: ext.set_memory_cap(
            index_of(device), -1 if cap is None else int(cap)
        ),
        memory_cap=memory_cap,
        mem_get_info=mem_get_info,
        default_generators=tuple(ext.default_generator(i) for i in range(ext.device_count())),
        manual_seed=manual_seed,
        manual_seed_all=manual_seed_all,
        seed=lambda: default_generator().seed(),
        initial_seed=lambda: default_generator().initial_seed(),
        get_rng_state=lambda device=None: default_generator(device).get_state(),
        set_rng_state=lambda state, device=None: default_generator(device).set_state(state),
        get_amp_supported_dtype=lambda: [torch.float16, torch.bfloat16],
    )
    return module


def load() -> types.ModuleType:
    existing = getattr(torch, NAME, None)
    if existing is not None:
        return existing
    from dtr import _emulated  # noqa: PLC0415 - the extension, loaded only here

    torch.utils.rename_privateuse1_backend(NAME)
    torch._register_device_module(NAME, _module(_emulated))
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    return getattr(torch, NAME)

"""What the device offers: total memory, for budgets given as a percentage ("80%"), and
what its allocator has handed out, for budgets that count the whole device
(measure="allocator").

The device is the current one of the machine's accelerator (``torch.accelerator``: CUDA,
or a PrivateUse1 backend) when one is available, read through its device module
(``torch.cuda``, ``torch.<backend>``)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from .errors import ConfigError


def accelerator() -> torch.device | None:
    """The current device of the available accelerator, None on a machine without one."""
    api = getattr(torch, "accelerator", None)
    if api is not None:
        try:
            found = api.current_accelerator(check_available=True)
        except RuntimeError:  # a PrivateUse1 backend renamed, without a device module yet
            found = None
        if found is not None:
            return torch.device(found.type, api.current_device_index())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def total_memory_bytes() -> tuple[int, str]:
    """Total memory of the device dtr budgets for, and its name: the accelerator's current
    device when there is one (dtr exists for them), else this machine's physical memory."""
    device = accelerator()
    if device is not None:
        module = torch.get_device_module(device.type)
        if hasattr(module, "get_device_properties"):
            props = module.get_device_properties(device.index)
            return int(props.total_memory), f"{device} ({props.name})"
        if hasattr(module, "mem_get_info"):
            return int(module.mem_get_info(device.index)[1]), str(device)
        raise ValueError(
            f"cannot read the memory size of {device} for a percentage (torch.{device.type} "
            "has neither get_device_properties nor mem_get_info); give bytes"
        )
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
    except (ValueError, OSError, AttributeError):  # not POSIX: no portable answer
        raise ValueError(
            "cannot read this machine's memory size for a percentage; give bytes"
        ) from None


def allocator_meter() -> Callable[[], int]:
    """measure="allocator": a function returning the bytes the accelerator's allocator has
    handed out on its current device, everything allocated there (managed or not, with
    the allocator's rounding): ``torch.<device>.memory_allocated``. On CUDA it is read in
    C++ (dtr._C.cuda_allocated_bytes: one copy of the caching allocator's counters, no
    stats dictionary) when the extension is built."""
    device = accelerator()
    if device is None:
        raise ConfigError(
            "dtr: measure='allocator' holds the budget to what an accelerator's allocator "
            "has allocated, and this machine has no CUDA device nor other accelerator (the "
            "CPU allocator keeps no count); use measure='dtr', dtr's own count of the "
            "tensors it manages"
        )
    if device.type == "cuda":
        try:
            from ._C import cuda_allocated_bytes
        except ImportError:  # the pure-Python build
            pass
        else:
            return functools.partial(cuda_allocated_bytes, device.index)
    module = torch.get_device_module(device.type)
    if not hasattr(module, "memory_allocated"):
        raise ConfigError(
            f"dtr: measure='allocator' reads torch.{device.type}.memory_allocated, which "
            f"the {device.type} backend does not offer; use measure='dtr', dtr's own count "
            "of the tensors it manages"
        )
    return functools.partial(module.memory_allocated, device.index)

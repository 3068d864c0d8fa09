"""What the device offers: total memory, for budgets given as a percentage ("80%"), and
what its allocator has handed out, for budgets that count the whole device
(measure="allocator")."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from .errors import ConfigError


def total_memory_bytes() -> tuple[int, str]:
    """Total memory of the device dtr budgets for, and its name: the current CUDA device
    when CUDA is available (dtr exists for GPUs), else this machine's physical memory."""
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return int(props.total_memory), f"cuda:{index} ({props.name})"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
    except (ValueError, OSError, AttributeError):  # not POSIX: no portable answer
        raise ValueError(
            "cannot read this machine's memory size for a percentage; give bytes"
        ) from None


def allocator_meter() -> Callable[[], int]:
    """measure="allocator": a function returning the bytes the CUDA caching allocator has
    handed out on the current device, everything allocated there (managed or not, with
    the allocator's rounding). Read in C++ (dtr._C.cuda_allocated_bytes: one copy of the
    allocator's counters, no stats dictionary); torch.cuda.memory_allocated in the
    pure-Python build."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "dtr: measure='allocator' holds the budget to what the CUDA caching allocator "
            "has allocated, and this machine has no CUDA device (the CPU allocator keeps "
            "no count); use measure='dtr', dtr's own count of the tensors it manages"
        )
    index = torch.cuda.current_device()
    try:
        from ._C import cuda_allocated_bytes
    except ImportError:  # the pure-Python build
        return functools.partial(torch.cuda.memory_allocated, index)
    return functools.partial(cuda_allocated_bytes, index)

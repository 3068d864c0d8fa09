"""What the device offers: total memory, for budgets given as a percentage ("80%")."""

from __future__ import annotations

import os

import torch


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

"""Evict on demand: when the allocator itself runs out of memory inside an op, dtr frees
memory by evicting and runs the op again, so a run needs no budget at all to survive a
device that is fuller than dtr's count says (other processes, fragmentation, workspace).

Only ops that write none of their arguments are retried: an out-of-memory error can in
principle come after a kernel wrote part of its output into an argument, and running such
an op again would read what it half wrote.
"""

from __future__ import annotations

import re

import torch

from ...errors import BudgetError
from ...units import format_bytes

# A device allocator says what it was asked for: CUDA's caching allocator "Tried to
# allocate 20.00 MiB", the tests' emulated device "Tried to allocate 4096 bytes"
_REQUEST = re.compile(r"[Tt]ried to allocate ([\d.]+) ?(B|bytes|KiB|MiB|GiB|TiB)")
_SCALE = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def requested_bytes(exc: BaseException) -> int:
    """The allocation that failed, read from the allocator's message (0: not said)."""
    match = _REQUEST.search(str(exc))
    return int(float(match.group(1)) * _SCALE[match.group(2)]) if match else 0


def retry(exc, func, args, kwargs, retry: bool, evict, fail, rng=None):
    """func(*args, **kwargs) raised exc, a torch.OutOfMemoryError: evict(exc) -> bytes
    freed, and run it again until it succeeds or nothing more can be freed; then raise
    fail(exc, retried). rng: the (generator, state) a random op must start from; every
    attempt starts there, since the failed one may have drawn numbers already. dtr's own
    BudgetError (also an OutOfMemoryError) passes through untouched."""
    while True:
        if not retry or evict(exc) <= 0:
            raise fail(exc, retry) from exc
        if rng is not None:
            rng[0].set_state(rng[1])
        try:
            return func(*args, **kwargs)
        except BudgetError:
            raise
        except torch.OutOfMemoryError as again:
            exc = again


def oom_message(name: str, exc: BaseException, retried: bool, core) -> str:
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    why = (
        "and dtr has nothing left to evict"
        if retried
        else "and dtr does not retry ops that write to their arguments"
    )
    return (
        f"dtr: the allocator ran out of memory running {name} {why}: "
        f"{format_bytes(core.resident_bytes)} resident by dtr's count, of which "
        f"{format_bytes(core.pinned_bytes())} pinned and {format_bytes(core.locked_bytes())} "
        f"locked by the running op. The allocator said: {said.rstrip('.')}. Reduce the "
        "batch size, or give dtr a budget below the device's memory (e.g. budget='80%')."
    )

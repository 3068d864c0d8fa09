"""A plain tensor's memory handed out by address while a session is open (both engines).

``p.detach().numpy()`` and ``torch.from_dlpack(p.detach())`` (``__dlpack__``) of a plain
tensor (a parameter made before the block, an input) give the program a handle through
which it can write the memory with no op dtr sees. Such an export counts as a write of unknown content at that moment
and at any time after, as an export of a managed value does (dtr/engines/subclass/volatile.py): what
recipes read of the memory so far is materialized and pinned, as before an op writes a
plain tensor (Invariant 4), and every later recipe that reads the storage reads a
snapshot of it, as it reads NumPy-backed memory. A recomputation then never reads what
was written through the handle after the op ran.

Only ``numpy()`` and ``__dlpack__()`` (``np.asarray``, ``torch.from_dlpack``) count:
they hand out a writable array. ``untyped_storage()`` and ``data_ptr()`` of a plain tensor
do not: programs and libraries call them constantly to read sizes and identities
(memory accounting, tied-weight checks, serialization), and counting each as a write
would pin the readers of every parameter so read. A write through a raw pointer of a
plain tensor is therefore not seen (README, Limits). The methods are replaced on
``torch.Tensor`` for the life of the process (the first ``dtr.enable()`` block installs
them); with no session open they go straight to PyTorch's.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

_lock = threading.Lock()
_installed = False
# The open session's engine: called with each plain tensor whose memory is handed out.
_hook: Callable[[torch.Tensor], None] | None = None

def set_hook(hook: Callable[[torch.Tensor], None] | None) -> None:
    """The open session's handler (None at exit)."""
    global _hook
    _hook = hook


def exported(t: torch.Tensor) -> None:
    """t's memory is handed out by address (torch.to_dlpack, dtr/dlpack.py)."""
    hook = _hook
    if hook is not None:
        hook(t)


def _always(original):
    def run(self, *args, **kwargs):
        hook = _hook
        if hook is not None:
            hook(self)
        return original(self, *args, **kwargs)

    return run


def install() -> None:
    """Replace the methods (once per process; later calls do nothing). Called before
    dtr/engines/native/undispatched_reads.py's replacements are installed, which wrap these."""
    global _installed
    with _lock:
        if _installed:
            return
        for name, wrap in (("numpy", _always), ("__dlpack__", _always)):
            original = getattr(torch.Tensor, name)
            replacement = wrap(original)
            replacement.__name__ = name
            replacement.__doc__ = original.__doc__
            setattr(torch.Tensor, name, replacement)
        _installed = True

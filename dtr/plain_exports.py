"""A plain tensor's memory handed out by address while a session is open (both engines).

``p.detach().numpy()``, ``torch.from_dlpack(p.detach())`` (``__dlpack__``),
``p.untyped_storage()`` and ``p.data_ptr()`` of a plain tensor (a parameter made before
the block, an input) give the program a handle through which it can write the memory
with no op dtr sees. Such an export counts as a write of unknown content at that moment
and at any time after, as an export of a managed value does (dtr/volatile.py): what
recipes read of the memory so far is materialized and pinned, as before an op writes a
plain tensor (Invariant 4), and every later recipe that reads the storage reads a
snapshot of it, as it reads NumPy-backed memory. A recomputation then never reads what
was written through the handle after the op ran.

``numpy()`` and ``__dlpack__()`` always hand the memory out (``np.asarray`` and
``torch.from_dlpack`` call them from inside NumPy and torch). ``untyped_storage()``,
``data_ptr()`` and ``const_data_ptr()`` are called by torch and dtr themselves to read
sizes, keys and addresses (serialization, deep copies, every op dtr records): they
count as exports only when called from elsewhere (the program's code). The methods are
replaced on ``torch.Tensor`` for the life of the process (the first session installs
them); with no session open they go straight to PyTorch's.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable

import torch

_lock = threading.Lock()
_installed = False
# The open session's engine: called with each plain tensor whose memory is handed out.
_hook: Callable[[torch.Tensor], None] | None = None

# Modules whose calls read a tensor's storage or address for their own use; frames of
# the replacements in front of these (dtr/native_reads.py) are skipped.
_INTERNAL = ("torch", "dtr")
_WRAPPERS = frozenset({__name__, "dtr.native_reads"})


def set_hook(hook: Callable[[torch.Tensor], None] | None) -> None:
    """The open session's handler (None at exit)."""
    global _hook
    _hook = hook


def exported(t: torch.Tensor) -> None:
    """t's memory is handed out by address (torch.to_dlpack, dtr/dlpack.py)."""
    hook = _hook
    if hook is not None:
        hook(t)


def _called_by_program() -> bool:
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in _WRAPPERS:
        frame = frame.f_back
    if frame is None:
        return True
    module = frame.f_globals.get("__name__", "")
    return module.partition(".")[0] not in _INTERNAL


def _always(original):
    def run(self, *args, **kwargs):
        hook = _hook
        if hook is not None:
            hook(self)
        return original(self, *args, **kwargs)

    return run


def _from_program(original):
    def run(self, *args, **kwargs):
        hook = _hook
        if hook is not None and _called_by_program():
            hook(self)
        return original(self, *args, **kwargs)

    return run


def install() -> None:
    """Replace the methods (once per process; later calls do nothing). Called before
    dtr/native_reads.py's replacements are installed, which wrap these."""
    global _installed
    with _lock:
        if _installed:
            return
        for name, wrap in (
            ("numpy", _always),
            ("__dlpack__", _always),
            ("untyped_storage", _from_program),
            ("data_ptr", _from_program),
            ("const_data_ptr", _from_program),
        ):
            original = getattr(torch.Tensor, name)
            replacement = wrap(original)
            replacement.__name__ = name
            replacement.__doc__ = original.__doc__
            setattr(torch.Tensor, name, replacement)
        _installed = True

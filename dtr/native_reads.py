"""Tensor methods that read memory without dispatching an op, under the native engine.

A native managed tensor shares its value's storage, and eviction frees that memory in
place. ``tolist()`` reads it directly (a ``dtr:`` error if the value is evicted at that
moment), and ``numpy()`` and ``__dlpack__()`` hand out its raw address, which outlived
an eviction: a NumPy array taken from a resident tensor read freed, reused memory once
dtr evicted the value (measured: a silently different array). While a native session
is open these methods are replaced on ``torch.Tensor`` (process-wide, put back at exit):
on a managed tensor, ``tolist()`` reads a copy of the value (recomputed if evicted, a
``READ`` in the trace), and ``numpy()``/``__dlpack__()`` (``np.asarray`` and
``__array__`` call ``numpy()``) take the value pinned, as ``dtr.materialize`` does, so
the memory they hand out is never evicted. Other tensors go to PyTorch's methods
unchanged. ``data_ptr()`` still raises on an evicted value; code that keeps raw
addresses must call ``dtr.materialize(t)`` first.
"""

from __future__ import annotations

import torch

_MISSING = object()
_saved: dict[str, object] = {}


def _replacements(_C) -> dict:
    tolist, numpy, dlpack = torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__dlpack__

    def native_tolist(self):
        return tolist(_C.native_read(self) if _C.is_native(self) else self)

    def native_numpy(self, *, force: bool = False):
        if _C.is_native(self) and (force or not self.requires_grad):
            # (a tensor that requires grad gets PyTorch's error, as in eager)
            self = _C.native_materialize(self)
        return numpy(self, force=force)

    def native_dlpack(self, *args, **kwargs):
        return dlpack(_C.native_materialize(self) if _C.is_native(self) else self, *args, **kwargs)

    return {"tolist": native_tolist, "numpy": native_numpy, "__dlpack__": native_dlpack}


def install() -> None:
    """Replace the methods (at session enter)."""
    from . import _C

    for name, method in _replacements(_C).items():
        _saved[name] = torch.Tensor.__dict__.get(name, _MISSING)
        setattr(torch.Tensor, name, method)


def remove() -> None:
    """Put PyTorch's methods back (at session exit)."""
    for name, saved in _saved.items():
        if saved is _MISSING:
            delattr(torch.Tensor, name)
        else:
            setattr(torch.Tensor, name, saved)
    _saved.clear()

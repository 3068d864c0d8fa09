"""``torch.to_dlpack`` on managed tensors, under either engine.

``torch.to_dlpack`` (also ``torch.utils.dlpack.to_dlpack``) is a C function that reads a
tensor's memory without dispatching an op or consulting the tensor's Python methods. On
the subclass engine's wrapper, which has no memory of its own, it built a capsule at
address 0 and reading it crashed the process (measured: a segmentation fault in
``torch.from_dlpack``); on the native engine it handed out the value's raw address,
which an eviction then freed under the capsule. Once a session has been opened (either
engine) both names are this function for the rest of the process: a managed tensor is
exported first, pinned as ``dtr.materialize`` pins it, so the capsule shares memory that
is never evicted, as in eager; any other tensor goes to PyTorch's function unchanged.
Code that bound the function before (``from torch.utils.dlpack import to_dlpack`` at
import time) still gets PyTorch's: ``dtr.materialize`` the tensor first there.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.utils.dlpack

from . import plain_exports
from .engines.subclass.tensor import CheckpointTensor, _plain

_lock = threading.Lock()
_original = None


def to_dlpack(tensor: torch.Tensor):
    if isinstance(tensor, CheckpointTensor):
        # The capsule holds the plain value, which the export pins in the core.
        tensor = _plain(tensor, export=True)
    else:
        ext = sys.modules.get("dtr._C")  # not loaded: no native session ever ran
        if ext is not None and hasattr(ext, "is_native") and ext.is_native(tensor):
            ext.native_materialize(tensor)  # pinned while the capsule holds the tensor
        else:
            plain_exports.exported(tensor)  # a plain tensor's memory, volatile from now on
    return _original(tensor)


def install() -> None:
    """Replace both names (once per process; later calls do nothing)."""
    global _original
    with _lock:
        if _original is not None:
            return
        _original = torch.utils.dlpack.to_dlpack
        to_dlpack.__doc__ = _original.__doc__
        torch.utils.dlpack.to_dlpack = to_dlpack
        torch.to_dlpack = to_dlpack

"""Tensor methods that read memory without dispatching an op, under the native engine.

A native managed tensor shares its value's storage, and eviction frees that memory in
place. ``tolist()`` reads it directly (a ``dtr:`` error if the value is evicted at that
moment), and ``numpy()`` and ``__dlpack__()`` hand out its raw address, which outlived
an eviction: a NumPy array taken from a resident tensor read freed, reused memory once
dtr evicted the value (measured: a silently different array), and ``data_ptr()`` of an
evicted value was an error. While a native session is open these methods are replaced
on ``torch.Tensor`` (process-wide, put back at exit): on a managed tensor, ``tolist()``
reads a copy of the value (recomputed if evicted, a ``READ`` in the trace), and
``numpy()``/``__dlpack__()`` (``np.asarray`` and ``__array__`` call ``numpy()``) pin the
tensor, as ``dtr.materialize`` does, and hand out the managed tensor's own memory: the
array (or capsule) holds that tensor, whose pin lasts as long as it does, so the memory
is never evicted under it and writes through it reach the tensor, as in eager (an array
over the plain view ``dtr.materialize`` returns would not hold the pin: that lasts as
long as the managed tensor pinned, and in ``t.detach().numpy()`` the detached one dies
at once). ``data_ptr()``/``const_data_ptr()``, ``untyped_storage()`` and
``share_memory_()`` pin too, so an address holds for the tensor's life, as in eager.
Found by calling every ``torch.Tensor`` method on a managed tensor against eager (sixth
session): the legacy constructors ``new()``/``new_tensor()`` take their backend from the
dispatch keys (PrivateUse1: a crash, or a missing ``torch.privateuseone`` module), so a plain tensor
of the same dtype and device answers them; ``is_shared()`` of an evicted value aborted
(it is ``False``: a shared value is pinned); ``apply_``/``map_``/``map2_`` loop over
the memory (a write the engine did not see, lost at the next recomputation), so they
run on a copy that ``copy_`` writes back, recorded; ``__reduce_ex__`` (``torch.save``,
pickle) and ``__deepcopy__`` read a copy of the value, as ``tolist()``, where they
failed on an evicted one. Other tensors go to PyTorch's methods unchanged; calls from
C++ do not come here.
"""

from __future__ import annotations

import sys

import torch

from .tensor import _jagged_new_code

_MISSING = object()
_saved: dict[str, object] = {}


def _replacements(_C) -> dict:
    tolist, numpy, data_ptr = torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.data_ptr
    is_shared = torch.Tensor.is_shared
    reduce_ex, deepcopy = torch.Tensor.__reduce_ex__, torch.Tensor.__deepcopy__

    def native_tolist(self):
        return tolist(_C.native_read(self) if _C.is_native(self) else self)

    def native_numpy(self, *, force: bool = False):
        if not _C.is_native(self) or (self.requires_grad and not force):
            return numpy(self, force=force)  # (requires grad: PyTorch's error, as in eager)
        if force:  # what force does, here, so that the array's base is the pinned tensor
            self = self.detach().resolve_conj().resolve_neg()
        _C.native_materialize(self)  # resident and pinned
        # The array's base is this managed tensor, whose handle keeps the pin (and so the
        # array's memory, and its aliasing with the tensor) for as long as the array lives.
        return numpy(self)

    def pinning(method: str):
        # Methods that hand out the memory itself (a capsule, an address, shared memory):
        # the managed tensor is pinned first, resident for as long as it lives, so what
        # they handed out is never evicted under its holder.
        original = getattr(torch.Tensor, method)

        def run(self, *args, **kwargs):
            if _C.is_native(self):
                _C.native_materialize(self)
            return original(self, *args, **kwargs)

        return run

    untyped_storage = torch.Tensor.untyped_storage

    def native_untyped_storage(self):
        # The storage is the value's memory, handed out (a tensor set_ over it writes it):
        # pinned as data_ptr() pins it. A nested jagged tensor's constructor reads only its
        # size, for every op on it; pinning there made every jagged tensor's values
        # unevictable (the subclass engine's wrapper makes the same exception).
        if _C.is_native(self) and sys._getframe(1).f_code is not _jagged_new_code():
            _C.native_materialize(self)
        return untyped_storage(self)

    def write_back(method: str):
        # apply_/map_/map2_ run a Python function over the memory itself: a write the
        # engine does not see (lost at the next recomputation), or an error on an evicted
        # value. They run on a copy of the value, which a copy_ writes back, recorded.
        original = getattr(torch.Tensor, method)

        def run(self, *args):
            if not _C.is_native(self) or self.requires_grad:  # (PyTorch's error, then)
                return original(self, *args)
            value = _C.native_read(self)
            args = [
                _C.native_read(a) if isinstance(a, torch.Tensor) and _C.is_native(a) else a
                for a in args
            ]
            original(value, *args)
            return self.copy_(value)

        return run

    def legacy_constructor(method: str):
        # t.new(...) and t.new_tensor(...) pick their backend from the tensor's dispatch
        # keys, where a managed tensor has PrivateUse1: t.new() crashed the process, the
        # others looked for a torch.privateuseone module. A plain tensor of the same
        # dtype and device answers instead (the result is a new plain tensor either way).
        original = getattr(torch.Tensor, method)

        def run(self, *args, **kwargs):
            if _C.is_native(self):
                self = torch.empty(0, dtype=self.dtype, device=self.device)
            return original(self, *args, **kwargs)

        return run

    def plain_copy(self) -> torch.Tensor:
        # A copy of the value (recomputed if evicted), a leaf that requires grad as self
        # is one: what the subclass engine's wrapper reduces and deep-copies to.
        value = _C.native_read(self)
        if self.requires_grad and self.is_leaf:
            value.requires_grad_(True)
        return value

    def native_reduce_ex(self, protocol):
        # torch.save, pickle: they read the memory directly (an evicted value failed).
        if not _C.is_native(self):
            return reduce_ex(self, protocol)
        return plain_copy(self).__reduce_ex__(protocol)

    def native_deepcopy(self, memo):
        if not _C.is_native(self):
            return deepcopy(self, memo)
        memo[id(self)] = value = plain_copy(self)
        return value

    def native_is_shared(self):
        # Reading an evicted value's storage aborted the process; an evicted value was
        # never shared (share_memory_() pins it).
        if _C.is_native(self):
            try:
                data_ptr(self)
            except RuntimeError:  # dtr's "this tensor's value is evicted"
                return False
        return is_shared(self)

    return {
        "apply_": write_back("apply_"),
        "map_": write_back("map_"),
        "map2_": write_back("map2_"),
        "__reduce_ex__": native_reduce_ex,
        "__deepcopy__": native_deepcopy,
        "new": legacy_constructor("new"),
        "new_tensor": legacy_constructor("new_tensor"),
        "is_shared": native_is_shared,
        "share_memory_": pinning("share_memory_"),
        "tolist": native_tolist,
        "numpy": native_numpy,
        "__dlpack__": pinning("__dlpack__"),
        "data_ptr": pinning("data_ptr"),
        "untyped_storage": native_untyped_storage,
        "const_data_ptr": pinning("const_data_ptr"),
    }


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

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
at once). ``data_ptr()``/``const_data_ptr()``, ``share_memory_()`` and
``untyped_storage()`` pin too, so an address holds for the tensor's life, as in eager;
torch.multiprocessing's reductions reach the storage through ``untyped_storage()``, so a
managed tensor sent to another process shares its pinned value, as in eager. Calling every
``torch.Tensor`` method on a managed tensor against eager (tests/engines/test_tensor_methods.py)
shows why each is here: the legacy
constructors ``new()``/``new_tensor()`` take their device from the dispatch keys, and
the engine's key (PrivateUse3) names none ("doesn't correspond to a device"), so a plain
tensor of the same dtype and device answers them; ``is_shared()`` of an evicted value aborted
(it is ``False``: a shared value is pinned); ``apply_``/``map_``/``map2_`` loop over
the memory (a write the engine did not see, lost at the next recomputation), so they
run on a copy that ``copy_`` writes back, recorded; ``__reduce_ex__`` (``torch.save``,
pickle) and ``__deepcopy__`` read a copy of the value's storage, where they failed on an
evicted one, shared by the views of that storage as eager's copies are
(dtr/copying.py). Other tensors go to PyTorch's methods unchanged; calls from
C++ do not come here.
"""

from __future__ import annotations

import sys

import torch

from ... import copying
from ..subclass.tensor import jagged_new_code

_MISSING = object()
_saved: dict[tuple[object, str], object] = {}


def _replacements(_C) -> dict:
    tolist, numpy, data_ptr = torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.data_ptr
    is_shared, untyped_storage = torch.Tensor.is_shared, torch.Tensor.untyped_storage
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

    def native_untyped_storage(self):
        # The value's storage, pinned as data_ptr() pins it: the caller may read or share
        # its memory. A nested jagged tensor's constructor reads only the size (for every
        # op on one): it gets the storage unpinned, or no budget below the peak is met.
        if _C.is_native(self) and sys._getframe(1).f_code is not jagged_new_code():
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
        # t.new(...) and t.new_tensor(...) pick their device from the tensor's dispatch
        # keys, where a managed tensor has the engine's key, which names no device. A
        # plain tensor of the same dtype and device answers instead (the result is a new
        # plain tensor either way).
        original = getattr(torch.Tensor, method)

        def run(self, *args, **kwargs):
            if _C.is_native(self):
                self = torch.empty(0, dtype=self.dtype, device=self.device)
            return original(self, *args, **kwargs)

        return run

    # torch.save, pickle and deepcopy read the memory directly (an evicted value failed):
    # they get plain tensors over a copy of the storage, shared by its views as in eager
    # (dtr/copying.py), as the subclass engine's wrapper reduces and deep-copies to.
    def native_reduce_ex(self, protocol):
        if not _C.is_native(self):
            return reduce_ex(self, protocol)
        key = self.untyped_storage()._cdata
        return copying.reduced(self, key, _C.native_read_storage).__reduce_ex__(protocol)

    def native_deepcopy(self, memo):
        if not _C.is_native(self):
            return deepcopy(self, memo)
        key = self.untyped_storage()._cdata
        return copying.deepcopy(self, memo, key, _C.native_read_storage, deepcopy)

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
        "untyped_storage": native_untyped_storage,
        "tolist": native_tolist,
        "numpy": native_numpy,
        "__dlpack__": pinning("__dlpack__"),
        "data_ptr": pinning("data_ptr"),
        "const_data_ptr": pinning("const_data_ptr"),
    }


def _swap_tensors(session_engine):
    original = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        # The engine remembers a tensor that zero_()/fill_() filled whole by a weak
        # reference to it until the next op settles the entry (csrc/native/engine.cpp,
        # MadeByFill), and swap_tensors refuses a tensor that has one: settled first.
        engine = session_engine()
        if engine is not None and engine.open:
            engine.settle_made()
        return original(t1, t2)

    return swap_tensors


def install(session_engine=lambda: None) -> None:
    """Replace the methods (at session enter); session_engine() is the open session's
    engine, or None."""
    from ... import _C

    targets = [(torch.Tensor, name, method) for name, method in _replacements(_C).items()]
    # Module._apply calls it as torch.utils.swap_tensors (conversions with
    # torch.__future__.set_swap_module_params_on_conversion(True))
    targets.append((torch.utils, "swap_tensors", _swap_tensors(session_engine)))
    for owner, name, replacement in targets:
        _saved[owner, name] = vars(owner).get(name, _MISSING)
        setattr(owner, name, replacement)


def remove() -> None:
    """Put PyTorch's methods back (at session exit)."""
    for (owner, name), saved in _saved.items():
        if saved is _MISSING:
            if name in vars(owner):  # (install() may have stopped before setting it)
                delattr(owner, name)
        else:
            setattr(owner, name, saved)
    _saved.clear()

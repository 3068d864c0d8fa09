"""copy.deepcopy, torch.save and pickle of managed tensors, with eager's structure.

Eager deep-copies a tensor's whole storage once per deepcopy memo (``memo["torch"]``,
keyed by the storage) and builds each tensor over that copy, so views of one storage
stay views of one copy (a later in-place write to one shows in the others). torch.save
writes each storage once, whatever number of tensors view it, and saves a non-leaf that
requires grad as a leaf that requires grad. A managed tensor's memory can be evicted at
any op, so both engines go through here with ``whole(t)``: a plain tensor with t's
geometry over a copy of t's whole storage (recomputed first if it is evicted), and
``key``, which names t's storage for as long as t lives (the native engine's storage;
the subclass engine's pool, since its values move to new storages when recomputed).

torch.multiprocessing sends a tensor's own storage, moved to shared memory, not a copy:
``reduce_for_process``.
"""

from __future__ import annotations

import copy
import weakref
from typing import Callable

import torch

# The storage copies pickles and torch.save calls in flight hold: the (key, version) of a
# managed storage -> its copy, for as long as a pickle holds the copy. Views of one storage
# pickled together reduce to tensors over one copy, which torch.save writes once.
_reduced: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _over(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """A plain tensor of t's dtype and geometry over storage (what eager's deepcopy
    builds)."""
    return torch.empty(0, dtype=t.dtype, device=storage.device).set_(
        storage, t.storage_offset(), t.size(), t.stride()
    )


def deepcopy(
    t: torch.Tensor, memo: dict, key, whole: Callable[[torch.Tensor], torch.Tensor], original
) -> torch.Tensor:
    """copy.deepcopy(t) of a managed tensor: a plain tensor, as eager's deepcopy of its
    value would give (the storage copied once per memo)."""
    if not t.is_leaf:
        return original(t, memo)  # eager's error: only leaves can be deep-copied
    if id(t) in memo:
        return memo[id(t)]
    copies = memo.setdefault("torch", {})
    storage = copies.get(key)
    if storage is None:
        storage = copies[key] = whole(t).untyped_storage()
    with torch.no_grad():
        new = _over(t, storage)
        # eager resolves the lazy bits into the copy's values
        if t.is_conj():
            new = new.conj_physical()
        if t.is_neg():
            new = new.neg()
        if t.requires_grad:
            new.requires_grad_()
        if t.grad is not None:
            new.grad = copy.deepcopy(t.grad, memo)
    memo[id(t)] = new
    return new


def reduced(t: torch.Tensor, key, whole: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The plain tensor a managed one pickles as (torch.save, pickle): over the storage
    copy that views of the same storage pickled with it share, and requiring grad as t
    does (a non-leaf is saved as a leaf, as eager saves it)."""
    version = (key, t._version)
    storage = _reduced.get(version)
    if storage is None:
        storage = _reduced[version] = whole(t).untyped_storage()
    plain = _over(t, storage)
    if t.is_conj():
        torch._C._set_conj(plain, True)
    if t.is_neg():
        torch._C._set_neg(plain, True)
    if t.requires_grad:
        plain.requires_grad_(True)
    return plain


def reduce_for_process(t: torch.Tensor):
    """torch.multiprocessing's reduction of a subclass-engine wrapper. ForkingPickler
    looks reductions up by exact type, so PyTorch's for torch.Tensor misses the wrapper,
    whose pickle reduction (``reduced``) sends a copy: a receiver would not see later
    writes, and the copy dies once pickled, closing the descriptor a spawned Process
    gets only after its arguments are pickled. PyTorch's reduction, as eager's, shares
    the tensor's own storage: it reads it through ``untyped_storage()``, which pins the
    value (an export), so the shared memory lives as long as the tensor. A non-leaf
    that requires grad gets PyTorch's refusal. The receiver rebuilds a plain tensor, so
    it need not import dtr."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(t)
    return rebuild, (torch.Tensor, *args[1:])  # every branch's first argument: type(t)

"""Memory that can change with no op dtr sees, and the copies recipes read in its place.

Two kinds of storage are *volatile*: one handed out by address (a managed value exported
by ``numpy()``, ``__dlpack__``, ``data_ptr()``, ``untyped_storage()`` or
``dtr.materialize``: a NumPy array or ctypes can write it at any time), and a plain
tensor's foreign memory (``torch.from_numpy``, ``torch.frombuffer``, ``from_dlpack``:
no allocator of PyTorch's, ``resizable()`` is False), which the program refills through
NumPy without a version bump (a reused input buffer). A recipe that read such memory
would replay on whatever it holds then. It reads a snapshot instead: a copy of the whole
storage taken when the op runs, with the tensor's metadata, a constant of the recipe
(counted while a recipe holds it). Consecutive ops reading unchanged bytes share one
snapshot, compared bitwise, so a batch read by a layer's forward and backward is copied
once. Pinning the readers' outputs instead would keep a first layer's output, often far
larger than its input, resident for the whole step. csrc/native/engine.cpp (NativeEngine::snapshot)
does the same for the native engine.
"""

from __future__ import annotations

import weakref

import torch

from .recipe import copy_preserving_layout


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.storage_offset() == b.storage_offset()
        and a.size() == b.size()
        and a.stride() == b.stride()
    )


class Snapshots:
    """The latest snapshot of each volatile storage, while a recipe holds it (weakly:
    the cache never keeps a copy alive)."""

    def __init__(self):
        self._latest: dict[int, weakref.ref] = {}  # source storage key -> snapshot
        self._prune_at = 64

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor with t's metadata over a copy of t's storage as it is now."""
        if t.is_conj() or t.is_neg():  # bits of the tensor, not of the storage
            return copy_preserving_layout(t)
        source = t.untyped_storage()
        key = source._cdata
        old = self._unchanged(key, source)
        if old is not None and _same_view(old, t):
            return old
        kept = old.untyped_storage() if old is not None else _bytes(source).clone().untyped_storage()
        snap = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            kept, t.storage_offset(), t.size(), t.stride()
        )
        self._remember(key, snap)
        return snap

    def _unchanged(self, key: int, source: torch.UntypedStorage) -> torch.Tensor | None:
        """The latest snapshot of the storage at key, if it still holds source's bytes."""
        ref = self._latest.get(key)
        old = ref() if ref is not None else None
        if old is None:
            return None
        kept = old.untyped_storage()
        if kept.nbytes() != source.nbytes() or not torch.equal(_bytes(kept), _bytes(source)):
            return None
        return old

    def _remember(self, key: int, snap: torch.Tensor) -> None:
        if len(self._latest) >= 2 * self._prune_at:  # storages that died: one a step
            self._latest = {k: r for k, r in self._latest.items() if r() is not None}
            self._prune_at = max(64, len(self._latest))
        self._latest[key] = weakref.ref(snap)

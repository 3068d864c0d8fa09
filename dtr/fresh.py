"""Plain tensors a factory just made inside the block, which a recipe can rebuild.

`torch.sparse.mm(adj, h)` is a composite: `_sparse_addmm(torch.zeros(...), adj, h, 0, 1)`.
The zeros tensor reads no managed value, so it is plain, and the recipe of the product
would hold it as a constant (pinned) for as long as the product may be recomputed: one
product-sized tensor per layer of a graph network, kept from forward to backward (with
a COO adjacency dtr held 1.76x eager's memory with no budget, bench/sparse_gcn.py).
The runtime remembers each untouched output of `zeros`/`ones`/`full`, and an op with a
sparse operand that reads one gets a managed copy made by the same call instead, which
is evicted and rebuilt like any other value (costing nothing to rebuild).
"""

from __future__ import annotations

import weakref

import torch

aten = torch.ops.aten

FACTORIES = frozenset({aten.zeros.default, aten.ones.default, aten.full.default})
_PRUNE_AT = 4096


class FreshFactories:
    """Factory outputs of this session, by storage, while they live and are unwritten."""

    def __init__(self) -> None:
        self._made: dict[int, tuple] = {}
        self._prune_at = _PRUNE_AT

    def remember(self, out, func, args: tuple, kwargs: dict) -> None:
        if not isinstance(out, torch.Tensor) or out.layout is not torch.strided:
            return
        if len(self._made) >= self._prune_at:
            self._made = {k: v for k, v in self._made.items() if v[0]() is not None}
            self._prune_at = max(_PRUNE_AT, 2 * len(self._made))
        key = out.untyped_storage()._cdata
        self._made[key] = (weakref.ref(out), func, args, kwargs, out._version)

    def call_for(self, t: torch.Tensor):
        """(func, args, kwargs) that makes t's value again, if t is a factory's output
        that nothing has written since; else None. (A storage address reused by another
        tensor fails the identity check.)"""
        entry = self._made.get(t.untyped_storage()._cdata)
        if entry is None:
            return None
        ref, func, args, kwargs, version = entry
        if ref() is not t or t._version != version:
            return None
        return func, args, kwargs

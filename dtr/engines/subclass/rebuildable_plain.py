"""Plain tensors a factory just made inside the block, which a recipe can rebuild.

`torch.sparse.mm(adj, h)` is a composite: `_sparse_addmm(torch.zeros(...), adj, h, 0, 1)`.
The zeros tensor reads no managed value, so it is plain, and the recipe of the product
would hold it as a constant (pinned) for as long as the product may be recomputed: one
product-sized tensor per layer of a graph network, kept from forward to backward (with
a COO adjacency dtr held 1.76x eager's memory with no budget, bench/sparse_gcn.py).
The runtime remembers each untouched output of `zeros`/`ones`/`full`, and an op with a
sparse operand that reads one gets a managed copy made by the same call instead, which
is evicted and rebuilt like any other value (costing nothing to rebuild).

Its backward is `aten.mm(adj.t(), grad)`, and for a COO adjacency `adj.t()` copies the
indices and values: a plain sparse tensor per backward product, which the product's
recipe held as a constant for as long as it might replay (through the rest of the
backward pass), so no budget below the unbudgeted peak could be met. The runtime
remembers each sparse transpose of a plain sparse tensor, and a recipe that reads one
reads its source instead, taking the transpose again when it replays (`Rebuilt`).

The native engine's twin is in csrc/native/engine.cpp (`Made`), where the factories are seen as
the fills of what they made (docs/design.md, "COO graph networks on the native engine").
"""

from __future__ import annotations

import weakref

import torch

from .recipe import Rebuilt
from .storage_keys import SPARSE_LAYOUTS

aten = torch.ops.aten

FACTORIES = frozenset({aten.zeros.default, aten.ones.default, aten.full.default})
TRANSPOSES = frozenset({aten.t.default, aten.transpose.int})
_PRUNE_AT = 4096


class _Made:
    """Entries keyed by an address, each led by a weak reference to the object it is
    about; entries whose object died are dropped when the table has doubled since."""

    def __init__(self) -> None:
        self._made: dict[int, tuple] = {}
        self._prune_at = _PRUNE_AT

    def _add(self, key: int, entry: tuple) -> None:
        if len(self._made) >= self._prune_at:
            self._made = {k: v for k, v in self._made.items() if v[0]() is not None}
            self._prune_at = max(_PRUNE_AT, 2 * len(self._made))
        self._made[key] = entry


class FreshFactories(_Made):
    """Factory outputs of this session, by storage, while they live and are unwritten.

    The weak reference is to the storage (its Python object lives as long as it does),
    not to the tensor: torch.utils.swap_tensors refuses tensors that have one. A tensor
    over that storage with the output's geometry and version holds its value (a view
    shares its base's version counter, so a write through any view is seen)."""

    def remember(self, out, func, args: tuple, kwargs: dict) -> None:
        if not isinstance(out, torch.Tensor) or out.layout is not torch.strided:
            return
        storage = out.untyped_storage()
        geometry = (out.shape, out.stride(), out.storage_offset(), out.dtype)
        entry = (weakref.ref(storage), func, args, kwargs, geometry, out._version)
        self._add(storage._cdata, entry)

    def call_for(self, t: torch.Tensor):
        """(func, args, kwargs) that makes t's value again, if t is a factory's output
        that nothing has written since; else None. (A storage address reused by another
        storage fails the identity check.)"""
        storage = t.untyped_storage()
        entry = self._made.get(storage._cdata)
        if entry is None:
            return None
        ref, func, args, kwargs, geometry, version = entry
        if ref() is not storage or t._version != version:
            return None
        if (t.shape, t.stride(), t.storage_offset(), t.dtype) != geometry:
            return None
        return func, args, kwargs


class FreshTransposes(_Made):
    """Sparse transposes of plain sparse tensors made in this session, while they live
    and neither they nor their source have been written."""

    def remember(self, out, func, args: tuple, kwargs: dict) -> None:
        source = args[0] if args else None
        if not (
            isinstance(out, torch.Tensor)
            and out.layout in SPARSE_LAYOUTS
            and isinstance(source, torch.Tensor)
            and source.layout in SPARSE_LAYOUTS
        ):
            return
        # the source by weak reference too: this registry must not keep a program's
        # sparse tensors alive (a recipe that reads the transpose holds its source)
        self._add(
            out._cdata,
            (
                weakref.ref(out),
                func,
                weakref.ref(source),
                args[1:],
                kwargs,
                out._version,
                source._version,
            ),
        )

    def rebuilt_for(self, t: torch.Tensor, reader: str) -> Rebuilt | None:
        """How a recipe of reader reads t: made again from its source when it replays,
        if t is a remembered transpose that matches its source still; else None (the
        recipe holds t). (A TensorImpl address reused by another tensor fails the
        identity check.)"""
        entry = self._made.get(t._cdata)
        if entry is None:
            return None
        ref, func, source_ref, rest, kwargs, version, source_version = entry
        source = source_ref()
        if ref() is not t or source is None or source._version != source_version:
            return None
        # Autograd makes a COO transpose (a copy) a view of its source once the op has
        # returned (after remember() read its own counter): from then on the two share the
        # source's counter, which the check above covers, so t's own reading no longer
        # applies (it is the source's, nonzero for a graph written before the block).
        if t._base is not source and t._version != version:
            return None
        return Rebuilt(func, (source, *rest), kwargs, reader)

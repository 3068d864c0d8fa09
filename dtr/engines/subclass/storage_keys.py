"""How dtr names and sizes the memory of a plain tensor a recipe reads.

A strided tensor's memory is its storage (views of one buffer share one constant). A sparse tensor
(COO, CSR, CSC, BSR, BSC) has no storage of its own: its memory is its parts' (indices and values),
each a constant of what reads it, so a CSR `adj` and the CSC `adj.t()` autograd makes in backward,
which share every part, are counted once (a COO `adj.t()` copies its parts;
dtr/engines/subclass/rebuildable_plain.py has the recipe take it again instead). The recipe itself
holds the sparse tensor, and checks that tensor (named by itself) for writes behind dtr's back. A
graph network's adjacency matrix is the common case: `torch.sparse.mm(adj, h)` with a managed `h`
records an op whose recipe reads `adj`, and its output is evicted and recomputed like any other.
"""

from __future__ import annotations

import torch

SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
)


def parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors whose storages hold t's memory: t itself, or a sparse tensor's
    indices and values (none for other layouts: dtr never reads those in a recipe)."""
    layout = t.layout
    if layout is torch.strided:
        return (t,)
    if layout is torch.sparse_coo:
        return (t._indices(), t._values())
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return ()


def storage_key(t: torch.Tensor) -> int:
    """What a recipe checks is still the tensor it read: the storage's address (another
    one is storage swapped in with no op, `p.data = ...`), or a sparse tensor's own."""
    if t.layout is torch.strided:
        return t.untyped_storage()._cdata
    return t._cdata


def freed(t: torch.Tensor) -> bool:
    """Whether t's memory was freed under it with no op (`untyped_storage().resize_(0)`,
    as FSDP2 does to unsharded parameters)."""
    return any(p.numel() and not p.untyped_storage().nbytes() for p in parts(t))

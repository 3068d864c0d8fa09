"""The gradient hooks an engine puts on the leaves its ops read (docs/design.md, "Gradient
hooks"), shared by both engines."""

from __future__ import annotations

from collections.abc import Callable

import torch

def reads_call_for_hooks() -> bool:
    """Whether the reads of the op running now call for gradient hooks (csrc/leaf_hooks.h,
    the same rule): under grad mode (a graph may accumulate into the leaf), or inside a
    custom autograd.Function's forward, which runs with grad mode and forward-mode AD both
    off (its backward accumulates into the parameters it read). Plain no_grad code and
    backward keep forward-mode AD on, and inference mode builds no graph: their reads (an
    optimizer's, Module._apply's) call for none."""
    if torch.is_grad_enabled():
        return True
    return not torch._C._is_fwd_grad_enabled() and not torch.is_inference_mode_enabled()


def leaf_to_hook(t: torch.Tensor) -> torch.Tensor | None:
    """The leaf whose gradient hook a read of ``t`` calls for (csrc/leaf_hooks.h, the same
    rule for the C++ paths). Under grad mode, the leaf t is or views. With grad mode off
    (a custom autograd.Function's forward), the base of a view when the base is such a
    leaf: a view made without grad mode (``weight.t()`` in the forward) is a leaf of its
    own that no graph accumulates into; a leaf view of a base that needs no gradient
    (``big[:k].requires_grad_()``) is its own leaf."""
    if not t.requires_grad:
        return None
    if t._is_view() and not (torch.is_grad_enabled() and t.is_leaf):
        base = t._base
        if base.is_leaf and base.requires_grad:
            return base
    return t if t.is_leaf else None


# The list is pruned when it reaches twice its size after the last pruning (this at least).
MIN_PRUNE_AT = 64


class LeafHooks:
    """Post-accumulate-grad hook handles on leaves, removed together at the session's end.

    A program can make a new leaf every step (an input that requires grad): the handles
    of dead leaves, whose hooks dict died with them, are dropped whenever their number
    doubles, so it stays proportional to the leaves alive. Nothing is put on the leaf
    itself: no weak reference (torch.utils.swap_tensors refuses tensors that have one),
    and no attribute (torch.save and copy.deepcopy carry a tensor's attributes, and a
    file must hold what eager's holds). A handle is found by the leaf's address
    (``_cdata``) and is the leaf's own while its hooks dict is the leaf's."""

    def __init__(self) -> None:
        self._handles: dict[int, object] = {}  # leaf._cdata -> its hook's handle
        self._prune_at = MIN_PRUNE_AT

    def __len__(self) -> int:
        return len(self._handles)

    def hooked(self, leaf: torch.Tensor) -> bool:
        """Whether leaf has its hook (csrc/subclass/fastpath.cpp, FastPath::hook_leaf, asks the
        same of the dict this returns from handles())."""
        handle = self._handles.get(leaf._cdata)
        if handle is None:
            return False
        hooks = handle.hooks_dict_ref()
        return hooks is not None and hooks is leaf._post_accumulate_grad_hooks

    def handles(self) -> dict:
        return self._handles

    def add(self, leaf: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        handles = self._handles
        handles[leaf._cdata] = leaf.register_post_accumulate_grad_hook(hook)
        if len(handles) >= self._prune_at:
            for key in [k for k, h in handles.items() if h.hooks_dict_ref() is None]:
                del handles[key]
            self._prune_at = max(MIN_PRUNE_AT, 2 * len(handles))

    def remove_all(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._prune_at = MIN_PRUNE_AT

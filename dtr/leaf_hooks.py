"""The gradient hooks an engine puts on the leaves its ops read (dtr/NOTES.md, "Gradient
hooks"), shared by both engines."""

from __future__ import annotations

from collections.abc import Callable

import torch

# The list is pruned when it reaches twice its size after the last pruning (this at least).
MIN_PRUNE_AT = 64


class LeafHooks:
    """Post-accumulate-grad hook handles on leaves, removed together at the session's end.

    A program can make a new leaf every step (an input that requires grad): the handles
    of dead leaves, whose hooks dict died with them, are dropped whenever the list
    doubles, so the list stays proportional to the leaves alive. No weak reference to the
    leaf itself: torch.utils.swap_tensors refuses tensors that have one."""

    def __init__(self) -> None:
        self._handles: list = []
        self._prune_at = MIN_PRUNE_AT

    def __len__(self) -> int:
        return len(self._handles)

    def add(self, leaf: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        handles = self._handles
        handles.append(leaf.register_post_accumulate_grad_hook(hook))
        if len(handles) >= self._prune_at:
            handles[:] = [h for h in handles if h.hooks_dict_ref() is not None]
            self._prune_at = max(MIN_PRUNE_AT, 2 * len(handles))

    def remove_all(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._prune_at = MIN_PRUNE_AT

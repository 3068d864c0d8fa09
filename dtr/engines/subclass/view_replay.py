"""Views that autograd rebuilds by their op on the subclass engine, and where that shows.

After a tensor is written in place, autograd rebuilds the backward of every view of it
that the program uses again. For a plain tensor it rebuilds an ``AsStridedBackward0``,
whose gradient has the base's layout; for a tensor subclass (the subclass engine's
``CheckpointTensor``) it replays the view's own ops (``TransposeBackward0`` ...), whose
gradient has the view's. The values are the same, but a later reduction or matrix
product summed in another order rounds differently: gradients a few ulps from eager's.
The same holds for the graph ``backward(create_graph=True)`` records through an in-place
write to a view (``CopySlices``): eager's takes ``as_strided``, the subclass engine's
the view's ops, and second-order gradients differ.

Where the view's ops give the base's layout anyway (a slice, a select: their backward
fills a fresh base-shaped tensor), first-order gradients do not differ. Elsewhere the
subclass engine refuses, rather than differ silently:

- an in-place write to a tensor (not a view) while a layout-changing view of it that
  requires grad is alive: at the write;
- a ``create_graph=True`` backward once an in-place write in the session touched a
  tensor with live views that require grad (any views: the second-order graph recorded
  through a replayed slice can differ too): at its first op.

The native engine's tensors are not subclasses, so autograd treats them as eager's.
"""

from __future__ import annotations

import torch

from ...errors import UnsupportedError

aten = torch.ops.aten

# What both refusals say (tests match it).
NOTE = "on the subclass engine autograd replays that view by its own op"

# Views whose backward fills a fresh tensor of the input's shape (contiguous) and copies
# the gradient into the viewed part: the gradient's layout is the input's, whatever the
# incoming gradient's.
_FILLING = frozenset(
    {
        aten.slice.Tensor,
        aten.select.int,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.unbind.int,
        aten.diagonal.default,
        aten.as_strided.default,  # replayed as as_strided, as eager's
    }
)
# Views whose backward reshapes the incoming gradient: contiguous in, contiguous out.
_RESHAPING = frozenset(
    {
        aten.view.default,
        aten._reshape_alias.default,
        aten.unsqueeze.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.alias.default,
    }
)
# (Any other view may give a gradient of another layout (t, transpose, permute: exact
# values, other strides) or other values (expand, unfold: overlapping elements summed
# in another order than as_strided's backward sums them).)


def _view_source(rt, node, pool: set[int]):
    """The member of the pool node was viewed from, per its recipe; None when node was
    not made by a view op of another member (or its lineage is gone)."""
    rid = rt.core.recipe_of(node.tid)
    rec = rt.recipes[rid] if rid >= 0 else None
    if rec is None or not rec.facts.view or not rec.inputs:
        return None, None
    source = rec.inputs[0]
    if not hasattr(source, "tid") or source.tid not in pool:
        return None, None
    return source, rec.func


def _same_layout(funcs: list) -> bool:
    """Whether a gradient through these views (innermost first) reaches the root with
    the layout as_strided's backward gives it (the root's, here contiguous): reshapes
    up to a filling view, which fixes the layout; past it, anything that keeps values."""
    for func in funcs:
        if func in _FILLING:
            return True
        if func not in _RESHAPING:
            return False
    return False  # reshapes only: the incoming gradient's layout passes through


class ViewReplay:
    """The subclass engine's record of views autograd would replay by op (module doc)."""

    def __init__(self, runtime) -> None:
        self.rt = runtime
        # tid -> (node serial, root tid, changes layout, made by): what a view was, kept
        # past the write whose invalidation drops its lineage, for the writes after it
        self.kinds: dict[int, tuple[int, int, bool, str]] = {}
        # what made the views of a write after which a create_graph backward may differ
        # (for the session's life: the graphs recorded then may be used later)
        self.graph_hazard: str | None = None

    # ------------------------------------------------------------------ writes
    def _kind(self, node, root, pool: set[int]) -> tuple[bool, str] | None:
        """(changes layout, what made it) for a view of root in its pool; None for a
        member that is not one (an earlier version, a piece of an unsafe_split)."""
        known = self.kinds.get(node.tid)
        if known is not None and known[0] == node.serial:
            return (known[2], known[3]) if known[1] == root.tid else None
        funcs = []
        at = node
        while at.tid != root.tid:
            at, func = _view_source(self.rt, at, pool)
            if at is None:
                return None
            funcs.append(func)
        funcs.reverse()
        contiguous = root.value is not None and root.value.is_contiguous()
        changes = not (contiguous and _same_layout(funcs))
        self.kinds[node.tid] = (node.serial, root.tid, changes, node.name)
        return changes, node.name

    def _root(self, node, pool: set[int]):
        """The first member up node's view chain that is not a view of another."""
        while True:
            source, _ = _view_source(self.rt, node, pool)
            if source is None:
                return node
            node = source

    def remember(self, tids: list[int]) -> None:
        """Before an invalidation drops these members' lineage: what each view was."""
        rt = self.rt
        pools: dict[int, set[int]] = {}
        for tid in tids:
            node = rt.nodes[tid]
            if node is None or rt.core.ext(tid) == 0:
                continue
            known = self.kinds.get(tid)
            if known is not None and known[0] == node.serial:
                continue  # (on_write classified it before this write's invalidation)
            pid = rt.core.pool_of(tid)
            if pid not in pools:
                pools[pid] = set(rt.core.members(tid))
            pool = pools[pid]
            root = self._root(node, pool)
            if root is not node:
                self._kind(node, root, pool)

    def on_write(self, op, k: int, node) -> None:
        """Before the op writes its k-th leaf, a managed tensor whose storage other live
        tensors share (a non-private write): refuse, or note a graph hazard."""
        rt = self.rt
        t = op.call.leaves[k]
        members = rt.core.members(node.tid)
        pool = set(members)
        is_view = t._is_view()
        # the value autograd's views of the written tensor hang from: the written
        # tensor itself, or the base its view chain reaches
        root = self._root(node, pool) if is_view else node
        changing = None  # what made a live view whose replay changes the layout
        viewed = None  # what made any live view of root (or the written view)
        for tid in members:
            member = rt.nodes[tid]
            if tid == root.tid or member is None or (tid != node.tid and rt.core.ext(tid) == 0):
                continue
            kind = self._kind(member, root, pool)
            if kind is None:
                continue
            if viewed is None or tid == node.tid:
                viewed = kind[1]
            if kind[0] and (changing is None or tid == node.tid):
                changing = kind[1]  # (the written view's own op named first)
        if is_view and viewed is None:
            viewed = node.name  # (its lineage is gone: a view all the same)
        if viewed is None:
            return
        if not t.requires_grad and not (
            torch.is_grad_enabled() and any(x.requires_grad for x in op.call.leaves)
        ):
            return
        if changing is not None and not is_view:
            raise UnsupportedError(
                f"dtr: {op.facts.name} writes in place to a tensor while a view of it "
                f"made by {changing} is alive and requires grad: {NOTE} after the write "
                "(eager: by as_strided), and its gradient could differ from eager's by "
                'rounding. Use engine="native", or take the view after the write (or '
                ".clone() it before)"
            )
        # First-order gradients through the other replays match eager's; a second-order
        # graph recorded through any of them may not (a column narrow(1, i, 1) differs)
        if self.graph_hazard is None and rt._fast is not None:
            rt._fast.watch_graph()
        self.graph_hazard = viewed

    # ------------------------------------------------------------------ backward
    def check_graph(self) -> None:
        """At an op under grad mode once a hazard is noted: refuse it if a backward that
        keeps its graph runs it (create_graph=True records the backward's ops). A backward
        that keeps none is not one: torch.utils.checkpoint recomputes its forward in it,
        under grad mode, and that graph's first-order gradients are eager's."""
        if not torch.is_grad_enabled() or torch._C._current_autograd_node() is None:
            return
        if _graph_kept():
            raise UnsupportedError(
                "dtr: backward(create_graph=True) after an in-place write to a tensor with "
                f"views (made by {self.graph_hazard}) that require grad: {NOTE} (eager: by "
                "as_strided), and second-order gradients could differ from eager's by "
                'rounding. Use engine="native", or write to a .clone()'
            )


def _graph_kept() -> bool:
    """Whether the running backward keeps its graph (the fast path's own test); without
    the C++ extension, assumed so."""
    try:
        from ... import _C
    except ImportError:
        return True
    return _C.graph_kept()

"""One op call taken apart: its tensor arguments in order, and where each one sits.

Tensors appear directly in ``args``/``kwargs`` or one level down in a list (``cat``,
``stack``, ``index_put_``'s indices, the ``_foreach`` ops). A flat loop finds them:
pytree costs several times more on this path (see DESIGN.md, section 1).
"""

from __future__ import annotations

import torch

from ...schema import OpFacts

_Tensor = torch.Tensor


class TensorArgs:
    __slots__ = ("args", "kwargs", "leaves", "where", "positions")

    def __init__(self, facts: OpFacts, args: tuple, kwargs: dict):
        self.args = args
        self.kwargs = kwargs
        leaves: list[torch.Tensor] = []
        where: list[tuple[object, int]] = []  # (index in args or kwarg name, list index or -1)
        positions: list[int] = []  # schema position of each leaf
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                leaves.append(a)
                where.append((i, -1))
                positions.append(i)
            elif type(a) in (list, tuple):
                for j, b in enumerate(a):
                    if isinstance(b, _Tensor):
                        leaves.append(b)
                        where.append((i, j))
                        positions.append(i)
        if kwargs:
            index = facts.arg_index
            for name, a in kwargs.items():
                if isinstance(a, _Tensor):
                    leaves.append(a)
                    where.append((name, -1))
                    positions.append(index[name])
                elif type(a) in (list, tuple):
                    for j, b in enumerate(a):
                        if isinstance(b, _Tensor):
                            leaves.append(b)
                            where.append((name, j))
                            positions.append(index[name])
        self.leaves = leaves
        self.where = where
        self.positions = positions

    def schema_values(self, facts: OpFacts) -> list:
        """Argument values in schema order (missing trailing ones as None)."""
        vals = list(self.args) + [None] * (len(facts.arg_names) - len(self.args))
        for name, a in self.kwargs.items():
            vals[facts.arg_index[name]] = a
        return vals

    def argument(self, facts: OpFacts, position: int):
        if position < len(self.args):
            return self.args[position]
        return self.kwargs.get(facts.arg_names[position])


def substitute(args: tuple, kwargs: dict, where: list, values: list) -> tuple[tuple, dict]:
    """args/kwargs with leaf k replaced by values[k]."""
    new_args = list(args)
    new_kwargs = dict(kwargs) if kwargs else kwargs
    copied: set = set()
    for (key, j), v in zip(where, values):
        container = new_args if isinstance(key, int) else new_kwargs
        if j < 0:
            container[key] = v
        else:
            if key not in copied:
                container[key] = list(container[key])
                copied.add(key)
            container[key][j] = v
    return tuple(new_args), new_kwargs


def returns_of(facts: OpFacts, out) -> list[tuple[int, int, object]]:
    """Tensors an op returned, as (return index, list index or -1, tensor)."""
    rets = (out,) if facts.nreturns == 1 else out
    found = []
    if rets is None:
        return found
    for i, r in enumerate(rets):
        if isinstance(r, _Tensor):
            found.append((i, -1, r))
        elif type(r) in (list, tuple):
            for j, x in enumerate(r):
                if isinstance(x, _Tensor):
                    found.append((i, j, x))
    return found


def rebuild_returns(facts: OpFacts, out, replacements: dict) -> object:
    """The op's return value with the tensors at (i, j) swapped for replacements[(i, j)]."""
    if out is None or not replacements:
        return out
    if facts.nreturns == 1:
        if isinstance(out, _Tensor):
            return replacements.get((0, -1), out)
        if type(out) in (list, tuple):
            return type(out)(replacements.get((0, j), x) for j, x in enumerate(out))
        return out
    result = []
    for i, r in enumerate(out):
        if isinstance(r, _Tensor):
            result.append(replacements.get((i, -1), r))
        elif type(r) in (list, tuple):
            result.append(type(r)(replacements.get((i, j), x) for j, x in enumerate(r)))
        else:
            result.append(r)
    return type(out)(result)

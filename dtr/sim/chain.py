"""Chain-shaped programs, and static checkpointing schedules for them, as traces.

The program: a forward chain ``x_i = f(x_{i-1})`` of n ops, then the backward pass
``g_{i-1} = b(g_i, x_{i-1})`` for i = n .. 1, each value released once nothing later
reads it (as autograd does). Every tensor has the same size, every op the same cost.

A static schedule is written as a trace of the same program in which recomputation is
explicit: non-checkpointed activations are released after the forward pass uses them,
and the backward pass recomputes them (more CALLs) from a checkpoint. Replaying such a
trace with no budget gives the schedule's peak memory and total compute, measured by the
same simulator as DTR:

- ``chen``: Chen et al. 2016, a checkpoint every k ~ sqrt(n) steps; each segment is
  recomputed once, in full, before its backward.
- ``binomial``: Griewank's optimal reversal with s checkpoint slots (Revolve), the
  fewest forward recomputations a fixed number of slots allows, by dynamic programming
  over the split point (exact for the chain lengths the benchmark uses).
"""

from __future__ import annotations

import json
import math


class _Writer:
    def __init__(self, nbytes: int, cost: float):
        self.records: list[dict] = [{"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"}]
        self.nbytes = nbytes
        self.cost = cost
        self.serial = 0

    def op(self, name: str, args: list[str]) -> str:
        self.serial += 1
        out = f"{name}{self.serial}"
        self.records.append(
            {
                "INSTRUCTION": "CALL",
                "NAME": name,
                "ARGS": args,
                "RESULT": [out],
                "TIME": str(self.cost),
            }
        )
        self.records.append({"INSTRUCTION": "MEMORY", "NAME": out, "MEMORY": str(self.nbytes)})
        self.records.append({"INSTRUCTION": "ALIAS", "NAME": out, "ALIAS": "-1"})
        return out

    def release(self, name: str) -> None:
        self.records.append({"INSTRUCTION": "RELEASE", "NAME": name})

    def backward(self) -> None:
        self.records.append({"INSTRUCTION": "ANNOTATE", "ANNOTATION": "BACKWARD"})

    def write(self, path: str) -> str:
        with open(path, "w") as f:
            for r in self.records:
                f.write(json.dumps(r))
                f.write("\n")
        return path


def plain(n: int, path: str, nbytes: int = 1 << 20, cost: float = 1.0) -> str:
    """The chain with every activation kept for the backward pass (what DTR replays)."""
    w = _Writer(nbytes, cost)
    xs = [w.op("x", [])]
    for _ in range(n):
        xs.append(w.op("x", [xs[-1]]))
    _backward(w, xs, lambda i: xs[i])
    return w.write(path)


def _backward(w: _Writer, xs: list, value) -> None:
    """g_{i-1} = b(g_i, x_{i-1}) for i = n .. 1; value(i) yields x_i (maybe recomputed)."""
    w.backward()
    n = len(xs) - 1
    g = w.op("g", [xs[n]])
    w.release(xs[n])
    for i in range(n, 0, -1):
        x = value(i - 1)
        g2 = w.op("g", [g, x])
        w.release(g)
        w.release(x)
        g = g2
    w.release(g)


def chen(n: int, path: str, nbytes: int = 1 << 20, cost: float = 1.0, k: int = 0) -> str:
    """Checkpoints every k = round(sqrt(n)) steps; the rest recomputed per segment."""
    k = k or max(1, round(math.sqrt(n)))
    w = _Writer(nbytes, cost)
    xs: list = [w.op("x", [])]
    for i in range(1, n + 1):
        xs.append(w.op("x", [xs[-1]]))
        if (i - 1) % k != 0 and i - 1 != 0:  # drop what is not a checkpoint
            w.release(xs[i - 1])
            xs[i - 1] = None
    recomputed: dict[int, str] = {}

    def value(i: int) -> str:
        if xs[i] is not None:
            return xs[i]
        if i not in recomputed:  # rebuild the whole segment from its checkpoint
            start = (i - 1) // k * k + 1
            prev = xs[start - 1]
            for j in range(start, min(start + k - 1, n)):
                prev = recomputed[j] = w.op("x", [prev])
        return recomputed.pop(i)

    _backward(w, xs, value)
    return w.write(path)


class _Reversal:
    """Griewank's recurrence, tabulated: cost[s][l] = fewest forward recomputations to
    reverse l steps holding the start state plus s more checkpoints; split[s][l] = the
    best first checkpoint position. O(n^2 s) time, fine for the chains benchmarked."""

    def __init__(self, n: int, slots: int):
        self.cost = [[0] * (n + 1) for _ in range(slots + 1)]
        self.split = [[0] * (n + 1) for _ in range(slots + 1)]
        for length in range(2, n + 1):
            self.cost[0][length] = length * (length - 1) // 2
        for s in range(1, slots + 1):
            cs, prev = self.cost[s], self.cost[s - 1]
            for length in range(2, n + 1):
                best, arg = None, 1
                for m in range(1, length):
                    c = m + prev[length - m] + cs[m]
                    if best is None or c < best:
                        best, arg = c, m
                cs[length], self.split[s][length] = best, arg


def binomial(n: int, path: str, slots: int, nbytes: int = 1 << 20, cost: float = 1.0) -> str:
    """Optimal reversal with `slots` checkpoints besides x0 (Revolve's schedule): the
    forward pass itself stores the checkpoints of the first splits."""
    w = _Writer(nbytes, cost)
    x0 = w.op("x", [])
    table = _Reversal(n, slots)
    g = _sweep(w, table, x0, 0, n, slots, n)
    w.release(g)
    w.release(x0)
    return w.write(path)


def _advance(w: _Writer, start: str, steps: int) -> str:
    x = start
    for _ in range(steps):
        x2 = w.op("x", [x])
        if x is not start:
            w.release(x)
        x = x2
    return x


def _sweep(w: _Writer, table: _Reversal, start: str, lo: int, hi: int, slots: int, n: int) -> str:
    """First computation of x_{lo+1..hi} (the forward pass), keeping checkpoints at the
    optimal splits, then the backward down to g_lo; returns g_lo."""
    length = hi - lo
    if length == 1 or slots == 0:
        x = _advance(w, start, length)
        if hi == n:
            w.backward()
        g = w.op("g", [x])  # the loss gradient at x_n
        if x is not start:
            w.release(x)
        return _reverse(w, table, start, lo, hi, slots, g) if length > 1 else _step(w, g, start)
    m = table.split[slots][length]
    x = _advance(w, start, m)
    g = _sweep(w, table, x, lo + m, hi, slots - 1, n)
    w.release(x)
    return _reverse(w, table, start, lo, lo + m, slots, g)


def _step(w: _Writer, g: str, x: str) -> str:
    g2 = w.op("g", [g, x])
    w.release(g)
    return g2


def _reverse(w: _Writer, table: _Reversal, start: str, lo: int, hi: int, slots: int, g: str) -> str:
    """Run the backward of steps lo+1 .. hi, given x_lo (start) and g_hi; returns g_lo."""
    length = hi - lo
    if length == 1:
        g2 = w.op("g", [g, start])
        w.release(g)
        return g2
    if slots == 0:  # rebuild from the start for each step, last first
        for i in range(hi, lo, -1):
            x = start
            for _ in range(lo, i - 1):
                x2 = w.op("x", [x])
                if x is not start:
                    w.release(x)
                x = x2
            g2 = w.op("g", [g, x])
            w.release(g)
            if x is not start:
                w.release(x)
            g = g2
        return g
    m = table.split[slots][length]
    x = start
    for _ in range(m):  # advance to the split, keep it as a checkpoint
        x2 = w.op("x", [x])
        if x is not start:
            w.release(x)
        x = x2
    g = _reverse(w, table, x, lo + m, hi, slots - 1, g)
    w.release(x)
    return _reverse(w, table, start, lo, lo + m, slots, g)

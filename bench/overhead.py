"""Per-op overhead: microseconds dtr adds to an op, and where they go.

For small ops (64x64 add, matmul, relu, a view, an in-place add) on managed tensors:
eager time per op, dtr's with no budget and under a budget (a budget is checked at every
op boundary; here nothing is evicted, so this is the price of the check), and dtr's
Python path (Runtime.handle, what the C++ fast path stands in for), side by side in one
process, medians of several repeats. Then the add through each layer of the Python
route without dtr's bookkeeping (a no-op dispatch mode, a no-op wrapper subclass): the
floor of any design that keeps Python dispatch. Then a cProfile split of dtr's add
(it cannot see into the C++ fast path: the bookkeeping there and the kernel it calls are
charged to the dispatch handler). Then a full training step of each bench model with no
budget against eager, on the fast path and on the Python path. Writes
bench/results/overhead.csv.

    python -m bench.overhead            # about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dtr
import dtr.runtime

from .common import RESULTS, print_table, timed_steps, write_csv

SMALL_OPS = {
    "add 64x64": lambda x, w: x + w,
    "matmul 64x64": lambda x, w: x @ w,
    "relu 64x64": lambda x, w: torch.relu(x),
    "view": lambda x, w: x.view(-1),
    "in-place add_": lambda x, w: x.add_(w),
}


@contextlib.contextmanager
def python_path(on: bool = True):
    """Sessions started inside serve every op through Runtime.handle (dtr's Python
    path) instead of the C++ fast path: the two side by side."""
    saved = dtr.runtime.FAST_PATH
    if on:
        dtr.runtime.FAST_PATH = False
    try:
        yield
    finally:
        dtr.runtime.FAST_PATH = saved


def _per_op_us(fn, x, w, n: int, repeats: int) -> float:
    """Median over repeats of the mean time of n calls, in microseconds."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn(x, w)
        samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples)


def _inputs(in_place: bool):
    """64x64 operands, x an op's output that requires grad (as in a training step: under
    dtr a managed value, so every op on it is recorded; eager and dtr both pay
    autograd); for an in-place op, x is detached (autograd refuses some in-place writes)."""
    torch.manual_seed(0)
    leaf = torch.randn(64, 64, requires_grad=True)
    x = leaf * 1
    return (x.detach() * 1 if in_place else x), torch.randn(64, 64)


def small_ops(n: int, repeats: int) -> list[dict]:
    rows = []
    for name, fn in SMALL_OPS.items():
        in_place = name.startswith("in-place")
        eager = _per_op_us(fn, *_inputs(in_place), n, repeats)
        timings = {}
        for label, budget, fast in (
            ("no budget", None, True),
            ("budget", "1GiB", True),
            ("python path", None, False),
        ):
            with python_path(not fast), dtr.enable(budget=budget):
                timings[label] = _per_op_us(fn, *_inputs(in_place), n, repeats)
        rows.append(
            dict(
                op=name,
                eager_us=eager,
                dtr_us=timings["no budget"],
                added_us=timings["no budget"] - eager,
                ratio=timings["no budget"] / eager,
                budget_us=timings["budget"],
                budget_added_us=timings["budget"] - eager,
                python_us=timings["python path"],
            )
        )
    return rows


class _NoopMode(TorchDispatchMode):
    """A dispatch mode that only runs the op: the Python route's price without dtr."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as dtr's own mode (no per-op torch._disable_dynamo wrapper)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Wrapper(torch.Tensor):
    """A wrapper subclass that unwraps, runs the op and wraps the result: the least any
    wrapper-tensor design pays per op in Python."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner, requires_grad=False):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            dtype=inner.dtype,
            device=inner.device,
            requires_grad=requires_grad,
        )
        t.inner = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        vals = [t.inner if isinstance(t, _Wrapper) else t for t in args]
        out = func(*vals, **(kwargs or {}))
        return _Wrapper(out) if isinstance(out, torch.Tensor) else out


def floors(n: int, repeats: int) -> list[dict]:
    """What a 64x64 add costs through each layer of the Python route, without dtr's
    bookkeeping: the floor any design that keeps Python dispatch cannot go below."""
    fn = SMALL_OPS["add 64x64"]
    x, w = _inputs(False)
    rows = [dict(route="eager", us=_per_op_us(fn, x, w, n, repeats))]
    with _NoopMode():
        rows.append(dict(route="no-op dispatch mode", us=_per_op_us(fn, x, w, n, repeats)))
    leaf = _Wrapper(torch.randn(64, 64), requires_grad=True)
    rows.append(dict(route="no-op wrapper subclass", us=_per_op_us(fn, leaf * 1, w, n, repeats)))
    with python_path(), dtr.enable():
        rows.append(dict(route="dtr, Python path", us=_per_op_us(fn, *_inputs(False), n, repeats)))
    with dtr.enable():
        us = _per_op_us(fn, *_inputs(False), n, repeats)
        rows.append(dict(route="dtr, C++ fast path", us=us))
    return rows


def _category(func: tuple) -> str:
    filename, _, name = func
    if filename.endswith("session.py"):
        # the mode's handler: cProfile charges it the C++ fast path it calls (and the
        # kernel and victim search the fast path runs), a call it does not see into
        return "dispatch handler and C++ fast path (kernel included)"
    if "make_room" in name or "evict" in name:
        return "victim search"
    if "dtr._C" in name or "_pycore" in filename or "Core" in name:
        return "core calls"
    if os.sep + "dtr" + os.sep in filename:
        return "dtr Python (dispatch, bookkeeping)"
    return "kernel and PyTorch"


def breakdown(n: int) -> list[dict]:
    """Where the time of a managed 64x64 add goes: cProfile's tottime per category, per
    op (profiling inflates Python's share, so read it as proportions)."""
    fn = SMALL_OPS["add 64x64"]
    with dtr.enable(budget="1GiB"):
        x, w = _inputs(False)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn(x, w)
        prof.disable()
    stats = pstats.Stats(prof)
    totals: dict[str, float] = {}
    for func, (_, _, tottime, _, _) in stats.stats.items():
        key = _category(func)
        totals[key] = totals.get(key, 0.0) + tottime
    whole = sum(totals.values())
    return [
        dict(part=k, us_per_op=v / n * 1e6, share=v / whole)
        for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
    ]


def steps(models: list[str], n: int) -> list[dict]:
    rows = []
    for name in models:
        eager = timed_steps(name, 1, n, 2, None)
        free = timed_steps(name, 1, n, 2, {})
        with python_path():
            slow = timed_steps(name, 1, n, 2, {})
        rows.append(
            dict(
                model=name,
                eager_ms=eager.median * 1e3,
                dtr_ms=free.median * 1e3,
                ratio=free.median / eager.median,
                python_ratio=slow.median / eager.median,
                ops=free.stats.ops // (n + 2),
                added_us_per_op=(free.median - eager.median) / (free.stats.ops / (n + 2)) * 1e6,
            )
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn", "lstm", "transformer", "tree"]
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # small ops: thread start-up would dominate and add noise

    ops = small_ops(args.n, args.repeats)
    header = [
        "op",
        "eager us",
        "dtr us",
        "added us",
        "ratio",
        "under budget us",
        "added us",
        "Python path us",
    ]
    print("\nsmall ops on managed tensors (median of repeats; one thread)")
    table = [
        [
            r["op"],
            f"{r['eager_us']:.1f}",
            f"{r['dtr_us']:.1f}",
            f"{r['added_us']:.1f}",
            f"{r['ratio']:.1f}x",
            f"{r['budget_us']:.1f}",
            f"{r['budget_added_us']:.1f}",
            f"{r['python_us']:.1f}",
        ]
        for r in ops
    ]
    print_table(header, table)

    floor_rows = floors(args.n, args.repeats)
    print("\na managed 64x64 add through each layer of the Python route (medians; one thread)")
    print_table(["route", "us per op"], [[r["route"], f"{r['us']:.1f}"] for r in floor_rows])

    parts = breakdown(args.n)
    print("\nwhere a managed 64x64 add's time goes (cProfile tottime; profiling inflates Python)")
    print_table(
        ["part", "us per op", "share"],
        [[p["part"], f"{p['us_per_op']:.1f}", f"{p['share']:.0%}"] for p in parts],
    )

    model_rows = steps(args.models, args.steps)
    print("\ntraining steps (test-size models, Adam), no budget vs eager")
    print_table(
        ["model", "eager ms", "dtr ms", "ratio", "Python path ratio", "ops/step", "added us/op"],
        [
            [
                r["model"],
                f"{r['eager_ms']:.1f}",
                f"{r['dtr_ms']:.1f}",
                f"{r['ratio']:.2f}x",
                f"{r['python_ratio']:.2f}x",
                r["ops"],
                f"{r['added_us_per_op']:.1f}",
            ]
            for r in model_rows
        ],
    )

    path = os.path.join(RESULTS, "overhead.csv")
    rows = [["small_op", r["op"], "eager_us", r["eager_us"]] for r in ops]
    rows += [["small_op", r["op"], "dtr_us", r["dtr_us"]] for r in ops]
    rows += [["small_op", r["op"], "budget_us", r["budget_us"]] for r in ops]
    rows += [["small_op", r["op"], "python_path_us", r["python_us"]] for r in ops]
    rows += [["floor", r["route"], "us_per_op", r["us"]] for r in floor_rows]
    rows += [["breakdown", p["part"], "us_per_op", p["us_per_op"]] for p in parts]
    rows += [["step", r["model"], "eager_ms", r["eager_ms"]] for r in model_rows]
    rows += [["step", r["model"], "dtr_ms", r["dtr_ms"]] for r in model_rows]
    rows += [["step", r["model"], "python_path_ratio", r["python_ratio"]] for r in model_rows]
    write_csv(path, ["kind", "name", "metric", "value"], [[*r[:3], f"{r[3]:.4g}"] for r in rows])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

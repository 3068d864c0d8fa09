"""Per-op overhead: microseconds dtr adds to an op, and where they go.

For small ops (64x64 add, matmul, relu, a view, an in-place add) on managed tensors:
eager time per op, the subclass engine's (``dtr.enable(engine="subclass")``: a Python
dispatch mode and wrapper subclass with a C++ fast path) with no budget and under a
budget (a budget is checked at every op boundary; here nothing is evicted, so this is
the price of the check), its Python path (Runtime.handle, what the C++ fast path stands
in for), and the native engine (dtr.engines.native.session, what dtr.enable() runs on a CPU-only
machine), side by side in one process, medians of several repeats. Then the
add through each layer of the Python route without dtr's bookkeeping (a no-op dispatch
mode, a no-op wrapper subclass): the floor of any design that keeps Python dispatch.
Then a cProfile split of dtr's add (it cannot see into the C++ fast path: the
bookkeeping there and the kernel it calls are charged to the dispatch handler). Then a
full training step of each bench model at its bench scale with no budget: eager, under a
dispatch mode that only runs each op (the floor of any design that sees ops through a
mode), under the subclass engine, on its Python path and under the native engine, rounds
interleaved. Writes
bench/results/overhead.csv.

    python -m bench.overhead            # about two minutes
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import math
import os
import pstats
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dtr
import dtr.engines.native.session
import dtr.engines.subclass.runtime

from .common import BENCH_SCALE, RESULTS, print_table, write_csv
from .harness import make_optimizer
from .models import MODELS, batches, build

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
    saved = dtr.engines.subclass.runtime.FAST_PATH
    if on:
        dtr.engines.subclass.runtime.FAST_PATH = False
    try:
        yield
    finally:
        dtr.engines.subclass.runtime.FAST_PATH = saved


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
            with python_path(not fast), dtr.enable(budget=budget, engine="subclass"):
                timings[label] = _per_op_us(fn, *_inputs(in_place), n, repeats)
        try:  # the native engine (dtr.engines.native.session): no Python per op
            with dtr.enable(engine="native"):
                timings["native"] = _per_op_us(fn, *_inputs(in_place), n, repeats)
        except NotImplementedError:
            timings["native"] = math.nan  # an op the engine does not serve yet
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
                native_us=timings["native"],
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
    with python_path(), dtr.enable(engine="subclass"):
        rows.append(dict(route="dtr, Python path", us=_per_op_us(fn, *_inputs(False), n, repeats)))
    with dtr.enable(engine="subclass"):
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
    if "dtr._C" in name or filename.endswith(os.path.join("core", "reference.py")) or "Core" in name:
        return "core calls"
    if os.sep + "dtr" + os.sep in filename:
        return "dtr Python (dispatch, bookkeeping)"
    return "kernel and PyTorch"


def breakdown(n: int) -> list[dict]:
    """Where the time of a managed 64x64 add goes on the subclass engine: cProfile's
    tottime per category, per op (profiling inflates Python's share, so read it as
    proportions; the native engine runs no Python per op)."""
    fn = SMALL_OPS["add 64x64"]
    with dtr.enable(budget="1GiB", engine="subclass"):
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


def _step_contexts() -> dict:
    """What a training step runs under, in the order each round times them."""
    return {
        "eager": contextlib.nullcontext,
        "no-op mode": _NoopMode,
        "dtr": functools.partial(dtr.enable, engine="subclass"),
        "dtr, Python path": _python_path_session,
        "native": functools.partial(dtr.enable, engine="native"),
    }


@contextlib.contextmanager
def _python_path_session():
    with python_path(), dtr.enable(engine="subclass") as session:
        yield session


def steps(models: list[str], n: int, rounds: int, scale: int | None = None) -> list[dict]:
    """A training step of each bench model (at its bench scale unless `scale`), with no
    budget, under each of _step_contexts(): one model, optimizer and list of batches, the
    contexts timed in turn in each of `rounds` rounds (n steps on n batches after one
    untimed step, CPU time of the process), medians over the rounds. The no-op dispatch
    mode is the floor of any design that sees ops through a dispatch mode: besides its
    per-op price, autograd accumulates gradients out of place whenever a mode is active
    (isTensorSubclassLike), and more memory traffic follows."""
    rows = []
    for name in models:
        spec = MODELS[name]
        model = build(name, scale=scale or BENCH_SCALE[name])
        opt = make_optimizer("adam", model.parameters())
        # a batch per step (the tree model's shape, and so its ops, differ between batches)
        data = batches(name, n + 1, scale=scale or BENCH_SCALE[name])
        times: dict[str, list[float]] = {k: [] for k in _step_contexts()}
        ops = 0
        for _ in range(rounds):
            for kind, context in _step_contexts().items():
                with context() as session:
                    _train_step(spec, model, opt, data[0])
                    start = time.process_time()
                    for batch in data[1:]:
                        _train_step(spec, model, opt, batch)
                    times[kind].append((time.process_time() - start) / n)
                    if kind == "dtr":
                        ops = session.stats().ops // (n + 1)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append(
            dict(
                model=name,
                scale=scale or BENCH_SCALE[name],
                eager_ms=ms["eager"],
                mode_ms=ms["no-op mode"],
                dtr_ms=ms["dtr"],
                python_ms=ms["dtr, Python path"],
                native_ms=ms["native"],
                ops=ops,
            )
        )
    return rows


def _train_step(spec, model, opt, batch) -> None:
    loss = spec.loss(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed training steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the step comparison")
    parser.add_argument("--scale", type=int, default=0, help="model scale (0: bench default)")
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn", "lstm", "transformer", "tree"]
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # small ops: thread start-up would dominate and add noise

    ops = small_ops(args.n, args.repeats)
    header = [
        "op",
        "eager us",
        "subclass us",
        "added us",
        "ratio",
        "under budget us",
        "added us",
        "Python path us",
        "native us",
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
            "refused" if math.isnan(r["native_us"]) else f"{r['native_us']:.1f}",
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

    model_rows = steps(args.models, args.steps, args.rounds, args.scale or None)
    print(
        "\ntraining steps (bench-scale models, Adam, one thread), no budget: eager, a dispatch"
        "\nmode that only runs each op (the floor of any design that sees ops through a mode),"
        "\nthe subclass engine (dtr), its Python path, and the native engine; CPU time, medians"
        "\nof rounds run side by side"
    )
    print_table(
        [
            "model (scale)",
            "eager ms",
            "no-op mode",
            "subclass",
            "subclass / no-op mode",
            "Python path",
            "native",
            "ops/step",
        ],
        [
            [
                f"{r['model']} ({r['scale']})",
                f"{r['eager_ms']:.1f}",
                f"{r['mode_ms'] / r['eager_ms']:.3f}x",
                f"{r['dtr_ms'] / r['eager_ms']:.3f}x",
                f"{r['dtr_ms'] / r['mode_ms']:.3f}x",
                f"{r['python_ms'] / r['eager_ms']:.3f}x",
                f"{r['native_ms'] / r['eager_ms']:.3f}x",
                r["ops"],
            ]
            for r in model_rows
        ],
    )

    path = os.path.join(RESULTS, "overhead.csv")
    rows = [["small_op", r["op"], "eager_us", r["eager_us"]] for r in ops]
    rows += [["small_op", r["op"], "dtr_us", r["dtr_us"]] for r in ops]
    rows += [["small_op", r["op"], "budget_us", r["budget_us"]] for r in ops]
    rows += [["small_op", r["op"], "python_path_us", r["python_us"]] for r in ops]
    rows += [["small_op", r["op"], "native_us", r["native_us"]] for r in ops]
    rows += [["floor", r["route"], "us_per_op", r["us"]] for r in floor_rows]
    rows += [["breakdown", p["part"], "us_per_op", p["us_per_op"]] for p in parts]
    for key in ("eager_ms", "mode_ms", "dtr_ms", "python_ms", "native_ms", "ops"):
        rows += [["step", r["model"], key, r[key]] for r in model_rows]
    write_csv(path, ["kind", "name", "metric", "value"], [[*r[:3], f"{r[3]:.4g}"] for r in rows])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

"""DTR against static checkpointing at equal memory.

For each bench model, in one process, with the same Adam training loop, data and
intra-op thread count (``--threads``, default 1, set once for every method):

- **eager** PyTorch: step time and peak memory;
- **checkpoint**: ``torch.utils.checkpoint`` (non-reentrant) on Chen et al.'s (2016)
  sqrt(n) segments of the model's n repeated blocks, and per block (n segments);
- **compile**: ``torch.compile`` (inductor) with
  ``torch._functorch.config.activation_memory_budget`` at each of ``--compile-budgets``,
  compiled in a warm-up step outside the timed ones;
- **dtr** with no budget; at fractions ``--ratios`` of the eager peak, down to the first
  that raises ``dtr.BudgetError`` (recorded as infeasible): the smallest feasible budget;
  and at the peak each static point reached: ``dtr.enable(budget=that peak)``, then, as
  long as no dtr run has landed just below that peak, up to ``--calibrate`` budgets
  interpolated from the (budget, measured peak) pairs seen so far. (dtr's budget does
  not cover gradients, optimizer state, or the outputs and workspaces of the op that is
  running, all of which the measure below sees, so its measured peak is above its
  budget.) "dtr at a static point's memory" is then, of the dtr runs whose measured peak
  is at or below that point's (within 0.5%), the one with the largest budget, whichever
  setting produced it (not the fastest of them: one noisy timing each could decide
  that).
- **confirm**: each static point and that dtr run are timed again ``--confirm`` times
  each (default 3), alternately, and the ratio of the two medians decides the 1.1x
  target: one run against another measured minutes apart would take the machine's
  drift for a difference (the "again" column of the targets table).

Step time is the median of ``--steps`` steps after ``--warmup`` steps, in CPU time of
the process (``time.process_time``; wall time is in the CSV too). With one intra-op
thread the two agree on an idle machine, but CPU time is less inflated by other
processes on a shared one (all of a step's work is on the CPU, in this process; they
still compete for caches and memory bandwidth). Eager runs once more after the other
methods, as a measure of how much the machine's speed drifted meanwhile. Memory is one
independent measure for every method, dtr included: torch.profiler's allocation events
over one more training step after the timed ones (the mechanism of
``bench.common.eager_peak_bytes``: the largest sum of allocations minus frees), plus the
parameters, optimizer state and batch that exist before that step. dtr's own counters
(``peak_resident_bytes`` of the profiled step; evictions and recomputations summed over
all warmup + steps + 1 steps of the run) are reported beside it, never used for the
comparison.

Static checkpointing is applied here, by wrapping the blocks of the models in
``bench.models`` (their classes are untouched; ``static_loss``). Each wrapped forward
runs the same ops in the same order as the model's own, so losses and gradients are
bitwise equal to eager (``tests/bench/test_vs_static.py``):

- cnn: the stem and the five residual blocks (n = 6) run as a sequence in
  ``checkpoint_sequential``'s schedule (the last segment is not checkpointed). It is
  written out rather than calling ``checkpoint_sequential`` because that passes no
  ``context_fn``: the recomputation here runs with BatchNorm's running statistics swapped
  for copies, so they are updated once per forward, as in eager.
- transformer: ``checkpoint_sequential`` over the four encoder layers (n = 4); the
  embedding and output layer run plainly.
- lstm: ``nn.LSTM``'s four layers run one at a time (``torch._VF.lstm`` with each
  layer's weights and the inter-layer dropout between them, what ``nn.LSTM`` does inside
  one call) under ``checkpoint_sequential`` (n = 4). Time steps are not segmented: that
  would change the order of the dropout draws and the shapes of the input projections,
  so it would no longer be the same computation as eager.
- mlp (not in the default set): ``checkpoint_sequential`` over the ten
  Linear-ReLU-Dropout blocks.
- tree (data-dependent recursion): "per block" checkpoints every cell call (a leaf's
  ``tanh(leaf(x))``, and a node's concatenation, combine layer, gate and optional extra
  layer); "sqrt(n)" checkpoints each largest subtree with at most ceil(sqrt(leaves))
  leaves as a whole (its split decisions are recomputed with it) and keeps the nodes
  above them.

sqrt(n) segments is round(sqrt(n)) segments of n // segments blocks (the last segment
taking the rest), as ``checkpoint_sequential`` splits them.

torch.compile: nn.LSTM is a graph break under dynamo's defaults (``allow_rnn=False``), so
the compiled LSTM model runs the LSTM itself eagerly and the memory budget only reaches
the embedding and output layers (the row says so). The tree model is not compiled: each
node's ``.item()`` breaks the graph, so at test size a step is 18 graphs of a few ops
around 22 graph breaks, and the node function hits dynamo's recompile limit (8, one
recompilation per number of leaves) and runs eagerly from then on; there is no
model-sized graph for the partitioner to budget (the row gives the reason).

What the measure shows about torch.compile here: its activation memory budget barely
lowers the peak. The whole model is one graph, and the compiled backward recomputes what
the forward did not save and holds it together: at the CNN's peak at budget 0.05, 72 MiB
of convolution outputs recomputed by the backward graph are alive at once.

On a GPU (``--device cuda``) step time is wall time between two synchronizations, and
memory the caching allocator's ``max_memory_allocated`` over the profiled step, less
what was allocated before the model existed (the same things, counted by the
allocator); results go to bench/results/gpu/.

    python -m bench.vs_static                      # the four models (6-10 minutes)
    python -m bench.vs_static --quick              # test-size models, no compile
    python -m bench.vs_static --models cnn --steps 9 --compile-budgets 1.0 0.5 0.2 0.05
    python -m bench.vs_static --device cuda --models transformer cnn

Results: bench/results/vs_static.csv (every run), vs_static.targets.csv (dtr at each
static point's memory), vs_static.lowest.csv (the lowest memory each reached) and
vs_static.png (step time against peak memory, one curve per method, one panel per model).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import dtr
import dtr.engines.native.session
from dtr.plot import step_time_vs_memory

from .common import (
    BENCH_SCALE,
    RESULTS,
    allocated_base,
    mib,
    print_table,
    step_peak_bytes,
    write_csv,
)
from .harness import make_optimizer, to_device
from .models import MODELS, batches, build

DEFAULT_MODELS = ["cnn", "transformer", "lstm", "tree"]
COMPILE_BUDGETS = (1.0, 0.05)
RATIOS = (0.8, 0.6, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05)
TARGET = 1.1  # dtr's step time at equal memory, over the static method's
TOLERANCE = 0.005  # a peak this much above a static point's still counts as equal memory
CLOSE = 0.03  # calibration stops once a dtr run lands this close below a static peak
NOT_COMPILED = {
    "tree": "not compiled: every node's .item() breaks the graph (at scale 1: 22 breaks, "
    "18 graphs of a few ops, then dynamo's recompile limit runs the rest eagerly), so the "
    "partitioner has no model-sized graph to budget",
}
PARTIAL_COMPILE = {
    "lstm": "nn.LSTM is a graph break (dynamo allow_rnn=False): it runs eagerly, the budget "
    "reaches only the embedding and output layers",
}
STATIC = ("checkpoint", "compile")


# --- static checkpointing -----------------------------------------------------------------


def _ckpt(fn, *args, **kwargs):
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _chain(fns):
    def run(x):
        for f in fns:
            x = f(x)
        return x

    return run


class _SpareRunningStats:
    """Recomputation context: BatchNorm layers update copies of their running statistics,
    so that the real ones change once per forward, as in eager."""

    def __init__(self, modules):
        self.bns = [
            m
            for mod in modules
            for m in mod.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        self.saved = []

    def __enter__(self):
        for bn in self.bns:
            self.saved.append((bn, dict(bn._buffers)))
            for key, buf in bn._buffers.items():
                if buf is not None:
                    setattr(bn, key, buf.clone())

    def __exit__(self, *exc):
        for bn, buffers in self.saved:
            for key, buf in buffers.items():
                setattr(bn, key, buf)
        self.saved.clear()
        return False


def sequential(fns: list, segments: int, x: torch.Tensor) -> torch.Tensor:
    """fns(x) in checkpoint_sequential's schedule: `segments` segments of len // segments
    blocks, every one but the last checkpointed (non-reentrant). Blocks with BatchNorm
    recompute with copies of its running statistics (checkpoint_sequential itself takes
    no context_fn)."""
    if not any(
        isinstance(m, nn.modules.batchnorm._BatchNorm)
        for f in fns
        if isinstance(f, nn.Module)
        for m in f.modules()
    ):
        return checkpoint_sequential(fns, segments, x, use_reentrant=False)
    size = len(fns) // segments
    end = 0
    for start in range(0, size * (segments - 1), size):
        end = start + size
        part = fns[start:end]
        x = _ckpt(
            _chain(part),
            x,
            context_fn=lambda part=part: (contextlib.nullcontext(), _SpareRunningStats(part)),
        )
    return _chain(fns[end:])(x)


def _segments(n: int, mode: str) -> int:
    return n if mode == "block" else max(1, round(math.sqrt(n)))


def _blocks(name: str, model: nn.Module) -> list:
    """The repeated blocks of a sequential bench model, in order."""
    if name == "cnn":
        return [model.stem, *model.blocks]
    if name == "transformer":
        return list(model.encoder.layers)
    if name == "mlp":
        body = list(model.body)
        return [nn.Sequential(*body[i : i + 3]) for i in range(0, len(body), 3)]
    if name == "lstm":
        lstm = model.lstm
        layers = []
        for i in range(lstm.num_layers):
            weights = [
                getattr(lstm, f"{kind}_l{i}")
                for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
            ]

            def layer(x, weights=weights, last=i == lstm.num_layers - 1):
                zeros = torch.zeros(1, x.shape[0], lstm.hidden_size, dtype=x.dtype, device=x.device)
                # what nn.LSTM's single call does per layer (ATen's apply_layer_stack):
                # the layer, then dropout on its output unless it is the last
                out = torch._VF.lstm(
                    x, (zeros, zeros.clone()), weights, True, 1, 0.0, lstm.training, False, True
                )[0]
                if not last and lstm.dropout and lstm.training:
                    out = torch.dropout(out, lstm.dropout, True)
                return out

            layers.append(layer)
        return layers
    raise ValueError(f"no static checkpointing for {name!r}")


def n_blocks(name: str) -> int:
    """n: the number of repeated blocks (the tree model: its leaves)."""
    if name == "tree":
        return batches("tree", 1)[0][0].shape[0]
    return len(_blocks(name, build(name)))


def _tree_forward(model, tokens: torch.Tensor, mode: str) -> torch.Tensor:
    """TreeNet.forward with every cell (mode "block") or every largest subtree of at most
    ceil(sqrt(leaves)) leaves (mode "sqrt") checkpointed; the same ops in the same order."""
    leaves = [model.embed(t) for t in tokens]
    small = math.ceil(math.sqrt(len(leaves)))

    def leaf(x):
        return torch.tanh(model.leaf(x))

    def cell(left, right):
        h = torch.cat([left, right], dim=-1)
        h = torch.tanh(model.combine(h))
        if model.gate(h).mean().item() > 0:
            h = h + torch.relu(model.extra(h))
        return h

    def node(xs: list, ckpt_cells: bool, whole: bool) -> torch.Tensor:
        n = len(xs)
        if whole and n <= small:
            return _ckpt(lambda *ys: node(list(ys), False, False), *xs)
        if n == 1:
            return _ckpt(leaf, xs[0]) if ckpt_cells else leaf(xs[0])
        probe = torch.stack([x[0, 0] for x in xs]).abs().sum()
        split = 1 + int(probe.item() * 1000) % (n - 1)
        left = node(xs[:split], ckpt_cells, whole)
        right = node(xs[split:], ckpt_cells, whole)
        return _ckpt(cell, left, right) if ckpt_cells else cell(left, right)

    root = node(leaves, mode == "block", mode == "sqrt")
    return model.head(root)


def static_forward(name: str, model: nn.Module, mode: str) -> Callable:
    """model.forward with static checkpointing: mode "sqrt" (sqrt(n) segments) or "block"
    (every block)."""
    if name == "tree":
        return lambda tokens: _tree_forward(model, tokens, mode)
    blocks = _blocks(name, model)
    segments = _segments(len(blocks), mode)
    if name == "cnn":

        def forward(x):
            h = sequential(blocks, segments, x)
            return model.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))

    elif name == "transformer":

        def forward(tokens):
            h = model.embed(tokens) + model.pos[: tokens.shape[1]]
            return model.out(sequential(blocks, segments, h))

    elif name == "lstm":

        def forward(tokens):
            h = sequential(blocks, segments, model.drop(model.embed(tokens)))
            return model.out(model.drop(h))

    elif name == "mlp":

        def forward(x):
            return model.head(sequential(blocks, segments, x))

    return forward


class _Forward(nn.Module):
    """A model whose forward is another function; bench.models' losses call model(x)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def static_loss(name: str, model: nn.Module, mode: str) -> Callable:
    """batch -> loss: MODELS[name].loss with static_forward in place of model.forward."""
    wrapped = _Forward(static_forward(name, model, mode))
    return lambda batch: MODELS[name].loss(wrapped, batch)


def _static_setting(name: str, mode: str) -> str:
    n = n_blocks(name)
    if name == "tree":
        if mode == "block":
            return f"per cell ({n} leaves)"
        return f"subtrees <= {math.ceil(math.sqrt(n))} leaves ({n} leaves)"
    segments = _segments(n, mode)
    return f"per block (n={n})" if mode == "block" else f"sqrt(n): {segments} of n={n}"


# --- one measured run ---------------------------------------------------------------------


def _step(loss_fn, batch, opt) -> None:
    loss = loss_fn(batch)
    loss.backward()
    opt.step()
    opt.zero_grad()


def measure(
    name: str,
    scale: int,
    steps: int,
    warmup: int,
    make_loss: Callable[[nn.Module], Callable],
    dtr_kwargs: dict | None = None,
    context=None,
    optimizer: str = "adam",
    device: str = "cpu",
    engine: str = "subclass",
) -> dict:
    """Train warmup + steps steps with make_loss(model) as batch -> loss (under
    dtr.enable(engine=engine, **dtr_kwargs) unless None, and inside `context`), then one
    more step for the peak: on the CPU under torch.profiler (its allocation events, plus
    the state alive before the step), on CUDA the caching allocator's
    max_memory_allocated over what was allocated before the model existed (the same
    things, counted by the allocator).
    Returns step_s (median over the timed steps of the process's CPU time; on CUDA of the
    wall time between two synchronizations, since the kernels run asynchronously), wall_s
    (median wall time), first_s (wall time of the first step: compilation), peak (bytes),
    stats (dtr's) and status; a budget dtr cannot meet is status "infeasible", any other
    failure "error: ..."."""
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    base = allocated_base(device)
    model = build(name, scale=scale).to(device)
    opt = make_optimizer(optimizer, model.parameters())
    data = [to_device(b, device) for b in batches(name, warmup + steps + 1, scale=scale)]
    out = dict(step_s=math.nan, wall_s=math.nan, first_s=math.nan, peak=None, stats=None)
    out["status"] = "ok"
    try:
        loss_fn = make_loss(model)
        torch.manual_seed(0)
        cpu, wall = [], []
        session = None
        if dtr_kwargs is not None:
            session = dtr.enable(engine=engine, **dtr_kwargs)
        with context or contextlib.nullcontext(), session or contextlib.nullcontext():
            for i, batch in enumerate(data[:-1]):
                sync()
                start, start_cpu = time.perf_counter(), time.process_time()
                _step(loss_fn, batch, opt)
                sync()
                elapsed, elapsed_cpu = (
                    time.perf_counter() - start,
                    time.process_time() - start_cpu,
                )
                if i == 0:
                    out["first_s"] = elapsed
                if i >= warmup:
                    wall.append(elapsed)
                    cpu.append(elapsed_cpu)
            if session is not None:
                session.reset_peak()
            out["peak"] = step_peak_bytes(
                functools.partial(_step, loss_fn, data[-1], opt), model, opt, data[-1], device, base
            )
            if session is not None:
                out["stats"] = session.stats()
        out["step_s"] = statistics.median(wall if cuda else cpu)
        out["wall_s"] = statistics.median(wall)
    except dtr.BudgetError:
        out["status"] = "infeasible"
    except Exception as exc:  # a method that does not run is a row, not a crash
        out["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    del model, opt, data
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


# --- the comparison -----------------------------------------------------------------------


def _row(name, method, setting, res, eager_s=None, budget=None, note="", at=None) -> dict:
    stats = res.get("stats")
    return dict(
        model=name,
        method=method,
        setting=setting,
        budget=budget,
        peak=res.get("peak"),
        step_s=res.get("step_s", math.nan),
        wall_s=res.get("wall_s", math.nan),
        ratio=(res.get("step_s", math.nan) / eager_s) if eager_s else 1.0,
        first_s=res.get("first_s", math.nan),
        dtr_peak=None if stats is None else stats.peak_resident_bytes,
        evictions=None if stats is None else stats.evictions,
        remats=None if stats is None else stats.remats,
        status=res.get("status", "ok"),
        note=note,
        at=at,
    )


def _log(row: dict) -> None:
    if row["status"] == "ok":
        extra = "" if row["evictions"] is None else f", {row['remats']} remats"
        print(
            f"  {row['method']:>10} {row['setting']:<32} {mib(row['peak']):>8} MiB "
            f"{row['step_s'] * 1e3:9.1f} ms/step ({row['ratio']:.2f}x){extra}",
            flush=True,
        )
    else:
        print(f"  {row['method']:>10} {row['setting']:<32} {row['status']}", flush=True)


def compare(
    name: str,
    scale: int,
    steps: int = 5,
    warmup: int = 1,
    compile_budgets=COMPILE_BUDGETS,
    ratios=RATIOS,
    calibrate: int = 2,
    dtr_options: dict | None = None,
    backend: str = "inductor",
    optimizer: str = "adam",
    verbose: bool = True,
    device: str = "cpu",
    engine: str = "subclass",
    confirm: int = 0,
) -> list[dict]:
    """Every method on one model; one dict per run (see the module's docstring). With
    confirm > 0, each static point and dtr's run at its memory (_dtr_at) are then timed
    again `confirm` times each, alternately (stored in the static row as "confirm")."""
    spec = MODELS[name]
    dtr_options = dict(dtr_options or {})
    log = _log if verbose else (lambda row: None)
    rows: list[dict] = []

    def run(make_loss, **kwargs):
        return measure(
            name,
            scale,
            steps,
            warmup,
            make_loss,
            optimizer=optimizer,
            device=device,
            engine=engine,
            **kwargs,
        )

    def plain(model):
        return lambda batch: spec.loss(model, batch)

    eager = run(plain)
    if eager["status"] != "ok":
        raise RuntimeError(f"{name}: the eager run failed: {eager['status']}")
    eager_s, eager_peak = eager["step_s"], eager["peak"]
    rows.append(_row(name, "eager", "", eager))
    log(rows[-1])

    # each static method's loss maker and context, kept to run it again (confirm)
    again: dict[str, tuple[Callable, Callable]] = {}
    for mode in ("sqrt", "block"):
        make_loss = functools.partial(static_loss, name, mode=mode)
        res = run(make_loss)
        rows.append(_row(name, "checkpoint", _static_setting(name, mode), res, eager_s))
        log(rows[-1])
        again[f"checkpoint {rows[-1]['setting']}"] = (make_loss, contextlib.nullcontext)

    for b in compile_budgets:
        setting = f"budget {b:g}"
        if name in NOT_COMPILED:
            rows.append(
                _row(
                    name,
                    "compile",
                    setting,
                    dict(status="skipped"),
                    eager_s,
                    note=NOT_COMPILED[name],
                )
            )
            log(rows[-1])
            continue
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()

        def compiled(model):
            return torch.compile(plain(model), backend=backend)

        def budgeted(b=b):
            return torch._functorch.config.patch(activation_memory_budget=b)

        res = run(compiled, context=budgeted())
        graphs = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
        note = f"{graphs} graph(s), {breaks} break(s); compile+first step {res['first_s']:.0f} s"
        if name in PARTIAL_COMPILE:
            note += "; " + PARTIAL_COMPILE[name]
        rows.append(_row(name, "compile", setting, res, eager_s, note=note))
        log(rows[-1])
        again[f"compile {setting}"] = (compiled, budgeted)
    torch._dynamo.reset()

    def run_dtr(budget, setting, at=None):
        kwargs = dict(dtr_options)
        if budget is not None:
            kwargs["budget"] = int(budget)
        res = run(plain, dtr_kwargs=kwargs)
        rows.append(_row(name, "dtr", setting, res, eager_s, budget=budget, at=at))
        log(rows[-1])
        return rows[-1]

    free = run_dtr(None, "no budget")

    # below: fractions of the eager peak until infeasible (the smallest feasible budget)
    for ratio in ratios:
        got = run_dtr(ratio * eager_peak, f"{ratio:g} x eager peak")
        if got["status"] != "ok":
            break

    # at each static point's memory: budget = its peak; then, while no dtr run has landed
    # within CLOSE below it, budgets interpolated from the (budget, measured peak) pairs
    # seen so far (the measured peak is above the budget by what dtr does not count:
    # gradients, optimizer state, and the outputs and workspaces of the op running)
    for static in [r for r in rows if r["method"] in STATIC and r["status"] == "ok"]:
        label = f"{static['method']} {static['setting']}"
        target = static["peak"]
        if free["status"] == "ok" and fits(free["peak"], target):
            continue  # the unbudgeted run already fits: it is dtr at that memory
        run_dtr(target, f"@ {label}", label)
        for attempt in range(calibrate):
            done = [r for r in rows if r["method"] == "dtr" and r["status"] == "ok"]
            if any(fits(r["peak"], target) and r["peak"] >= (1 - CLOSE) * target for r in done):
                break
            tried = [r for r in rows if r["method"] == "dtr" and r["budget"] is not None]
            budget = _next_budget(tried, target)
            if budget is None:
                break
            run_dtr(budget, f"@ {label} (try {attempt + 2})", label)

    if confirm > 0:
        _confirm(rows, confirm, again, plain, run, dtr_options)

    # eager once more: how far the machine's speed drifted while the others ran
    rows.append(_row(name, "eager", "again, after the others", run(plain), eager_s))
    log(rows[-1])
    return rows


def _dtr_at(rows: list[dict], static: dict) -> dict | None:
    """dtr at a static point's memory: of this model's dtr runs whose measured peak is at
    or below the point's, the one with the largest budget (no budget counts as the
    largest), the fastest of those if several. Not the fastest of all that fit: one
    timing each, that choice would favour whichever run the machine's drift favoured."""
    at = [
        d
        for d in rows
        if d["model"] == static["model"]
        and d["method"] == "dtr"
        and d["status"] == "ok"
        and fits(d["peak"], static["peak"])
    ]
    if not at:
        return None
    return min(at, key=lambda d: (-(math.inf if d["budget"] is None else d["budget"]), d["step_s"]))


def _confirm(rows, repeats, again, plain, run, dtr_options) -> None:
    """Time each static point and dtr's run at its memory (_dtr_at) again, `repeats` times
    each, alternately (static, dtr, static, dtr, ...): the two medians are minutes apart
    at most, not a whole model's runs, so the machine's drift weighs on both alike."""
    for static in [r for r in rows if r["method"] in STATIC and r["status"] == "ok"]:
        best = _dtr_at(rows, static)
        if best is None:
            continue
        make_loss, context = again[f"{static['method']} {static['setting']}"]
        kwargs = dict(dtr_options)
        if best["budget"] is not None:
            kwargs["budget"] = int(best["budget"])
        times: dict[str, list[float]] = {"static": [], "dtr": []}
        for _ in range(repeats):
            torch._dynamo.reset()
            res = run(make_loss, context=context())
            dtr_res = run(plain, dtr_kwargs=kwargs)
            if res["status"] != "ok" or dtr_res["status"] != "ok":
                break
            times["static"].append(res["step_s"])
            times["dtr"].append(dtr_res["step_s"])
        else:
            static["confirm"] = dict(
                dtr_setting=best["setting"],
                static_s=statistics.median(times["static"]),
                dtr_s=statistics.median(times["dtr"]),
                repeats=repeats,
            )
            c = static["confirm"]
            print(
                f"  confirm {static['method']} {static['setting']} against dtr "
                f"{best['setting']}: medians of {repeats}, {c['static_s'] * 1e3:.1f} against "
                f"{c['dtr_s'] * 1e3:.1f} ms/step ({c['dtr_s'] / c['static_s']:.3f}x)",
                flush=True,
            )


def fits(peak: int, target: int) -> bool:
    """A measured peak at the target's memory: at or below it, within TOLERANCE."""
    return peak <= target * (1 + TOLERANCE)


def _next_budget(tried: list[dict], target: int) -> int | None:
    """A dtr budget whose measured peak should land just below target, interpolated
    between the runs that landed either side (slope 1 beyond them); None when it would
    repeat a budget already tried, or is not above one known to be infeasible."""
    aim = target * (1 - CLOSE / 3)
    ok = sorted((r["budget"], r["peak"]) for r in tried if r["status"] == "ok")
    bad = [r["budget"] for r in tried if r["status"] == "infeasible"]
    below = [(b, p) for b, p in ok if p <= aim]
    above = [(b, p) for b, p in ok if p > aim]
    if below and above:
        (b0, p0), (b1, p1) = max(below), min(above)
        if b1 > b0 and p1 > p0:
            budget = b0 + (aim - p0) * (b1 - b0) / (p1 - p0)
        else:
            budget = (b0 + b1) / 2
    elif above:
        b1, p1 = min(above)
        budget = b1 - (p1 - aim)
    elif below:
        b0, p0 = max(below)
        budget = b0 + (aim - p0)
    else:
        return None
    budget = int(budget)
    if budget <= 0 or any(abs(budget - b) < 4096 for b, _ in ok):
        return None
    if bad and budget <= max(bad):
        return None
    return budget


def targets(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(per static point: dtr's step time at its memory (_dtr_at), over the static
    method's; per model: dtr's smallest feasible peak against every static method's)."""
    points, lows = [], []
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name and r["status"] == "ok"]
        eager = next(r for r in mine if r["method"] == "eager")
        dtrs = [r for r in mine if r["method"] == "dtr"]
        statics = [r for r in mine if r["method"] in STATIC]
        for s in statics:
            best = _dtr_at(mine, s)
            rel = best["step_s"] / s["step_s"] if best else math.nan
            conf = s.get("confirm")
            confirmed = conf["dtr_s"] / conf["static_s"] if conf else math.nan
            points.append(
                dict(
                    model=name,
                    static=f"{s['method']} {s['setting']}",
                    static_peak=s["peak"],
                    static_ratio=s["ratio"],
                    dtr_peak=best["peak"] if best else None,
                    dtr_ratio=best["ratio"] if best else math.nan,
                    dtr_setting=best["setting"] if best else "none fits",
                    dtr_over_static=rel,
                    confirmed=confirmed,
                    # the alternating re-runs decide when there are any
                    met=bool(best) and (confirmed if conf else rel) <= TARGET,
                )
            )
        low_static = min(statics, key=lambda r: r["peak"]) if statics else None
        low_dtr = min(dtrs, key=lambda r: r["peak"]) if dtrs else None
        lows.append(
            dict(
                model=name,
                eager_peak=eager["peak"],
                static_min=low_static["peak"] if low_static else None,
                static_min_by=(
                    f"{low_static['method']} {low_static['setting']}" if low_static else "-"
                ),
                dtr_min=low_dtr["peak"] if low_dtr else None,
                dtr_min_setting=low_dtr["setting"] if low_dtr else "-",
                dtr_min_ratio=low_dtr["ratio"] if low_dtr else math.nan,
                met=bool(low_dtr and low_static) and low_dtr["peak"] < low_static["peak"],
            )
        )
    return points, lows


HEADER = [
    "model",
    "method",
    "setting",
    "budget_mib",
    "peak_mib",
    "ms_per_step",
    "x_eager",
    "wall_ms_per_step",
    "first_step_s",
    "dtr_peak_resident_mib",
    "evictions",
    "remats",
    "status",
    "note",
]


def _fmt(x, f="{:.3f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f.format(x)


def table(rows: list[dict]) -> list[list]:
    return [
        [
            r["model"],
            r["method"],
            r["setting"],
            "-" if r["budget"] is None else mib(r["budget"]),
            "-" if r["peak"] is None else mib(r["peak"]),
            _fmt(r["step_s"] * 1e3, "{:.1f}"),
            _fmt(r["ratio"]),
            _fmt(r["wall_s"] * 1e3, "{:.1f}"),
            _fmt(r["first_s"], "{:.1f}") if r["method"] == "compile" else "-",
            "-" if r["dtr_peak"] is None else mib(r["dtr_peak"]),
            _fmt(r["evictions"], "{}"),
            _fmt(r["remats"], "{}"),
            r["status"],
            r["note"],
        ]
        for r in rows
    ]


TARGET_HEADER = [
    "model",
    "static point",
    "static peak MiB",
    "static x eager",
    "dtr at <= that peak",
    "dtr peak MiB",
    "dtr x eager",
    "dtr / static",
    "again, medians",
    f"<= {TARGET}",
]
LOW_HEADER = [
    "model",
    "eager peak MiB",
    "lowest static peak MiB",
    "by",
    "lowest dtr peak MiB",
    "dtr setting",
    "dtr x eager",
    "dtr lower",
]


def target_tables(rows: list[dict]) -> tuple[list[list], list[list]]:
    points, lows = targets(rows)
    a = [
        [
            p["model"],
            p["static"],
            mib(p["static_peak"]),
            _fmt(p["static_ratio"]),
            p["dtr_setting"],
            "-" if p["dtr_peak"] is None else mib(p["dtr_peak"]),
            _fmt(p["dtr_ratio"]),
            _fmt(p["dtr_over_static"]),
            _fmt(p["confirmed"]),
            "yes" if p["met"] else "no",
        ]
        for p in points
    ]
    b = [
        [
            low["model"],
            mib(low["eager_peak"]),
            "-" if low["static_min"] is None else mib(low["static_min"]),
            low["static_min_by"],
            "-" if low["dtr_min"] is None else mib(low["dtr_min"]),
            low["dtr_min_setting"],
            _fmt(low["dtr_min_ratio"]),
            "yes" if low["met"] else "no",
        ]
        for low in lows
    ]
    return a, b


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (compiles)")
    parser.add_argument("--scale", type=int, default=0, help="model scale (0: bench default)")
    parser.add_argument(
        "--compile-budgets",
        nargs="*",
        type=float,
        default=None,
        help=f"activation_memory_budget values (default {' '.join(map(str, COMPILE_BUDGETS))}; "
        "none with --quick); give none to skip torch.compile",
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument("--calibrate", type=int, default=2, help="extra tries at a static peak")
    parser.add_argument(
        "--confirm",
        type=int,
        default=None,
        help="time each static point and dtr's run at its memory again, this many "
        "times each, alternately; the medians decide the target (default 3; 0 with --quick)",
    )
    parser.add_argument("--heuristic", default=dtr.DEFAULT_HEURISTIC, choices=list(dtr.HEURISTICS))
    parser.add_argument("--cost-model", default="time", choices=["time", "roofline"])
    parser.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "native", "subclass"],
        help="dtr's engine (auto: dtr.enable()'s choice on this machine, the native one "
        "on a CPU-only machine); the native engine's results go to vs_static.native.csv",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads, all methods"
    )
    parser.add_argument("--optimizer", default="adam", choices=["sgd", "adam", "adamw"])
    parser.add_argument("--quick", action="store_true", help="test-size models, no compile")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where to train (cuda: the current CUDA device; memory is then the caching "
        "allocator's peak, time the wall time between synchronizations)",
    )
    parser.add_argument("--out", default=None, help="default bench/results/[gpu/]vs_static.csv")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.engine == "native" and args.device != "cpu":
        parser.error("--engine native: CPU only")
    if args.engine == "auto":  # what dtr.enable() would run here, named in the results
        args.engine = "subclass" if args.device != "cpu" else dtr.config.resolve().engine
    if args.out is None:
        folder = os.path.join(RESULTS, "gpu") if args.device == "cuda" else RESULTS
        stem = "vs_static.native" if args.engine == "native" else "vs_static"
        args.out = os.path.join(folder, stem + ".csv")
    if args.compile_budgets is None:
        args.compile_budgets = [] if args.quick else list(COMPILE_BUDGETS)
    if args.confirm is None:
        args.confirm = 0 if args.quick else 3
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows: list[dict] = []
    for name in args.models:
        scale = args.scale or (1 if args.quick else BENCH_SCALE[name])
        print(f"{name} (scale {scale}, {args.device}, {args.threads} thread(s)):", flush=True)
        rows += compare(
            name,
            scale,
            args.steps,
            args.warmup,
            args.compile_budgets,
            args.ratios,
            args.calibrate,
            dict(heuristic=args.heuristic, cost_model=args.cost_model),
            args.backend,
            args.optimizer,
            device=args.device,
            engine=args.engine,
            confirm=args.confirm,
        )
    print()
    print_table(HEADER[:-1], [r[:-1] for r in table(rows)])
    notes = sorted({r["note"] for r in rows if r["note"]})
    for note in notes:
        print(f"  note: {note}")
    write_csv(args.out, HEADER, table(rows))
    a, b = target_tables(rows)
    print("\nAt each static point's memory: dtr's largest-budget run whose peak is at or below it")
    print_table(TARGET_HEADER, a)
    print("\nLowest memory reached (dtr: the smallest feasible budget)")
    print_table(LOW_HEADER, b)
    stem = os.path.splitext(args.out)[0]
    write_csv(stem + ".targets.csv", TARGET_HEADER, a)
    write_csv(stem + ".lowest.csv", LOW_HEADER, b)
    memory_source = "CUDA allocator" if args.device == "cuda" else "torch.profiler"
    where = "cuda" if args.device == "cuda" else f"{args.threads} thread(s)"
    plot = step_time_vs_memory(
        rows,
        stem + ".png",
        f"step time against peak memory ({memory_source}), {where}",
    )
    print(
        f"\nwrote {args.out}, {stem}.targets.csv, {stem}.lowest.csv and {plot} "
        f"({time.perf_counter() - started:.0f} s)"
    )


if __name__ == "__main__":
    main()

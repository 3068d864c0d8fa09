"""A graph convolutional network under dtr: what a sparse adjacency costs and saves.

Trains a GCN (each layer: linear, then the adjacency times it, then tanh) on a random
graph, eagerly and under dtr at fractions of the peak dtr reports with no budget, with
the adjacency as a CSR tensor (`adj @ h`) and as a COO one (`torch.sparse.mm(adj, h)`),
side by side in one process. Memory is torch.profiler's peak over a step plus the
parameters, optimizer state and graph alive before it (bench/common.py, the measure of
bench.vs_static); time is the median of the timed steps.
Writes a table and bench/results/sparse_gcn.csv.

    python -m bench.sparse_gcn                  # 10,000 nodes, 12 layers, about 4 minutes
    python -m bench.sparse_gcn --nodes 2000     # a quick run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
from torch import nn

import dtr
from dtr.engines.subclass.storage_keys import parts

from .common import RESULTS, mib, print_table, step_peak_bytes, write_csv

HEADER = [
    "layout",
    "method",
    "budget_mib",
    "peak_mib",
    "peak_vs_eager",
    "step_ms",
    "time_vs_eager",
    "evictions",
    "remats",
]


def graph(nodes: int, degree: int, layout) -> torch.Tensor:
    """A random graph with self loops, rows normalized (each node averages its
    neighbours), as a sparse tensor of `layout`."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, nodes, (nodes * degree,), generator=g)
    dst = torch.randint(0, nodes, (nodes * degree,), generator=g)
    loops = torch.arange(nodes)
    index = torch.stack([torch.cat([src, loops]), torch.cat([dst, loops])])
    adj = torch.sparse_coo_tensor(index, torch.ones(index.shape[1]), (nodes, nodes)).coalesce()
    deg = torch.sparse.sum(adj, 1).to_dense()
    adj = torch.sparse_coo_tensor(adj.indices(), adj.values() / deg[adj.indices()[0]], adj.shape)
    return adj.coalesce() if layout == "coo" else adj.to_sparse_csr()


class GCN(nn.Module):
    def __init__(self, features: int, width: int, depth: int, classes: int):
        super().__init__()
        sizes = [features] + [width] * (depth - 1) + [classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            h = layer(x)
            x = torch.sparse.mm(adj, h) if adj.layout is torch.sparse_coo else adj @ h
            if k < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def run(args, layout: str, dtr_kwargs: dict | None):
    """(step times, peak bytes, stats or None); (None, None, None) if infeasible."""
    adj = graph(args.nodes, args.degree, layout)
    torch.manual_seed(0)
    model = GCN(args.features, args.width, args.depth, args.classes)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(args.nodes, args.features)
    y = torch.randint(0, args.classes, (args.nodes,))

    def step():
        loss = nn.functional.cross_entropy(model(adj, x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    times = []
    ctx = dtr.enable(**dtr_kwargs) if dtr_kwargs is not None else contextlib.nullcontext()
    try:
        with ctx as session:
            step()  # warm-up: optimizer state, dtr's output sizes
            # the graph's memory is its parts' (indices, values)
            peak = step_peak_bytes(step, model, opt, (*parts(adj), x, y), "cpu")
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
    except dtr.BudgetError:
        return None, None, None
    return times, peak, session.stats() if session is not None else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--degree", type=int, default=8)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.8, 0.6, 0.5, 0.4, 0.3])
    p.add_argument("--layouts", nargs="+", default=["csr", "coo"], choices=["csr", "coo"])
    p.add_argument("--out", default=os.path.join(RESULTS, "sparse_gcn.csv"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for layout in args.layouts:
        eager_times, eager_peak, _ = run(args, layout, None)
        eager_ms = statistics.median(eager_times) * 1e3
        eager_row = [mib(eager_peak), "1.00", f"{eager_ms:.1f}", "1.00", "", ""]
        rows.append([layout, "eager", "", *eager_row])
        _, _, free = run(args, layout, {})
        budgets = [("no budget", None)] + [
            (f"{f:g} x P", int(f * free.peak_resident_bytes)) for f in args.fractions
        ]
        for label, budget in budgets:
            kwargs = {} if budget is None else {"budget": budget}
            times, peak, stats = run(args, layout, kwargs)
            if times is None:
                rows.append([layout, f"dtr {label}", mib(budget), "infeasible"] + [""] * 5)
                continue
            ms = statistics.median(times) * 1e3
            rows.append(
                [
                    layout,
                    f"dtr {label}",
                    "" if budget is None else mib(budget),
                    mib(peak),
                    f"{peak / eager_peak:.2f}",
                    f"{ms:.1f}",
                    f"{ms / eager_ms:.2f}",
                    stats.evictions,
                    stats.remats,
                ]
            )
    print(
        f"GCN: {args.nodes} nodes, degree {args.degree}, {args.depth} layers of {args.width}; "
        "P = dtr's own peak with no budget; peak = torch.profiler's over a step"
    )
    print_table(HEADER, rows)
    write_csv(args.out, HEADER, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

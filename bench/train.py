"""The main job: train a model under a memory budget and print what dtr did.

First one step without a budget measures the peak P that dtr sees; then the model trains
under a budget of --budget-ratio x P (or --budget), logging each step, and the session's
stats are printed at the end. With --check, the same steps also run eagerly and the final
parameters are compared bit for bit.

    python -m bench.train                                   # transformer at 40% of its peak
    python -m bench.train --model cnn --budget 8MiB --heuristic dtr_eq --steps 50
    python -m bench.train --engine subclass --check         # the subclass engine (any device)
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import dtr

from .common import BENCH_SCALE
from .harness import make_optimizer
from .models import MODELS, batches, build

log = logging.getLogger("dtr.train")


def run(name: str, scale: int, steps: int, dtr_kwargs: dict | None, optimizer: str):
    spec = MODELS[name]
    model = build(name, scale=scale)
    opt = make_optimizer(optimizer, model.parameters())
    data = batches(name, steps, scale=scale)
    torch.manual_seed(0)
    session = dtr.enable(**dtr_kwargs) if dtr_kwargs is not None else None
    with (
        session
        if session is not None
        else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    ):
        for step, batch in enumerate(data):
            if session is not None:
                session.reset_peak()
            start = time.perf_counter()
            loss = spec.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if session is not None:
                s = session.stats()
                log.info(
                    "step %3d  loss %.4f  %6.1f ms  peak %7.2f MiB  evictions %5d  remats %5d",
                    step,
                    loss.item(),
                    (time.perf_counter() - start) * 1e3,
                    s.peak_resident_bytes / 2**20,
                    s.evictions,
                    s.remats,
                )
    return model, session


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="transformer", choices=list(MODELS))
    parser.add_argument("--scale", type=int, default=0, help="model scale (0: bench default)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--budget", default=None, help="e.g. 512MiB (overrides the ratio)")
    parser.add_argument("--budget-ratio", type=float, default=0.4)
    parser.add_argument("--heuristic", default=None, choices=list(dtr.HEURISTICS))
    parser.add_argument("--optimizer", default="adam", choices=["sgd", "adam", "adamw"])
    parser.add_argument("--check", action="store_true", help="compare with eager, bitwise")
    parser.add_argument(
        "--engine",
        default=None,
        choices=["auto", "native", "subclass"],
        help="dtr's engine (default: DTR_ENGINE, else auto: the native engine on a "
        "CPU-only machine)",
    )
    args = parser.parse_args(argv)
    engine = {"engine": args.engine} if args.engine else {}
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    scale = args.scale or BENCH_SCALE[args.model]

    budget = args.budget
    if budget is None:
        _, probe = run(args.model, scale, 1, dict(engine), args.optimizer)
        peak = probe.stats().peak_resident_bytes
        budget = int(peak * args.budget_ratio)
        log.info(
            "%s (scale %d): unbudgeted peak %.2f MiB; budget %.0f%% = %.2f MiB",
            args.model,
            scale,
            peak / 2**20,
            args.budget_ratio * 100,
            budget / 2**20,
        )
    kwargs = {"budget": budget, **engine}
    if args.heuristic:
        kwargs["heuristic"] = args.heuristic
    model, session = run(args.model, scale, args.steps, kwargs, args.optimizer)
    stats = session.stats()
    print(stats)
    print(stats.to_json())
    if args.check:
        eager, _ = run(args.model, scale, args.steps, None, args.optimizer)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))
        print("parameters bitwise equal to eager:", same)
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()

"""The README's picture: resident memory over two Adam steps of the bench transformer at
40% of its unbudgeted peak, drawn by dtr.plot.memory_timeline (roofline costs, so the
same evictions every run).

    python -m bench.timeline                  # writes docs/memory_timeline.png
"""

from __future__ import annotations

import argparse

import dtr
import dtr.plot

from .harness import make_optimizer
from .models import MODELS, batches, build


def run(budget: int | None, model_name: str, scale: int) -> dtr.Stats:
    model = build(model_name, scale=scale)
    opt = make_optimizer("adam", model.parameters())
    with dtr.enable(budget=budget, cost_model="roofline", timeline=True) as session:
        for batch in batches(model_name, 2, scale=scale):
            MODELS[model_name].loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
    return session


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="transformer", choices=sorted(MODELS))
    p.add_argument("--scale", type=int, default=2)
    p.add_argument("--budget-ratio", type=float, default=0.4)
    p.add_argument("--out", default="docs/memory_timeline.png")
    args = p.parse_args(argv)
    peak = run(None, args.model, args.scale).stats().peak_resident_bytes
    session = run(int(args.budget_ratio * peak), args.model, args.scale)
    print(session.stats())
    title = f"bench {args.model}, 2 Adam steps at {args.budget_ratio:.0%} of its peak"
    dtr.plot.memory_timeline(session.timeline(), args.out, title=title)


if __name__ == "__main__":
    main()

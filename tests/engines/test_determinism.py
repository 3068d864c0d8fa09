"""The same program under the same budget makes the same eviction decisions in every run.

Each run is a fresh process (its own addresses, hash seed, timings and allocator state),
so anything run-dependent that reaches a decision (measured op times, an address-ordered
walk, a wall-clock staleness) shows up as a different eviction log or count between the
two runs. The default cost model is what is under test: with ``cost_model="time"`` the
logs differ from run to run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.utils import REPO


# A weight-shared transformer and a CNN with batch norm, each at a budget that forces
# evictions and recomputations (a fraction of its peak with no budget).
CASES = (("looped_transformer", 0.35), ("cnn", 0.4))
STEPS = 2


def _decisions(engine: str, name: str, fraction: float) -> dict:
    """One model trained STEPS steps under `fraction` of its unbudgeted peak: what dtr
    decided (evictions in order, counts, whether the budget was met)."""
    import torch

    import dtr
    from bench import models

    spec = models.spec_of(name)

    def train(**options):
        model = models.build(name)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        feasible = True
        with dtr.enable(engine=engine, **options) as session:
            core = session._engine if engine == "native" else session._runtime.core
            core.log_evictions(True)
            try:
                for batch in models.batches(name, STEPS):
                    spec.loss(model, batch).backward()
                    opt.step()
                    opt.zero_grad()
            except dtr.BudgetError:
                feasible = False
            log = list(core.eviction_log())
        return session.stats(), log, feasible

    free, _, _ = train()
    stats, log, feasible = train(budget=int(free.peak_resident_bytes * fraction))
    return {
        "budget": stats.budget_bytes,
        "feasible": feasible,
        "evictions": stats.evictions,
        "remats": stats.remats,
        "log": log,
    }


def child() -> None:
    """A run: every case on both engines, printed as one JSON line."""
    import torch

    torch.set_num_threads(1)  # small ops on a shared machine, as tests/conftest.py sets
    out = {
        f"{engine}/{name}": _decisions(engine, name, fraction)
        for engine in ("subclass", "native")
        for name, fraction in CASES
    }
    print(json.dumps(out))


def _run_in_fresh_process() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTR_")}
    proc = subprocess.run(
        [sys.executable, "-c", "from tests.engines.test_determinism import child; child()"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_runs_in_fresh_processes_make_the_same_decisions():
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    first, second = _run_in_fresh_process(), _run_in_fresh_process()
    assert first.keys() == second.keys()
    for case, got in first.items():
        assert got["feasible"], (case, "the budget is meant to be met")
        assert got["evictions"] > 10 and got["remats"] > 0, (case, got["evictions"])
        assert got["evictions"] == len(got["log"]), case
        again = second[case]
        counts = ("budget", "feasible", "evictions", "remats")
        assert [got[k] for k in counts] == [again[k] for k in counts], case
        assert got["log"] == again["log"], (case, "the same evictions in the same order")

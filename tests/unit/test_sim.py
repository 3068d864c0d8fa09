"""The trace recorder and the simulator: every record kind parsed, known answers on
hand-written traces, live runs replayed with the same decisions, the C++ replay loop and
its Python twin agreeing, and the paper's numbers reproduced on its own traces."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

import dtr
import dtr.engines.subclass.runtime
import dtr.sim as sim
from bench.heldout import HELDOUT
from bench.models import MODELS, batches, build
from dtr.sim import program as P
from tests.utils import REPO, call, mismatches, train, unbudgeted_peak, write_trace

PROTOTYPE = sim.PROTOTYPE_DIR
HAVE_PROTOTYPE = os.path.isdir(PROTOTYPE)
needs_prototype = pytest.mark.skipif(
    not HAVE_PROTOTYPE, reason=f"prototype traces not found at {PROTOTYPE}"
)
CORES = ["c++", "python"]


def chain_trace(tmp_path, n, nbytes=100):
    """Forward: x0 = op(); x_k = op(x_{k-1}), all held. Backward, k = n-1 .. 1: a small
    grad(x_k, x_{k-1}), then x_k is released (x0 last)."""
    recs = [{"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"}]
    recs += call("op", [], ["x0"], 10, [nbytes])
    for k in range(1, n):
        recs += call("op", [f"x{k - 1}"], [f"x{k}"], 10, [nbytes])
    recs.append({"INSTRUCTION": "ANNOTATE", "ANNOTATION": "BACKWARD"})
    for k in range(n - 1, 0, -1):
        recs += call("grad", [f"x{k}", f"x{k - 1}"], [f"g{k}"], 10, [8])
        recs.append({"INSTRUCTION": "RELEASE", "NAME": f"g{k}"})
        recs.append({"INSTRUCTION": "RELEASE", "NAME": f"x{k}"})
    recs.append({"INSTRUCTION": "RELEASE", "NAME": "x0"})
    return write_trace(tmp_path / "chain.jsonl", recs)


def test_every_prototype_record_kind(tmp_path):
    recs = [
        {"INSTRUCTION": "CALL", "NAME": "warmup", "ARGS": [], "RESULT": [], "TIME": 1},
        {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"},
        {"INSTRUCTION": "CONSTANT", "NAME": "w"},
        {"INSTRUCTION": "MEMORY", "NAME": "w", "MEMORY": 40},
        {"INSTRUCTION": "COPY", "DST": "w2", "SRC": "w"},
        {"INSTRUCTION": "RELEASE", "NAME": "w"},
        *call("mm", ["w2"], ["a"], 100, [400]),
        *call("split", ["a"], ["b", "c"], 5, [400, 400], aliases=[0, 0]),
        *call("max", ["a"], ["v", "i"], 50, [40, 80]),
        {"INSTRUCTION": "MUTATE", "NAME": "relu_", "ARGS": ["v", "w2"], "MUTATE": [0], "TIME": 7},
        {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "BACKWARD"},
        {"INSTRUCTION": "COPY_FROM", "DST": "i", "SRC": "v"},
        {"INSTRUCTION": "RELEASE", "NAME": "never_defined"},
        {"INSTRUCTION": "RELEASE", "NAME": "b"},
    ]
    prog = sim.load(write_trace(tmp_path / "kinds.jsonl", recs))
    assert prog.mode == P.PROTOTYPE and prog.ops == 4 and prog.baseline == 162.0
    new, view = 0, 1
    assert P.disassemble(prog) == [  # slots: w0 w2=1 a2 b3 c4 v5 i6 v'7
        ("CONST", 0, 40),
        ("COPY", 1, 0),
        ("RELEASE", 0),
        ("CALL", 100.0, (1,), ((2, new, -1, 400),), ()),
        ("CALL", 5.0, (2,), ((3, view, 0, 0), (4, view, 0, 0)), ()),
        ("CALL", 50.0, (2,), ((5, new, -1, 40), (6, new, -1, 80)), ()),
        ("MUTATE", 7.0, (5, 1), ((0, 7),)),
        ("BACKWARD",),
        ("COPY_FROM", 6, 7),
        ("RELEASE", 3),
        ("END",),
    ]
    for core in CORES:
        res = sim.simulate(prog, "dtr", core=core)
        assert res.status == "ok"
        # w (a constant: kept) + a (b, c are views) + v, i + relu_'s result
        assert res.peak_bytes == 40 + 400 + 40 + 80 + 40
        assert res.evictions == 0 and res.remats == 0 and res.overhead == 1.0


def test_views_of_an_earlier_result_of_the_same_call(tmp_path):
    # ALIAS len(ARGS) + j: a view of the call's own result j (cuDNN's RNN weight
    # gradients are views of one fresh buffer): one storage, counted once.
    recs = [
        *call("make", [], ["x"], 10, [100]),
        *call("grads", ["x"], ["g0", "g1", "g2"], 20, [300, 0, 0], aliases=[-1, 1, 1]),
        {"INSTRUCTION": "RELEASE", "NAME": "x"},
    ]
    prog = sim.load(write_trace(tmp_path / "views.jsonl", recs))
    new, view = 0, 1
    assert P.disassemble(prog)[1] == (
        "CALL",
        20.0,
        (0,),
        ((1, new, -1, 300), (2, view, 1, 0), (3, view, 1, 0)),
        (),
    )
    for core in CORES:
        res = sim.simulate(prog, "dtr", core=core)
        assert res.status == "ok" and res.peak_bytes == 100 + 300
        assert sim.simulate(prog, "dtr", budget=400, core=core).status == "ok"


def test_chain_under_lru_known_recomputations(tmp_path):
    # Room for 3 chain tensors and a grad. Forward keeps x_{n-3..n-1}. The reverse pass
    # needs (x_k, x_{k-1}); every other step finds x_{k-1} evicted and rebuilds it from
    # x0 (LRU keeps only the two newest of the rebuilt chain), so the recomputations are
    # (n-3) + (n-5) + ... over the positive terms.
    for n in (6, 9, 12):
        prog = sim.load(chain_trace(tmp_path, n))
        expected = sum(m for m in range(n - 3, 0, -2))
        for core in CORES:
            free = sim.simulate(prog, "lru", core=core)
            assert free.peak_bytes == n * 100 + 8 and free.remats == 0
            res = sim.simulate(prog, "lru", budget=3 * 100 + 8, core=core, thrash=0)
            assert res.status == "ok" and res.remats == expected, (n, core, res.remats)


def test_infeasible_and_thrash(tmp_path):
    prog = sim.load(chain_trace(tmp_path, 30))
    assert sim.simulate(prog, "lru", budget=2 * 100 + 8).status == "oom"
    res = sim.simulate(prog, "lru", budget=3 * 100 + 8, thrash=1.5)
    assert res.status == "thrash" and not res.feasible
    assert res.remat_cost > 0.5 * res.baseline


def test_peak_belongs_to_its_program(tmp_path):
    # The peak used to be cached by id(prog): a program made after another was freed can
    # get its id, and got the dead program's peak with it (CI saw chain6's peak for chain8).
    small = sim.load(chain_trace(tmp_path, 4))
    big = sim.load(chain_trace(tmp_path, 12))
    fields = {f.name: getattr(big, f.name) for f in dataclasses.fields(P.Program)}
    reused = 0
    for _ in range(20):
        first = P.Program(**{**fields, "code": small.code, "nslots": small.nslots})
        assert sim.peak(first) == sim.peak(small)
        freed = id(first)
        del first
        second = P.Program(**fields)  # most often at the address just freed
        reused += id(second) == freed
        assert sim.peak(second) == sim.simulate(big, "dtr", budget=-1).peak_bytes
    assert sim.peak(big) > sim.peak(small)
    if not reused:  # an allocator that never hands an address back (PYTHONMALLOC=malloc)
        pytest.skip("no program was made at a freed one's address: nothing was exercised")


@pytest.mark.parametrize(
    "records, match",
    [
        (["{not json"], "not JSON"),
        ([{"INSTRUCTION": "CONSTANT", "NAME": "a"}], "without its MEMORY"),
        ([{"INSTRUCTION": "JUMP"}], "unknown instruction"),
        (call("op", ["ghost"], ["a"], 1, [8]), "used before it is defined"),
        (
            [{"INSTRUCTION": "CALL", "NAME": "op", "ARGS": [], "RESULT": ["a"], "TIME": 1}],
            "MEMORY and ALIAS",
        ),
        # a view of a later result of the same call (ALIAS len(ARGS) + j, j earlier only)
        (call("op", [], ["a", "b"], 1, [8, 0], aliases=[1, -1]), "earlier result"),
    ],
)
def test_malformed_traces_name_file_and_line(tmp_path, records, match):
    path = tmp_path / "bad.jsonl"
    with open(path, "w") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    with pytest.raises(sim.TraceError, match=f"bad.jsonl:\\d+: .*{match}"):
        sim.load(str(path))


@pytest.mark.parametrize("name", ["mlp", "cnn", "lstm", "transformer", "tree"])
def test_live_run_and_its_replay_evict_alike(name, tmp_path, logged, core):
    budget = int(unbudgeted_peak(name) * 0.4)
    path = str(tmp_path / f"{name}.jsonl.gz")
    live = train(name, dtr_kwargs={"budget": budget, "cost_model": "roofline", "trace": path})
    with gzip.open(path, "rt") as f:
        start = json.loads(f.readline())
    assert start["DTR"] == "1" and start["HEURISTIC"] == dtr.DEFAULT_HEURISTIC
    live_log = logged[-1].eviction_log()
    assert live.stats.evictions == len(live_log) > 0
    prog = sim.load(path)
    assert prog.mode == P.LIVE
    assert any(ins[0] == "RESERVE" for ins in P.disassemble(prog))  # room made before ops
    for core in CORES:
        res = sim.simulate(prog, None, budget=budget, core=core, log=True, thrash=0)
        assert res.status == "ok"
        assert res.budget_bytes == budget  # not the lifted budget of the block's end
        assert res.eviction_log == live_log
        assert (res.evictions, res.remats) == (live.stats.evictions, live.stats.remats)


def test_sampled_victim_search_live_and_replayed_alike(tmp_path, logged, core):
    # search_sample=4 forces sampling in a small model (the default 512 never samples
    # here): gradients stay bitwise, decisions differ from exact search, and the trace
    # carries the setting so that a replay samples the same candidates.
    budget = int(unbudgeted_peak("transformer") * 0.4)
    kwargs = {"budget": budget, "cost_model": "roofline"}
    train("transformer", dtr_kwargs={**kwargs, "search_sample": 0})
    exact_log = logged[-1].eviction_log()
    path = str(tmp_path / "sampled.jsonl")
    live = train("transformer", dtr_kwargs={**kwargs, "search_sample": 4, "trace": path})
    live_log = logged[-1].eviction_log()
    assert live_log != exact_log and live.stats.search_seconds > 0
    assert not mismatches(train("transformer"), live)
    prog = sim.load(path)
    assert prog.meta["SEARCH_SAMPLE"] == "4"
    for core in CORES:
        res = sim.simulate(prog, None, budget=budget, core=core, log=True, thrash=0)
        assert res.eviction_log == live_log
    res = sim.simulate(prog, None, budget=budget, log=True, thrash=0, sample=0)
    assert res.eviction_log == exact_log


@pytest.mark.parametrize(
    "setting", [{"heuristic": "random", "seed": 3}, {"min_evict_bytes": 33_000}], ids=str
)
def test_recorded_settings_replay_as_live(setting, tmp_path, logged, core):
    # The random heuristic's seed and min_evict_bytes change decisions: the trace carries
    # them (and the heuristic), and a replay told nothing else uses them.
    budget = int(unbudgeted_peak("transformer") * 0.5)
    kwargs = {"budget": budget, "cost_model": "roofline"}
    heuristic = setting.get("heuristic", dtr.DEFAULT_HEURISTIC)
    train("transformer", dtr_kwargs={**kwargs, "heuristic": heuristic})
    plain_log = logged[-1].eviction_log()
    path = str(tmp_path / "set.jsonl")
    live = train("transformer", dtr_kwargs={**kwargs, **setting, "trace": path})
    live_log = logged[-1].eviction_log()
    assert live_log != plain_log and live.stats.evictions > 0
    prog = sim.load(path)
    assert sim.recorded_heuristic(prog) == heuristic
    for core in CORES:
        res = sim.simulate(prog, budget=budget, core=core, log=True, thrash=0)
        assert res.eviction_log == live_log


@pytest.mark.parametrize("change", [0.6, None], ids=["lowered", "lifted"])
def test_budget_changed_mid_run_replays_as_live(change, tmp_path, logged, core):
    # session.set_budget() in the middle of a run is in the trace: a replay at the run's
    # own budget follows it (it used to keep the first budget and decide otherwise); one
    # at another budget keeps that one throughout.
    peak = unbudgeted_peak("mlp")
    first = int(peak * 0.9)
    path = str(tmp_path / "budget.jsonl")
    spec = MODELS["mlp"]
    torch.manual_seed(0)
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = batches("mlp", 3)
    with dtr.enable(budget=first, cost_model="roofline", trace=path) as session:
        for step, batch in enumerate(data):
            if step == 1:
                session.set_budget(None if change is None else int(peak * change))
            spec.loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
    live_log = logged[-1].eviction_log()
    stats = session.stats()
    assert stats.evictions > 0
    prog = sim.load(path)
    assert sum(ins[0] == "BUDGET" for ins in P.disassemble(prog)) == 1
    for core in CORES:
        res = sim.simulate(prog, None, budget=first, core=core, log=True, thrash=0)
        assert res.eviction_log == live_log
        assert (res.evictions, res.remats) == (stats.evictions, stats.remats)
        assert res.budget_bytes == first
    fixed = sim.simulate(prog, None, budget=first + 1, log=True, thrash=0)
    assert fixed.eviction_log != live_log  # a what-if at another budget keeps its own


def test_deterministic_cost_model_repeats_decisions(logged):
    budget = int(unbudgeted_peak("transformer") * 0.3)
    kwargs = {"budget": budget, "cost_model": "roofline"}
    train("transformer", steps=2, dtr_kwargs=kwargs)
    train("transformer", steps=2, dtr_kwargs=kwargs)
    first, second = logged[-2].eviction_log(), logged[-1].eviction_log()
    assert len(first) > 50 and first == second


def test_trace_from_the_environment(tmp_path, monkeypatch):
    import torch

    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("DTR_TRACE", str(path))
    with dtr.enable():
        x = torch.randn(4, 4, requires_grad=True)
        (x.exp() * 2).sum().backward()
    lines = [json.loads(line) for line in open(path)]
    kinds = {line["INSTRUCTION"] for line in lines}
    assert {
        "ANNOTATE",
        "CONSTANT",
        "MEMORY",
        "INPUTS",
        "CALL",
        "ALIAS",
        "RELEASE",
        "EXPORT",
    } <= kinds
    assert any(line.get("ANNOTATION") == "BACKWARD" for line in lines)
    assert lines[-1] == {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "END"}
    assert sim.simulate(sim.load(str(path))).status == "ok"


@needs_prototype
def test_cpp_replay_and_python_driver_agree_on_prototype_traces():
    for path in sorted(os.listdir(PROTOTYPE)):
        if not path.endswith(".gz"):
            continue
        prog = sim.load(os.path.join(PROTOTYPE, path))
        for heuristic in dtr.HEURISTICS:
            for ratio in (0.6, 0.35):
                a = sim.simulate(prog, heuristic, ratio=ratio, log=True)
                b = sim.simulate(prog, heuristic, ratio=ratio, core="python+c++core", log=True)
                da, db = a.as_dict(), b.as_dict()
                da.pop("seconds"), db.pop("seconds")
                assert da == db, (path, heuristic, ratio)
                assert a.eviction_log == b.eviction_log, (path, heuristic, ratio)


@needs_prototype
@pytest.mark.parametrize(
    "name, paper",
    [
        ("tv_densenet121", 1.176),
        ("inceptionv4", 1.092),
        ("resnet32", 1.107),
        ("transformer", 1.058),
        ("unet", 1.159),
        ("treelstm", 1.123),
        ("lstm", 1.065),
        ("unroll_gan", 1.067),
    ],
)
def test_paper_overheads_at_half_budget(name, paper):
    # The paper's simulator, h_DTR at 0.5 of the unconstrained peak (the paper's numbers).
    prog = sim.load(_find(name))
    res = sim.simulate(prog, "dtr", ratio=0.5)
    assert res.status == "ok"
    assert abs(res.overhead - paper) <= 0.02 * paper, res.overhead


PAPER_SMALLEST = {  # smallest feasible ratio on the 0.05 grid: h_DTR, h_DTR^eq, h_MSPS
    "tv_densenet121": (0.15, 0.20, 0.15),
    "inceptionv4": (0.25, 0.25, 0.30),
    "resnet32": (0.15, 0.15, 0.15),
    "transformer": (0.20, 0.20, 0.15),
    "unet": (0.45, 0.45, 0.30),
    "treelstm": (0.15, 0.25, 0.40),
    "lstm": (0.20, 0.20, 0.30),
    "unroll_gan": (0.25, 0.30, 0.65),
}


@needs_prototype
@pytest.mark.parametrize("name", sorted(PAPER_SMALLEST))
def test_paper_smallest_feasible_ratios(name):
    # The paper's simulator's smallest feasible ratios (as the paper reports them),
    # reached exactly: feasible there, infeasible one grid step below. The prototype's traces replay with the
    # paper's staleness clock (core.request_stamps); dtr's own clock, stamping on every
    # lock and rerun, stopped one or more steps short on four traces.
    prog = sim.load(_find(name))
    for heuristic, smallest in zip(("dtr", "dtr_eq", "msps"), PAPER_SMALLEST[name], strict=True):
        assert sim.simulate(prog, heuristic, ratio=smallest).feasible, (heuristic, smallest)
        below = round(smallest - 0.05, 2)
        assert not sim.simulate(prog, heuristic, ratio=below).feasible, (heuristic, below)
    if name == "lstm":  # the paper's feasibility hole: 0.25 fails where 0.20 succeeds
        assert not sim.simulate(prog, "dtr", ratio=0.25).feasible


@needs_prototype
@pytest.mark.parametrize("name", sorted(PAPER_SMALLEST))
def test_overheads_against_the_papers_simulator(name):
    # The paper's simulator itself, run on these traces for h_DTR, h_DTR^eq and h_MSPS
    # at 0.5, 0.4, 0.3 and 0.2 (bench/reference/simrd.csv): the same feasibility, and an
    # overhead at most 5% above its own (the target).
    from bench.simulate import PAPER, simrd_reference

    label = PAPER[name][0]
    rows = {k: v for k, v in simrd_reference().items() if k[0] == label}
    assert len(rows) == 12
    prog = sim.load(_find(name))
    for (_, heuristic, ratio), want in sorted(rows.items()):
        res = sim.simulate(prog, heuristic, ratio=ratio)
        assert res.feasible == (want["status"] == "ok"), (heuristic, ratio, res.status)
        if res.feasible:
            assert res.overhead <= 1.05 * want["overhead"], (heuristic, ratio, res.overhead)


# the acceptance rule for a heuristic of our own: a strictly lower smallest feasible ratio
# than h_DTR on at least four traces, and no more than 5% more overhead on any. Smallest
# feasible ratios on the 0.05 grid, dtr / dtr_held34 (bench.simulate's sweep).
HELD34_SMALLEST = {
    "tv_densenet121": (0.15, 0.15),
    "inceptionv4": (0.25, 0.25),
    "resnet32": (0.15, 0.15),
    "transformer": (0.20, 0.15),
    "unet": (0.45, 0.35),
    "treelstm": (0.15, 0.10),
    "lstm": (0.20, 0.15),
    "unroll_gan": (0.25, 0.20),
}
BENCH_TRACES = os.path.join(REPO, "bench", "results", "traces")


def _rule_against_dtr(prog, heuristic):
    """(smallest feasible ratio of dtr, of heuristic) on the sweep's grid, after checking
    that heuristic is feasible wherever dtr is and at most 5% dearer there."""
    ok = {"dtr": [], heuristic: []}
    for ratio in sim.SWEEP_RATIOS:
        base = sim.simulate(prog, "dtr", ratio=ratio)
        ours = sim.simulate(prog, heuristic, ratio=ratio)
        if base.feasible:
            assert ours.feasible, (heuristic, ratio, ours.status)
            assert ours.overhead <= 1.05 * base.overhead, (ratio, ours.overhead, base.overhead)
        for name, res in (("dtr", base), (heuristic, ours)):
            if res.feasible:
                ok[name].append(ratio)
    return min(ok["dtr"]), min(ok[heuristic])


@needs_prototype
@pytest.mark.parametrize("name", sorted(HELD34_SMALLEST))
def test_dtr_held34_meets_the_own_heuristic_rule_on_prototype_traces(name):
    got = _rule_against_dtr(sim.load(_find(name)), "dtr_held34")
    assert got == HELD34_SMALLEST[name]


@pytest.mark.parametrize("trace", sorted(MODELS) + [f"heldout/{m}" for m in HELDOUT])
def test_dtr_held34_meets_the_own_heuristic_rule_on_bench_traces(trace):
    # The bench models' traces and the held-out models' (bench/heldout.py: programs the
    # exponent was not chosen on) as bench.simulate recorded them (roofline costs).
    path = os.path.join(BENCH_TRACES, f"{trace}.jsonl.gz")
    base, ours = _rule_against_dtr(sim.load(path), "dtr_held34")
    assert ours <= base


def _find(name):
    from dtr.sim.__main__ import find_trace

    return find_trace(name + "-", PROTOTYPE)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dtr.sim", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_result_line(tmp_path):
    path = chain_trace(tmp_path, 10)
    out = _cli(path, "--heuristic", "dtr_eq", "--budget-ratio", "0.8")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "status",
        "feasible",
        "overhead",
        "evictions",
        "remats",
        "peak_bytes",
        "budget_bytes",
        "seconds",
    ):
        assert key in result
    assert result["status"] == "ok" and result["feasible"] is True
    out = _cli(path, "--budget", "1KiB")
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["budget_bytes"] == 1024
    assert result["heuristic"] == dtr.DEFAULT_HEURISTIC  # a trace that names none
    out = _cli(path, "--sweep")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == len(dtr.HEURISTICS) * 20
    assert {r["budget_ratio"] for r in rows} == {round(1 - 0.05 * i, 2) for i in range(20)}


def test_cli_replays_a_live_trace_under_its_own_heuristic(tmp_path):
    path = str(tmp_path / "lru.jsonl")
    with dtr.enable(heuristic="lru", trace=path, cost_model="roofline"):
        x = torch.randn(64, 64, requires_grad=True)
        (x.relu() * 2).sum().backward()
    out = _cli(path, "--budget-ratio", "0.5")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["heuristic"] == "lru"
    out = _cli(path, "--budget-ratio", "0.5", "--heuristic", "size")
    assert json.loads(out.stdout.splitlines()[-1])["heuristic"] == "size"


def test_cli_errors(tmp_path):
    out = _cli("no-such-trace", "--traces", str(tmp_path))
    assert out.returncode == 2 and out.stderr.startswith("dtr: no trace")


def _count_ops(path):
    counts = {}
    for line in open(path):
        r = json.loads(line)
        if r["INSTRUCTION"] == "CALL":
            counts[r["NAME"]] = counts.get(r["NAME"], 0) + 1
    return counts


def test_static_schedules_known_costs(tmp_path):
    from dtr.sim import chain

    n, mb = 64, 1 << 20
    plain = sim.load(chain.plain(n, str(tmp_path / "p.jsonl")))
    assert sim.simulate(plain, budget=-1).peak_bytes == (n + 2) * mb
    # Chen: checkpoints every 8 steps; x_1..x_63 less the 7 checkpoints rebuilt once.
    path = chain.chen(n, str(tmp_path / "c.jsonl"))
    assert _count_ops(path) == {"x": n + 1 + (n - 1) - (n - 1) // 8, "g": n + 1}
    res = sim.simulate(sim.load(path), budget=-1)
    assert res.peak_bytes <= (2 * 8 + 4) * mb
    # Binomial with no slot: rebuild every state from x0, 0 + 1 + ... + (n-1).
    path = chain.binomial(n, str(tmp_path / "b0.jsonl"), 0)
    assert _count_ops(path) == {"x": n + 1 + n * (n - 1) // 2, "g": n + 1}
    # More slots, fewer recomputations, more memory; every schedule replays.
    costs, peaks = [], []
    for slots in (1, 2, 4, 8):
        path = chain.binomial(n, str(tmp_path / f"b{slots}.jsonl"), slots)
        costs.append(_count_ops(path)["x"])
        res = sim.simulate(sim.load(path), budget=-1)
        assert res.status == "ok"
        peaks.append(res.peak_bytes)
    assert costs == sorted(costs, reverse=True) and peaks == sorted(peaks)


def test_dtr_on_chain_is_linear_at_two_sqrt_n():
    # Theorem 3.1, small: total ops / N stays flat for the dtr heuristic.
    import math
    import tempfile

    from dtr.sim import chain

    ratios = []
    with tempfile.TemporaryDirectory() as d:
        for n in (100, 400, 1600):
            prog = sim.load(chain.plain(n, os.path.join(d, f"{n}.jsonl")))
            res = sim.simulate(prog, "dtr", budget=math.ceil(2 * math.sqrt(n)) << 20, thrash=0)
            assert res.status == "ok"
            ratios.append((prog.baseline + res.remat_cost) / n)
    assert max(ratios) < 3.5 and ratios[-1] - ratios[0] < 0.3

"""dtr under torch.distributed: two processes on this machine, gloo backend.

DTR runs per rank: each process has its own session, budget and decisions, and the
collectives see plain tensors (gradients are handed to ``.grad`` plain before DDP's
reducer reads them). See docs/distributed.md, "Composing with DDP and FSDP". The DDP and FSDP2
runs are made under both engines (``dtr.enable()`` and ``engine="native"``, whose
collectives go through a kernel of its own, which records none).

- **DDP** wrapping a model inside ``dtr.enable``: batch norm (DDP broadcasts rank 0's
  buffers before every forward) and dropout (a different stream per rank); SGD, and
  Adam with gradient accumulation under ``no_sync()`` and ``gradient_as_bucket_view``.
  The SGD loop also all-reduces a copy of the loss for logging (with ``dist.all_reduce``
  and with a functional collective): a collective on a managed tensor, which no rank can
  recompute alone (dtr hands such tensors to the collective plain and pins them; it
  used to record ``allreduce_`` as a view, whose schema does not say it writes, and read
  back the local value after an eviction).
  Each rank's losses, gradients after every step, parameters and buffers must equal
  those of the same DDP run without dtr, bit for bit: with no budget, at 50% and 30% of
  the peak (both evicting and recomputing) and in stress mode.
- **FSDP2** (``fully_shard``) runs on CPU with gloo. Without a budget dtr never
  recomputes, and the run equals FSDP2 without dtr. With a budget it cannot work:
  FSDP2 frees each unsharded parameter's storage (``untyped_storage().resize_(0)``, not
  an op dtr sees) after the forward and backward of its module, so recomputing an
  activation of an earlier module reads freed memory. dtr stops with an
  ``UnsupportedError`` that says so (observed before that check: "setStorage: ... out of
  bounds for storage of size 0", or "The tensor has a non-zero number of elements, but
  its data is not allocated yet").
- **FSDP1** (``FullyShardedDataParallel``) does not run on CPU at all in torch 2.13:
  "FSDP needs a non-CPU accelerator device, but no accelerator device is detected."
  Its test is skipped with the error the workers observed.

All scenarios run in one spawn of two workers (the imports dominate a spawn); a child's
exception fails every test here with the child's traceback, and a hang fails them after
``TIMEOUT`` seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dtr
from tests.utils import Trajectory, mismatches

WORLD = 2
TIMEOUT = 300  # seconds for the whole spawn
MODES = ["unbudgeted", 0.5, 0.3, "stress"]
DDP_SCENARIOS = ["ddp-sgd", "ddp-accumulate-adam"]
try:
    import dtr._C  # noqa: F401

    ENGINES = ["subclass", "native"]
except ImportError:  # the pure-Python build: no native engine
    ENGINES = ["subclass"]


class Net(nn.Module):
    """Narrow and deep enough that activations outweigh parameters (budgets bite)."""

    def __init__(self, width: int = 16, depth: int = 24):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.bn = nn.BatchNorm1d(width)
        self.body = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        )
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        return self.head(self.drop(self.body(torch.relu(self.bn(self.inp(x))))))


def _batches(rank: int, n: int, small: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    size = 8 if small else 256
    return [
        (torch.randn(size, 16, generator=g), torch.randint(0, 4, (size,), generator=g))
        for _ in range(n)
    ]


def _record(traj: Trajectory, model: nn.Module) -> None:
    traj.grads.append(
        [None if p.grad is None else dtr.materialize(p.grad).clone() for p in model.parameters()]
    )


def _ddp_loop(scenario: str, rank: int, small: bool, run: Trajectory, model: nn.Module):
    if scenario == "ddp-sgd":
        ddp = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for x, y in _batches(rank, 2 if small else 3, small):
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            _record(run, model)
            opt.step()
            opt.zero_grad()
            run.losses.append(loss.item())
            # The mean loss over ranks, for logging: a collective on a managed tensor.
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            run.losses.append(logged.item() / WORLD)
            # and with a functional collective (out of place; a tensor that waits)
            mean = funcol.all_reduce(loss.detach() * 1, "avg", dist.group.WORLD)
            run.losses.append((mean * 1).item())
    else:
        ddp = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        data = _batches(rank, 4, small)
        for step in range(2):
            micro = data[2 * step : 2 * step + 2]
            with ddp.no_sync():  # accumulate locally, all-reduce with the last one
                (F.cross_entropy(ddp(micro[0][0]), micro[0][1]) / 2).backward()
            loss = F.cross_entropy(ddp(micro[1][0]), micro[1][1]) / 2
            loss.backward()
            _record(run, model)
            opt.step()
            opt.zero_grad()
            run.losses.append(loss.item())


def _fsdp2_loop(rank: int, small: bool, run: Trajectory, model: nn.Module):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in _batches(rank, 2, small):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        run.grads.append([dtr.materialize(p.grad.to_local()).clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        run.losses.append(loss.item())


def _fsdp1_loop(rank: int, small: bool, run: Trajectory, model: nn.Module):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    wrapped = FSDP(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    for x, y in _batches(rank, 2, small):
        loss = F.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.losses.append(loss.item())


def _run(loop, dtr_kwargs: dict | None, small: bool = False) -> Trajectory:
    torch.manual_seed(0)
    model = Net(depth=4 if small else 24)  # stress: every reuse recomputes a chain
    model.train()
    run = Trajectory([], [], [], [], None)
    torch.manual_seed(100 + dist.get_rank())  # dropout's stream, different per rank
    ctx = dtr.enable(**dtr_kwargs) if dtr_kwargs is not None else contextlib.nullcontext()
    with ctx as session:
        loop(dist.get_rank(), small, run, model)
    run.params = [
        p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for p in model.parameters()
    ]
    run.buffers = [b.clone() for b in model.buffers()]
    run.stats = session.stats() if dtr_kwargs is not None else None
    return run


def _modes(loop) -> dict:
    """The eager run and, per engine, every mode of MODES (keys (engine, mode)); the
    stress runs on fewer, smaller batches (every reuse is a recomputation), with its own
    eager run."""
    out = {"eager": _run(loop, None), "eager-small": _run(loop, None, small=True)}
    for engine in ENGINES:
        options = {"cost_model": "roofline", "engine": engine}
        unbudgeted = out[engine, "unbudgeted"] = _run(loop, options)
        peak = unbudgeted.stats.peak_resident_bytes
        for ratio in (0.5, 0.3):
            out[engine, ratio] = _run(loop, {**options, "budget": int(peak * ratio)})
        out[engine, "stress"] = _run(loop, {"stress": True, "engine": engine}, small=True)
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two workers on two shared cores (see test_nn_blocks)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results: dict = {}
        for scenario in DDP_SCENARIOS:
            results[scenario] = _modes(lambda *a, s=scenario: _ddp_loop(s, *a))
        results["fsdp2"] = {"eager": _run(_fsdp2_loop, None)}
        for engine in ENGINES:
            options = {"cost_model": "roofline", "engine": engine}
            unbudgeted = results["fsdp2"][engine, "unbudgeted"] = _run(_fsdp2_loop, options)
            peak = unbudgeted.stats.peak_resident_bytes
            try:
                _run(_fsdp2_loop, {**options, "budget": int(peak * 0.5)})
                results["fsdp2"][engine, "budget"] = "no error"
            except dtr.UnsupportedError as e:
                results["fsdp2"][engine, "budget"] = e
        try:
            results["fsdp1"] = {"eager": _run(_fsdp1_loop, None)}
            results["fsdp1"]["unbudgeted"] = _run(_fsdp1_loop, {"cost_model": "roofline"})
        except RuntimeError as e:
            if "accelerator" not in str(e):
                raise
            results["fsdp1"] = "".join(traceback.format_exception_only(e)).strip()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Spawn the two workers once; per rank, what every scenario produced."""
    tmp = tmp_path_factory.mktemp("ddp")
    ctx = mp.start_processes(
        _worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT
    # join() raises ProcessRaisedException, with the child's traceback, when one fails
    # (and terminates the other).
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the DDP workers did not finish within {TIMEOUT} s")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", DDP_SCENARIOS)
@pytest.mark.parametrize("engine", ENGINES)
def test_ddp_matches_ddp_without_dtr(results, engine, scenario, mode):
    for rank in range(WORLD):
        runs = results[rank][scenario]
        got = runs[engine, mode]
        expected = runs["eager-small" if mode == "stress" else "eager"]
        assert mismatches(expected, got) == [], f"rank {rank}"
        stats = got.stats
        if mode == "unbudgeted":
            assert stats.evictions == 0 and stats.remats == 0
        elif mode == "stress":
            assert stats.remats > stats.ops / 2, "stress mode recomputed too little"
        else:
            budget = int(runs[engine, "unbudgeted"].stats.peak_resident_bytes * mode)
            assert stats.peak_resident_bytes <= budget
            assert stats.evictions > 0 and stats.remats > 0, "the budget did not bind"


@pytest.mark.parametrize("scenario", DDP_SCENARIOS)
def test_ddp_ranks_really_synchronize(results, scenario):
    # The comparisons above are about DDP only if gradients were all-reduced: the ranks
    # see different data, so their losses differ, yet their gradients and parameters
    # are the same.
    a, b = (results[rank][scenario]["eager"] for rank in range(WORLD))
    assert a.losses != b.losses
    assert all(
        torch.equal(x, y)
        for step_a, step_b in zip(a.grads, b.grads, strict=True)
        for x, y in zip(step_a, step_b, strict=True)
    )
    assert all(torch.equal(x, y) for x, y in zip(a.params, b.params, strict=True))


@pytest.mark.parametrize("engine", ENGINES)
def test_fsdp2_without_budget_matches_fsdp2_without_dtr(results, engine):
    for rank in range(WORLD):
        runs = results[rank]["fsdp2"]
        assert mismatches(runs["eager"], runs[engine, "unbudgeted"]) == [], f"rank {rank}"
        assert runs[engine, "unbudgeted"].stats.remats == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_fsdp2_under_a_budget_is_a_clear_error(results, engine):
    for rank in range(WORLD):
        error = results[rank]["fsdp2"][engine, "budget"]
        assert isinstance(error, dtr.UnsupportedError), error
        assert "freed" in str(error) and "FSDP" in str(error)


def test_fsdp1(results):
    outcome = results[0]["fsdp1"]
    if isinstance(outcome, str):
        pytest.skip(f"FSDP1 does not run on CPU/gloo: {outcome}")
    for rank in range(WORLD):
        runs = results[rank]["fsdp1"]
        assert mismatches(runs["eager"], runs["unbudgeted"]) == [], f"rank {rank}"


def test_recomputing_from_freed_storage_is_a_clear_error():
    # What FSDP2 does to an unsharded parameter after its module's forward, in one
    # process: the storage is freed behind dtr's back, then a recomputation needs it.
    w = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(dtr.UnsupportedError, match="storage has since been freed"):
        with dtr.enable(stress=True):
            y = (w * 2).tanh()
            torch._C.TensorBase.untyped_storage(w).resize_(0)  # from torch's own code
            y.sum()

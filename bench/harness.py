"""Training runs shared by tests and benchmarks: the same steps, eagerly or under dtr."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

import dtr

from .models import MODELS, batches, build


@dataclasses.dataclass
class Trajectory:
    losses: list[float]
    grads: list[list[torch.Tensor]]  # per step, per parameter (None where no grad)
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    stats: dtr.Stats | None


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    raise ValueError(f"unknown optimizer {kind!r}")


def train(
    name: str,
    steps: int = 3,
    optimizer: str = "sgd",
    dtr_kwargs: dict | None = None,
    model_seed: int = 0,
    data_seed: int = 1,
    rng_seed: int = 2,
    device: str = "cpu",
) -> Trajectory:
    """Train `steps` steps; under dtr.enable(**dtr_kwargs) unless it is None (eager).
    The model and batches are built on the CPU from the seeds, then moved to `device`,
    so every device trains from the same initial values and data."""
    spec = MODELS[name]
    model = build(name, model_seed)
    data = batches(name, steps, data_seed)
    if torch.device(device).type != "cpu":
        model.to(device)
        data = [to_device(batch, device) for batch in data]
    model.train()
    params = list(model.parameters())
    opt = make_optimizer(optimizer, params)
    torch.manual_seed(rng_seed)  # every device's default generator
    traj = Trajectory([], [], [], [], None)
    ctx = dtr.enable(**dtr_kwargs) if dtr_kwargs is not None else contextlib.nullcontext()
    with ctx as session:
        for batch in data:
            loss = spec.loss(model, batch)
            loss.backward()
            traj.grads.append([None if p.grad is None else p.grad.clone() for p in params])
            opt.step()
            opt.zero_grad()
            traj.losses.append(loss.item())
    traj.params = [p.detach().clone() for p in params]
    traj.buffers = [b.clone() for b in model.buffers()]
    traj.stats = session.stats() if dtr_kwargs is not None else None
    return traj


def to_device(batch: tuple, device) -> tuple:
    """A batch (a tuple of tensors) on `device`."""
    return tuple(t.to(device) for t in batch)


def record_traces(models: list[str], folder: str) -> list[tuple[str, str]]:
    """One training step of each bench model (test size) under dtr with the deterministic
    cost model, traced to folder/<model>.jsonl.gz; returns (label, path) pairs."""
    os.makedirs(folder, exist_ok=True)
    out = []
    for name in models:
        path = os.path.join(folder, f"{name}.jsonl.gz")
        train(name, steps=1, dtr_kwargs={"trace": path, "cost_model": "roofline"})
        out.append((f"dtr {name}", path))
    return out

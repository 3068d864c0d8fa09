"""Capture and replay of random-number state (Invariant 1).

An op tagged ``nondeterministic_seeded`` (bernoulli_, normal_, native_dropout, ...) draws
from a generator: the one passed as its ``generator=`` argument, or the default generator
of its device. Before the op first runs we save that generator's state; a recomputation
sets it back, runs, and restores the current state, so recomputing never shifts the
random stream the program sees.

An op outside aten may draw without the tag (a custom noise kernel): its generator's state
is captured all the same, and kept only if the op changed it (``drew``).
"""

from __future__ import annotations

import contextlib

import torch

from ...errors import UnsupportedError


def default_generator(device: torch.device) -> torch.Generator:
    """The generator an op on ``device`` draws from when given none: the CPU's, or the
    one its device module (torch.cuda, or a PrivateUse1 backend's) lists in
    ``default_generators`` for the device's index."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "default_generators"):
        raise UnsupportedError(
            f"dtr: cannot replay random ops on device type {device.type!r}: its device "
            f"module torch.{device.type} lists no default_generators; run random ops "
            "outside dtr (dtr.disable()) or give them an explicit generator= argument"
        )
    # current_device() first: it initializes the backend, which fills default_generators
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


def capture(generator: torch.Generator | None, device: torch.device):
    """State to replay later: (generator, its state now)."""
    gen = generator if generator is not None else default_generator(device)
    return gen, gen.get_state()


@contextlib.contextmanager
def replaying(captured):
    if captured is None:
        yield
        return
    gen, state = captured
    saved = gen.get_state()
    gen.set_state(state)
    try:
        yield
    finally:
        gen.set_state(saved)


def drew(captured) -> bool:
    """Whether the generator of ``captured`` (from ``capture``) has moved since."""
    gen, state = captured
    return not torch.equal(gen.get_state(), state)

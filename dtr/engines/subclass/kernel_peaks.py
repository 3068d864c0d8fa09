"""What an op allocates, learned per op and input shapes, to make room before it runs.

The core evicts at op boundaries, after an op's fresh outputs exist; until then they sit
on top of the budget (an LSTM layer's 30 MiB workspace output was resident before any
eviction could act). A training loop repeats its ops with the same shapes, so the bytes
an op call allocated last time are a good guess for the next call with the same inputs:
the runtime evicts that much first (``Runtime._run``), and the trace records the guess
(``RESERVE`` on the ``INPUTS`` line) so that a replay makes the same call.

What is learned is the most the kernel had allocated at once, read from the CPU
allocation cache's meter (csrc/cpu_cache.cpp), when that is larger than its outputs: a
kernel's own buffers are memory too (``convolution_backward``'s exceed its outputs):
counting only outputs, a small CNN's step under 0.6 of its peak has 1.18x the budget in
use, counting the buffers 1.01x (tests/engines/test_real_memory.py). A recomputation makes room
for its outputs only. The native engine reads the same meter in C++.
"""

from __future__ import annotations

import importlib

MAX_ENTRIES = 100_000  # a program with ever-new shapes forgets and starts again


class OutputSizes:
    def __init__(self) -> None:
        self._bytes: dict[tuple, int] = {}

    def predict(self, func, leaves) -> tuple[tuple, int]:
        """(key, bytes of the fresh outputs the last call with these inputs made; 0 if
        none was seen)."""
        key = (func, *[(t.shape, t.dtype) for t in leaves])
        return key, self._bytes.get(key, 0)

    def learn(self, key: tuple, nbytes: int) -> None:
        if len(self._bytes) >= MAX_ENTRIES and key not in self._bytes:
            self._bytes.clear()
        self._bytes[key] = nbytes


class KernelMeter:
    """The CPU allocation cache, attached for a session as a meter only (it keeps no idle
    blocks): ``mark()`` before a kernel, ``peak_since(mark)`` after it: the most bytes
    in use since the mark beyond what was in use at it. ``mark()`` answers -1 and
    ``peak_since`` 0 when the extension is not built (then only outputs are learned).
    ``real_peak()``: the most in use at once since the session began, beyond what was
    in use then (0 without the extension)."""

    def __init__(self) -> None:
        self._closing_peak = 0
        try:
            self._C = importlib.import_module("dtr._C")
        except ImportError:
            self._C = None
            return
        try:
            self._C.cpu_cache_attach(0)
        except RuntimeError:
            # Left attached by a session whose entry was interrupted between the attach
            # and the runtime's hand-over to it (a signal can land on any line): no
            # session is open here (Session.__enter__ checked), so it is no one's.
            self._C.cpu_cache_detach()
            self._C.cpu_cache_attach(0)

    def mark(self) -> int:
        return -1 if self._C is None else self._C.cpu_cache_window_mark()

    def peak_since(self, mark: int) -> int:
        return 0 if mark < 0 else self._C.cpu_cache_window_peak() - mark

    def real_peak(self) -> int:
        return self._closing_peak if self._C is None else self._C.cpu_cache_stats()["peak_bytes"]

    def close(self) -> None:
        if self._C is not None:
            self._closing_peak = self.real_peak()
            self._C.cpu_cache_detach()
            self._C = None

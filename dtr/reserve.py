"""Output sizes learned per op and input shapes, to make room before an op runs.

The core evicts at op boundaries, after an op's fresh outputs exist; until then they sit
on top of the budget (an LSTM layer's 30 MiB workspace output was resident before any
eviction could act). A training loop repeats its ops with the same shapes, so the bytes
an op call allocated last time are a good guess for the next call with the same inputs:
the runtime evicts that much first (``Runtime._run``), and the trace records the guess
(``RESERVE`` on the ``INPUTS`` line) so that a replay makes the same call.
"""

from __future__ import annotations

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

"""Operator traces: what a live run did, for the simulator to replay under any budget.

``dtr.enable(..., trace="run.jsonl")`` (or ``DTR_TRACE=run.jsonl``; a ``.gz`` suffix
compresses) writes one JSON object per line. The format extends the one the DTR
prototype's authors published (``../shared/traces``), so one reader (``dtr.sim``) serves
both; every value is a string, as in theirs.

Instructions shared with the prototype:

- ``{"INSTRUCTION":"ANNOTATE","ANNOTATION":"START"|"BACKWARD"}``: start of the trace;
  first op of a backward pass. Our START line also carries ``"DTR":"1"`` and the settings
  of the run (``HEURISTIC``, ``BUDGET``, ``COST_MODEL``, ``STRESS``, ``SEARCH_SAMPLE``,
  ``SEED``, ``MIN_EVICT_BYTES``), which a replay uses unless told otherwise.
- ``CONSTANT`` x, then ``MEMORY`` x bytes: a plain tensor an op reads (parameter, input,
  RNG state, snapshot of an argument written in place). It starts with one handle.
- ``CALL``: ``NAME`` the op, ``ARGS`` the tensors its recipe reads, ``RESULT`` the new
  tensors, ``TIME`` its cost in ns; each result then gets ``MEMORY`` (bytes of a fresh
  storage) and ``ALIAS``: ``"-1"`` for a fresh storage, ``"k"`` for a view of ``ARGS[k]``
  (ours also: ``len(ARGS) + j`` for a view of the same call's ``RESULT[j]``, j earlier:
  cuDNN returns an RNN's weight gradients as views of one fresh buffer).
- ``RELEASE`` x: the program dropped its last handle to x.

Extensions (only in traces dtr writes):

- ``CALL`` carries ``COST`` (the exact cost the core saw, a float), and ``FRESH``: the
  constants first registered for this call, whose handles are released after it.
- ``ALIAS`` with ``"VERSION":"1"``: the result is the in-place update of ``ARGS[k]``; it
  takes over that tensor's storage and handles (the old value keeps its lineage).
- ``INPUTS`` ``ARGS``: the managed inputs of the next CALL are locked and materialized now
  (before the constants and invalidations its preparation adds). With ``RESERVE`` n
  (bytes): then, under a budget that resident + n would exceed, room for n more bytes
  is made (the size the same op on the same input shapes allocated last time;
  dtr/reserve.py).
- ``INVALIDATE`` ``ARGS``: these tensors are about to be written in place without keeping
  their lineage; whatever the program holds that reads them is materialized and pinned.
- ``READ`` x: the program read x's value (``.item()``, ``repr``, ...).
- ``EXPORT`` x: x was handed out as a plain tensor (a gradient to ``.grad``, ``numpy()``):
  read, then pinned; an ``INVALIDATE`` of its pool follows if something read it. With
  ``VERSION`` y: read, then x's in-place update y (x's storage and handles, no cost) is
  recorded and pinned; x keeps its lineage for what read it (Runtime.export).
- ``ANNOTATE`` ``END``: the block ended; what the program still holds is materialized.
- ``ANNOTATE`` ``BUDGET`` n: ``session.set_budget()`` changed the budget to n bytes (-1:
  none) from the next op on. A replay at the trace's own budget follows it; a replay at
  another budget (a what-if, a sweep) keeps its own throughout.

The reader refuses, naming the file and line (``dtr.sim.TraceError``), any line that is
not a JSON object, a record without a field its instruction needs or with one of the
wrong type, a byte count (``MEMORY``, ``RESERVE``, ``BUDGET``) that is not an int
between 0 (-1 for ``BUDGET``) and 2**63 - 1 or that takes the trace's total past it, a
``TIME`` or ``COST`` that is not a finite number >= 0, and a trace with no operations.

A live run differs from the prototype's in when it evicts (after each op, its outputs
protected, rather than before it) and in how in-place updates work; the ``DTR`` key on
the START line tells the simulator which semantics to replay.
"""

from __future__ import annotations

import gzip
import json

from .config import DTRConfig

FORMAT_VERSION = "1"


class TraceWriter:
    def __init__(self, path: str, config: DTRConfig):
        self.path = path
        self._f = gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w")
        self._in_backward = False
        self._write(
            INSTRUCTION="ANNOTATE",
            ANNOTATION="START",
            DTR=FORMAT_VERSION,
            HEURISTIC=config.heuristic,
            BUDGET="-1" if config.budget_bytes is None else str(config.budget_bytes),
            COST_MODEL=config.cost_model,
            STRESS="1" if config.stress else "0",
            SEARCH_SAMPLE=str(config.search_sample),
            SEED=str(config.seed),
            MIN_EVICT_BYTES=str(config.min_evict_bytes),
        )

    def _write(self, **fields) -> None:
        self._f.write(json.dumps(fields, separators=(",", ":")))
        self._f.write("\n")

    def phase(self, in_backward: bool) -> None:
        """Called on every managed op: marks the first op of each backward pass."""
        if in_backward and not self._in_backward:
            self._write(INSTRUCTION="ANNOTATE", ANNOTATION="BACKWARD")
        self._in_backward = in_backward

    def constant(self, name: str, nbytes: int) -> None:
        self._write(INSTRUCTION="CONSTANT", NAME=name)
        self._write(INSTRUCTION="MEMORY", NAME=name, MEMORY=str(nbytes))

    def budget(self, nbytes: int | None) -> None:
        """session.set_budget(): the budget from the next op on."""
        self._write(
            INSTRUCTION="ANNOTATE",
            ANNOTATION="BUDGET",
            BUDGET=str(-1 if nbytes is None else nbytes),
        )

    def inputs(self, names: list[str], reserve: int = 0) -> None:
        if reserve:
            self._write(INSTRUCTION="INPUTS", ARGS=names, RESERVE=str(reserve))
        else:
            self._write(INSTRUCTION="INPUTS", ARGS=names)

    def invalidate(self, names: list[str]) -> None:
        self._write(INSTRUCTION="INVALIDATE", ARGS=names)

    def call(
        self,
        op: str,
        args: list[str],
        results: list[str],
        cost: float,
        kinds: list[int],
        aliases: list[int],
        nbytes: list[int],
        fresh: list[str],
    ) -> None:
        self._write(
            INSTRUCTION="CALL",
            NAME=op,
            ARGS=args,
            RESULT=results,
            TIME=str(int(cost * 1e9)),
            COST=repr(float(cost)),
            FRESH=fresh,
        )
        for name, kind, alias, size in zip(results, kinds, aliases, nbytes):
            self._write(INSTRUCTION="MEMORY", NAME=name, MEMORY=str(size))
            if kind == 2:
                self._write(INSTRUCTION="ALIAS", NAME=name, ALIAS=str(alias), VERSION="1")
            else:
                self._write(INSTRUCTION="ALIAS", NAME=name, ALIAS=str(alias))

    def release(self, name: str) -> None:
        self._write(INSTRUCTION="RELEASE", NAME=name)

    def read(self, name: str) -> None:
        self._write(INSTRUCTION="READ", NAME=name)

    def export(self, name: str, version: str | None = None) -> None:
        if version is None:
            self._write(INSTRUCTION="EXPORT", NAME=name)
        else:
            self._write(INSTRUCTION="EXPORT", NAME=name, VERSION=version)

    def close(self) -> None:
        if self._f is not None:
            self._write(INSTRUCTION="ANNOTATE", ANNOTATION="END")
            self._f.close()
            self._f = None

"""Operator traces: what a live run did, for the simulator to replay under any budget.

``dtr.enable(..., trace="run.jsonl")`` (or ``DTR_TRACE=run.jsonl``; a ``.gz`` suffix
compresses) writes one JSON object per line. The format extends the one the DTR
prototype's authors published (``../shared/traces``), so one reader (``dtr.sim``) serves
both; every value is a string, as in theirs.

The format, record by record, and what the reader refuses: docs/simulator.md, "The trace
format".
"""

from __future__ import annotations

import gzip
import json

from ...config import DTRConfig

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

"""Reads an operator trace (ours or the DTR prototype's, gzip or plain) into a Program.
The format is described in ``dtr/trace.py``."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np

from .._pycore import NEW, VERSION, VIEW
from ..errors import DTRError
from . import program as P


class TraceError(DTRError, ValueError):
    """A trace file dtr cannot read (the message gives the file and line)."""


def _lines(path: str):
    with open(path, "rb") as f:
        magic = f.read(2)
    opener = gzip.open if magic == b"\x1f\x8b" else open
    with opener(path, "rt") as f:
        yield from f


def load(path: str, mode: int | None = None) -> P.Program:
    """Compile the trace at path. mode: program.PROTOTYPE or LIVE; by default LIVE for
    traces dtr wrote (their START line has a DTR key), PROTOTYPE otherwise."""
    if not os.path.exists(path):
        raise TraceError(f"dtr: no trace file at {path!r}")
    records = []
    for number, line in enumerate(_lines(path), 1):
        line = line.strip()
        if not line:
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise TraceError(f"dtr: {path}:{number}: not JSON ({exc})") from None
    starts = [
        i
        for i, (_, r) in enumerate(records)
        if r.get("INSTRUCTION") == "ANNOTATE" and r.get("ANNOTATION") == "START"
    ]
    meta = dict(records[starts[0]][1]) if starts else {}
    if starts:  # the prototype's traces may hold a warm-up before START
        records = records[starts[0] + 1 :]
    if mode is None:
        mode = P.LIVE if "DTR" in meta else P.PROTOTYPE
    return _Compiler(path, mode).compile(records, meta)


class _Compiler:
    def __init__(self, path: str, mode: int):
        self.path = path
        self.mode = mode
        self.slots: dict[str, int] = {}
        self.nslots = 0
        self.code: list[int] = []
        self.budget_at: list[int] = []  # where the code has a BUDGET instruction
        self.costs: list[float] = []
        self.ops = 0

    def fail(self, number: int, msg: str):
        raise TraceError(f"dtr: {self.path}:{number}: {msg}")

    def new_slot(self, name: str) -> int:
        self.slots[name] = self.nslots
        self.nslots += 1
        return self.nslots - 1

    def slot(self, number: int, name: str) -> int:
        s = self.slots.get(name)
        if s is None:
            self.fail(number, f"tensor {name!r} is used before it is defined")
        return s

    def compile(self, records, meta) -> P.Program:
        i, n = 0, len(records)
        ended = False
        while i < n:
            number, r = records[i]
            instr = r.get("INSTRUCTION")
            i += 1
            if instr == "CONSTANT":
                if i >= n or records[i][1].get("INSTRUCTION") != "MEMORY":
                    self.fail(number, "CONSTANT without its MEMORY line")
                nbytes = int(records[i][1]["MEMORY"])
                i += 1
                self.code += [P.CONST, self.new_slot(r["NAME"]), nbytes]
            elif instr == "COPY":
                src = self.slot(number, r["SRC"])
                self.code += [P.COPY, self.new_slot(r["DST"]), src]
            elif instr == "RELEASE":
                if r["NAME"] in self.slots:  # the prototype releases names it never defined
                    self.code += [P.RELEASE, self.slots[r["NAME"]]]
            elif instr == "CALL":
                i = self.call(records, i, number, r)
            elif instr == "MUTATE":
                self.mutate(number, r)
            elif instr == "COPY_FROM":
                self.code += [P.COPY_FROM, self.slot(number, r["DST"]), self.slot(number, r["SRC"])]
            elif instr in ("INPUTS", "INVALIDATE"):
                args = [self.slot(number, a) for a in r["ARGS"]]
                self.code += [P.INPUTS if instr == "INPUTS" else P.INVALIDATE, len(args), *args]
                if "RESERVE" in r:
                    if not str(r["RESERVE"]).isdigit():
                        self.fail(number, f"RESERVE {r['RESERVE']!r} is not a byte count")
                    self.code += [P.RESERVE, int(r["RESERVE"])]
            elif instr == "EXPORT" and "VERSION" in r:
                old = self.slot(number, r["NAME"])
                self.code += [P.EXPORT_VERSION, old, self.new_slot(r["VERSION"])]
            elif instr in ("READ", "EXPORT"):
                self.code += [P.READ if instr == "READ" else P.EXPORT, self.slot(number, r["NAME"])]
            elif instr == "ANNOTATE":
                if r.get("ANNOTATION") == "BACKWARD":
                    self.code.append(P.BACKWARD)
                elif r.get("ANNOTATION") == "END":
                    self.code.append(P.END)
                    ended = True
                elif r.get("ANNOTATION") == "BUDGET":
                    raw = str(r.get("BUDGET"))
                    if not (raw.isdigit() or raw == "-1"):
                        self.fail(number, f"BUDGET {raw!r} is not a byte count or -1")
                    self.budget_at.append(len(self.code))
                    self.code += [P.BUDGET, int(raw)]
            elif instr in ("MEMORY", "ALIAS"):
                self.fail(number, f"{instr} line out of place")
            else:
                self.fail(number, f"unknown instruction {instr!r}")
        if not ended:
            self.code.append(P.END)
        return P.Program(
            code=np.asarray(self.code, dtype=np.int64),
            costs=np.asarray(self.costs, dtype=np.float64),
            nslots=self.nslots,
            mode=self.mode,
            baseline=float(sum(self.costs)),
            ops=self.ops,
            name=os.path.basename(self.path),
            meta=meta,
            budget_at=tuple(self.budget_at),
        )

    def cost(self, r) -> int:
        value = float(r["COST"]) if "COST" in r else float(r.get("TIME", 0))
        self.costs.append(value)
        self.ops += 1
        return len(self.costs) - 1

    def call(self, records, i, number, r) -> int:
        args = [self.slot(number, a) for a in r["ARGS"]]
        results = r["RESULT"]
        body = []
        for name in results:
            if i + 1 >= len(records):
                self.fail(number, "CALL without MEMORY and ALIAS lines for its results")
            (_, mem), (_, alias) = records[i], records[i + 1]
            if (
                (mem.get("INSTRUCTION"), alias.get("INSTRUCTION")) != ("MEMORY", "ALIAS")
                or mem.get("NAME") != name
                or alias.get("NAME") != name
            ):
                self.fail(number, f"result {name!r} lacks its MEMORY and ALIAS lines")
            i += 2
            ref = int(alias["ALIAS"])
            # ALIAS: an argument's position, or len(ARGS) + j for this call's result j
            if ref >= len(args) + len(body) // 4:
                self.fail(
                    number,
                    f"result {name!r} aliases argument {ref} of {len(args)} "
                    f"(or an earlier result, numbered from {len(args)})",
                )
            if alias.get("VERSION") == "1" and ref >= len(args):
                self.fail(number, f"result {name!r} is a new version of a result")
            if ref < 0:
                kind, nbytes = NEW, int(mem["MEMORY"])
            elif alias.get("VERSION") == "1":
                kind, nbytes = VERSION, 0
            else:
                kind, nbytes = VIEW, 0
            body += [self.new_slot(name), kind, ref, nbytes]
        fresh = [self.slot(number, f) for f in r.get("FRESH", [])]
        self.code += [
            P.CALL,
            self.cost(r),
            len(args),
            *args,
            len(results),
            *body,
            len(fresh),
            *fresh,
        ]
        return i

    def mutate(self, number, r) -> None:
        # The prototype's in-place op: each written argument gets a fresh tensor that
        # takes over its name (the paper's simulator made them copies).
        args = [self.slot(number, a) for a in r["ARGS"]]
        mutated = [int(m) for m in r["MUTATE"]]
        body = []
        for m in mutated:
            body += [m, self.new_slot(r["ARGS"][m])]
        self.code += [P.MUTATE, self.cost(r), len(args), *args, len(mutated), *body]

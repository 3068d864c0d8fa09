"""Every setting dtr reads, and the one place environment variables are parsed.

Explicit arguments to :func:`dtr.enable` beat the environment; the environment beats the
defaults. Each value is validated here, so a bad one fails at ``enable()`` time with a
message naming the variable or argument, the value, and what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from ._pycore import HEURISTICS
from .cost import COST_MODELS
from .errors import ConfigError
from .units import ACCEPTED, parse_bytes

ENV_BUDGET = "DTR_MEMORY_BUDGET"
ENV_HEURISTIC = "DTR_HEURISTIC"
ENV_FORCE_PYTHON = "DTR_FORCE_PYTHON"
ENV_STRESS = "DTR_STRESS"
ENV_DEBUG = "DTR_DEBUG"
ENV_COST_MODEL = "DTR_COST_MODEL"
ENV_TRACE = "DTR_TRACE"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclasses.dataclass(frozen=True)
class DTRConfig:
    """Validated settings of one :func:`dtr.enable` session.

    Attributes:
        budget_bytes: resident-byte budget, or None for no budget (track, never evict).
        heuristic: eviction heuristic, one of ``dtr.HEURISTICS``.
        stress: evict every evictable tensor after every op (testing mode).
        seed: seed of the ``random`` heuristic.
        min_evict_bytes: pools smaller than this are never chosen as victims.
        check: verify the core's invariants after every op (slow; for tests).
        force_python: use the pure-Python core even when the C++ one is built.
        cost_model: "time" (measured wall time) or "roofline" (deterministic estimate).
        trace: path of an operator trace to write (see dtr.trace), or None.
    """

    budget_bytes: int | None = None
    heuristic: str = "dtr"
    stress: bool = False
    seed: int = 0
    min_evict_bytes: int = 0
    check: bool = False
    force_python: bool = False
    cost_model: str = "time"
    trace: str | None = None

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and (
            isinstance(self.budget_bytes, bool)
            or not isinstance(self.budget_bytes, int)
            or self.budget_bytes <= 0
        ):
            raise ConfigError(
                f"dtr: budget_bytes must be a positive int, got {self.budget_bytes!r}"
            )
        if self.heuristic not in HEURISTICS:
            raise ConfigError(
                f"dtr: unknown heuristic {self.heuristic!r}; valid: {', '.join(HEURISTICS)}"
            )
        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace):
            raise ConfigError(f"dtr: trace must be a file path, got {self.trace!r}")
        if self.cost_model not in COST_MODELS:
            raise ConfigError(
                f"dtr: unknown cost_model {self.cost_model!r}; valid: {', '.join(COST_MODELS)}"
            )
        for name in ("stress", "check", "force_python"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"dtr: option {name} must be a bool, got {getattr(self, name)!r}")
        for name in ("seed", "min_evict_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"dtr: option {name} must be an int >= 0, got {value!r}")


OPTIONS = ("stress", "seed", "min_evict_bytes", "check", "cost_model", "trace")


def parse_budget(value: object, source: str = "budget") -> int | None:
    """Budget in bytes from an int or a string with a unit; None stays None."""
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise ConfigError(f"dtr: invalid {source} {value!r} ({exc}); expected {ACCEPTED}") from None


def _env_flag(env: Mapping[str, str], name: str) -> bool | None:
    raw = env.get(name)
    if raw is None:
        return None
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(
        f"dtr: environment variable {name}={raw!r} must be one of {', '.join(_TRUE + _FALSE[:-1])}"
    )


def force_python(env: Mapping[str, str] | None = None) -> bool:
    """DTR_FORCE_PYTHON=1 selects the pure-Python core."""
    return bool(_env_flag(os.environ if env is None else env, ENV_FORCE_PYTHON))


def resolve(
    budget: object = None,
    heuristic: str | None = None,
    env: Mapping[str, str] | None = None,
    **options: object,
) -> DTRConfig:
    """Combine explicit arguments, environment variables and defaults into a DTRConfig."""
    env = os.environ if env is None else env
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"dtr: unknown option(s) {', '.join(unknown)}; valid options: {', '.join(OPTIONS)}"
        )
    if budget is None:
        raw = env.get(ENV_BUDGET, "").strip()
        budget_bytes = parse_budget(raw, f"{ENV_BUDGET} value") if raw else None
    else:
        budget_bytes = parse_budget(budget)
    if heuristic is None:
        heuristic = env.get(ENV_HEURISTIC, "").strip() or "dtr"
        if heuristic not in HEURISTICS:
            raise ConfigError(
                f"dtr: unknown heuristic {heuristic!r} in {ENV_HEURISTIC}; "
                f"valid: {', '.join(HEURISTICS)}"
            )
    elif not isinstance(heuristic, str):
        raise ConfigError(
            f"dtr: heuristic must be a string, got {heuristic!r}; valid: {', '.join(HEURISTICS)}"
        )
    stress = options.get("stress")
    if stress is None:
        stress = bool(_env_flag(env, ENV_STRESS))
    check = options.get("check")
    if check is None:
        check = bool(_env_flag(env, ENV_DEBUG))
    cost_model = options.get("cost_model")
    if cost_model is None:
        cost_model = env.get(ENV_COST_MODEL, "").strip() or "time"
    trace = options.get("trace")
    if trace is None:
        trace = env.get(ENV_TRACE, "").strip() or None
    elif hasattr(trace, "__fspath__"):
        trace = str(trace)
    return DTRConfig(
        budget_bytes=budget_bytes,
        cost_model=cost_model,
        trace=trace,
        heuristic=heuristic,
        stress=stress,
        seed=options.get("seed", 0),
        min_evict_bytes=options.get("min_evict_bytes", 0),
        check=check,
        force_python=force_python(env),
    )

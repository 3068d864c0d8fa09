"""Every setting dtr reads, and the one place environment variables are parsed.

Explicit arguments to :func:`dtr.enable` beat the environment; the environment beats the
defaults. Each value is validated here, so a bad one fails at ``enable()`` time with a
message naming the variable or argument, the value, and what is accepted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Mapping

from . import device as _device
from . import engines as _engines
from .core.reference import DEFAULT_HEURISTIC, HEURISTICS
from .cost import COST_MODELS, DEFAULT_COST_MODEL
from .errors import ConfigError
from .units import ACCEPTED, MAX_BYTES, parse_bytes

ENV_BUDGET = "DTR_MEMORY_BUDGET"
ENV_HEURISTIC = "DTR_HEURISTIC"
ENV_FORCE_PYTHON = "DTR_FORCE_PYTHON"
ENV_STRESS = "DTR_STRESS"
ENV_CHECK = "DTR_CHECK"
# The former name of DTR_CHECK, still read (with a DeprecationWarning) when it is unset.
ENV_CHECK_OLD = "DTR_DEBUG"
ENV_COST_MODEL = "DTR_COST_MODEL"
ENV_TRACE = "DTR_TRACE"
ENV_LOG_STEPS = "DTR_LOG_STEPS"
ENV_ENGINE = "DTR_ENGINE"
ENV_MEASURE = "DTR_MEASURE"
ENV_THRASH = "DTR_THRASH"

# "auto" (the default: the native engine unless the machine has an accelerator, ...); "native":
# managed tensors as a C++ TensorImpl, every op through one C++ fallback (proven on
# the CPU; dtr.engines.native.session); "subclass": a Python wrapper subclass and dispatch mode with a C++
# fast path, on any device. dtr/engines/__init__.py has the rule.
ENGINES = _engines.ENGINES

# What the budget is held to: "dtr", dtr's own count of the bytes it manages (the values
# of managed tensors and the constants their ops read); "allocator", everything the CUDA
# caching allocator has handed out on the device (dtr/device.py): memory dtr does not
# manage (optimizer state, tensors made outside the block, rounding) comes off the budget.
MEASURES = ("dtr", "allocator")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


# The thrash stop (Core.thrash, docs/design.md "Thrash stop"): a step may recompute at most
# (thrash - 1) x its op count (at least the previous step's, and 1000) before dtr.BudgetError.
THRASH_DEFAULT = 21.0

# Exact victim search up to this many evictable pools, sampled beyond (bench/search_scaling
# and docs/design.md "Victim search" for the measurements behind the number).
SEARCH_SAMPLE_DEFAULT = 512


@dataclasses.dataclass(frozen=True)
class DTRConfig:
    """Validated settings of one :func:`dtr.enable` session.

    Attributes:
        budget_bytes: resident-byte budget, or None for no budget (track, never evict).
        heuristic: eviction heuristic, one of ``dtr.HEURISTICS``.
        stress: evict every evictable tensor after every op (testing mode).
        seed: seed of the ``random`` heuristic.
        min_evict_bytes: pools smaller than this are never chosen as victims.
        search_sample: victim search scores every candidate while at most this many
            pools are evictable, else the best of this many sampled ones (0: always
            every candidate). Keeps a decision O(search_sample) on huge graphs.
        check: verify the core's invariants after every op (slow; for tests).
        force_python: use the pure-Python core even when the C++ one is built.
        cost_model: "roofline" (deterministic estimate, the default) or "time" (measured
            wall time, which makes eviction decisions differ from run to run).
        trace: path of an operator trace to write (see dtr.engines.subclass.trace), or None.
        timeline: how many op boundaries to keep in session.timeline() (the newest);
            0 records none.
        log_steps: log a one-line summary per optimizer step to the "dtr" logger.
        engine: the engine that runs the session, "native" or "subclass" (dtr.enable()
            resolves "auto" to one of them; see dtr/engines/__init__.py).
        measure: "dtr" or "allocator" (see MEASURES).
        thrash: the thrash stop: a step whose recomputations pass (thrash - 1) x its
            ops raises BudgetError (THRASH_DEFAULT); 0 never stops.
        cache_bytes: the idle bytes the native engine's CPU allocation cache may keep
            (0: none), or None for its default (dtr.engines.native.session.DEFAULT_CACHE). The
            native engine's own option: the subclass engine runs on PyTorch's allocator.
    """

    budget_bytes: int | None = None
    heuristic: str = DEFAULT_HEURISTIC
    stress: bool = False
    seed: int = 0
    min_evict_bytes: int = 0
    search_sample: int = SEARCH_SAMPLE_DEFAULT
    check: bool = False
    force_python: bool = False
    cost_model: str = DEFAULT_COST_MODEL
    trace: str | None = None
    timeline: int = 0
    log_steps: bool = False
    engine: str = "subclass"
    measure: str = "dtr"
    thrash: float = THRASH_DEFAULT
    cache_bytes: int | None = None

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
        if self.trace is not None:
            _check_trace_path(self.trace)
        if self.engine not in _engines.RUNNABLE:
            raise ConfigError(
                f"dtr: engine must be 'native' or 'subclass' here, got {self.engine!r} "
                "(dtr.enable() resolves 'auto')"
            )
        if self.cost_model not in COST_MODELS:
            raise ConfigError(
                f"dtr: unknown cost_model {self.cost_model!r}; valid: {', '.join(COST_MODELS)}"
            )
        if self.measure not in MEASURES:
            raise ConfigError(
                f"dtr: unknown measure {self.measure!r}; valid: {', '.join(MEASURES)}"
            )
        _check_thrash(self.thrash)
        if self.cache_bytes is not None and self.engine != "native":
            raise ConfigError(
                f"dtr: option cache sizes the native engine's CPU allocation cache; the "
                f"{self.engine} engine has none (it allocates through PyTorch's allocator): "
                "drop cache, or pass engine='native'"
            )
        for name in ("stress", "check", "force_python", "log_steps"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"dtr: option {name} must be a bool, got {getattr(self, name)!r}")
        for name in ("seed", "min_evict_bytes", "search_sample", "timeline"):
            value = getattr(self, name)
            # the engines keep these in int64 (a larger one failed in C++ at entry)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_BYTES
            ):
                raise ConfigError(
                    f"dtr: option {name} must be an int from 0 to {MAX_BYTES} (2**63 - 1), "
                    f"got {value!r}"
                )


def _check_thrash(thrash: object) -> None:
    if (
        isinstance(thrash, bool)
        or not isinstance(thrash, (int, float))
        or not (thrash == 0 or (math.isfinite(thrash) and thrash > 1))
    ):
        raise ConfigError(
            f"dtr: thrash must be a finite number > 1 (a step may recompute thrash - 1 "
            f"times its ops), or 0 or None for no thrash stop, got {thrash!r} "
            f"(option thrash or {ENV_THRASH})"
        )


def _thrash(options: Mapping[str, object], env: Mapping[str, str], stress: bool) -> object:
    """The thrash option (thrash=None: 0, no stop), else DTR_THRASH, else THRASH_DEFAULT;
    with stress, 0: stress mode recomputes every reuse by design, not for want of memory
    (tests/engines/native/test_native.py's 224-op transformer: ~90 recomputations per op)."""
    if "thrash" in options:
        value = options["thrash"]
        return 0.0 if value is None else value
    raw = env.get(ENV_THRASH, "").strip()
    if not raw:
        return 0.0 if stress else THRASH_DEFAULT
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(
            f"dtr: environment variable {ENV_THRASH}={raw!r} must be a number > 1, or 0 "
            "for no thrash stop"
        ) from None


def _check_trace_path(trace: str) -> None:
    """A trace path the session can open for writing, checked at enable() time (the
    session opens the file only when it is entered)."""
    where = f"dtr: trace {trace!r} (option trace or {ENV_TRACE})"
    folder = os.path.dirname(os.path.abspath(trace))
    if not os.path.isdir(folder):
        raise ConfigError(
            f"{where}: folder {folder!r} does not exist; give a file path in an existing folder"
        )
    if os.path.isdir(trace):
        raise ConfigError(f"{where} is a folder; give a file path (such as run.jsonl) in it")


OPTIONS = (
    "stress",
    "seed",
    "min_evict_bytes",
    "search_sample",
    "check",
    "cost_model",
    "trace",
    "timeline",
    "log_steps",
    "engine",
    "measure",
    "thrash",
    "cache",  # the native engine's only (DTRConfig.cache_bytes)
)
TIMELINE_DEFAULT = 1_000_000  # timeline=True: ~100 MB of Python objects at most


def parse_budget(value: object, source: str = "budget") -> int | None:
    """Budget in bytes from an int or a string with a unit; None stays None."""
    if value is None:
        return None
    try:
        if isinstance(value, str) and value.strip().endswith("%"):
            return _percent_of_device(value)
        return parse_bytes(value)
    except ValueError as exc:
        raise ConfigError(f"dtr: invalid {source} {value!r} ({exc}); expected {ACCEPTED}") from None


def _percent_of_device(value: str) -> int:
    """'80%': that fraction of the device's total memory (dtr.device)."""
    try:
        percent = float(value.strip()[:-1])
    except ValueError:
        raise ValueError("not a number before '%'") from None
    if not 0 < percent <= 100:  # NaN fails this too
        raise ValueError("a percentage must be in (0, 100]")
    total, _ = _device.total_memory_bytes()
    return parse_bytes(int(total * percent / 100))


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


def _env_check(env: Mapping[str, str]) -> bool | None:
    """DTR_CHECK, else its former name DTR_DEBUG (with a DeprecationWarning)."""
    if env.get(ENV_CHECK) is not None or env.get(ENV_CHECK_OLD) is None:
        return _env_flag(env, ENV_CHECK)
    warnings.warn(
        f"dtr: {ENV_CHECK_OLD} is now called {ENV_CHECK} (as the option check=)",
        DeprecationWarning,
        stacklevel=4,
    )
    return _env_flag(env, ENV_CHECK_OLD)


def _env_choice(
    env: Mapping[str, str], name: str, option: str, default: str, valid: tuple[str, ...]
) -> str:
    """One of `valid` from environment variable `name` (unset or empty: `default`); an
    error names the variable, as for an explicit option the error names the option."""
    value = env.get(name, "").strip() or default
    if value not in valid:
        raise ConfigError(f"dtr: unknown {option} {value!r} in {name}; valid: {', '.join(valid)}")
    return value


def _engine(engine, env: Mapping[str, str], python_core: bool, measure: str) -> str:
    """The engine that runs the session, "native" or "subclass": from the option, else
    DTR_ENGINE, else "auto", which dtr/engines/__init__.py resolves."""
    names = (*ENGINES, *_engines.OLD_NAMES)
    if engine is None:
        engine = _env_choice(env, ENV_ENGINE, "engine", "auto", names)
    elif engine not in names:
        raise ConfigError(f"dtr: unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    if engine in _engines.OLD_NAMES:
        new = _engines.OLD_NAMES[engine]
        warnings.warn(
            f"dtr: engine {engine!r} is now called {new!r} (the default is 'auto')",
            DeprecationWarning,
            stacklevel=4,
        )
        engine = new
    if engine == "auto":
        engine, _ = _engines.choose(python_core, measure)
    return engine


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
        heuristic = _env_choice(env, ENV_HEURISTIC, "heuristic", DEFAULT_HEURISTIC, HEURISTICS)
    elif not isinstance(heuristic, str):
        raise ConfigError(
            f"dtr: heuristic must be a string, got {heuristic!r}; valid: {', '.join(HEURISTICS)}"
        )
    stress = options.get("stress")
    if stress is None:
        stress = bool(_env_flag(env, ENV_STRESS))
    check = options.get("check")
    if check is None:
        check = bool(_env_check(env))
    cost_model = options.get("cost_model")
    if cost_model is None:
        cost_model = _env_choice(
            env, ENV_COST_MODEL, "cost_model", DEFAULT_COST_MODEL, COST_MODELS
        )
    trace = options.get("trace")
    if trace is None:
        trace = env.get(ENV_TRACE, "").strip() or None
    elif hasattr(trace, "__fspath__"):
        trace = str(trace)
    log_steps = options.get("log_steps")
    if log_steps is None:
        log_steps = bool(_env_flag(env, ENV_LOG_STEPS))
    measure = options.get("measure")
    if measure is None:
        measure = _env_choice(env, ENV_MEASURE, "measure", "dtr", MEASURES)
    if measure == "allocator":
        _device.allocator_meter()  # no CUDA: a ConfigError now, at enable() time
    engine = _engine(options.get("engine"), env, force_python(env), measure)
    cache = options.get("cache")
    cache_bytes = None if cache is None else 0 if cache == 0 else parse_budget(cache, "cache")
    timeline = options.get("timeline", 0)
    if timeline is True:
        timeline = TIMELINE_DEFAULT
    elif timeline is False:
        timeline = 0
    return DTRConfig(
        budget_bytes=budget_bytes,
        timeline=timeline,
        log_steps=log_steps,
        cost_model=cost_model,
        trace=trace,
        heuristic=heuristic,
        stress=stress,
        seed=options.get("seed", 0),
        min_evict_bytes=options.get("min_evict_bytes", 0),
        search_sample=options.get("search_sample", SEARCH_SAMPLE_DEFAULT),
        check=check,
        force_python=force_python(env),
        engine=engine,
        measure=measure,
        thrash=_thrash(options, env, stress),
        cache_bytes=cache_bytes,
    )

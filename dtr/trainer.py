"""Hugging Face ``transformers.Trainer`` under dtr.

Two ways, same result:

    # 1. wrap the call (simplest; also right if training raises)
    with dtr.enable(budget="2GiB") as session:
        trainer.train()

    # 2. from the Trainer's own configuration, with a callback
    from dtr.trainer import DTRCallback, DTRTrainingArguments
    args = DTRTrainingArguments(output_dir="out", dtr_budget="2GiB", dtr_heuristic="dtr")
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[DTRCallback()])
    trainer.train()
    callback.session.stats(), callback.session.steps()

The callback opens a dtr session when training begins and closes it when training ends;
each Trainer step (one optimizer update, after any gradient accumulation) is one dtr
step (:meth:`dtr.Session.end_step`, logged to the "dtr" logger at INFO). If training
raises, the Trainer calls no callback: call ``callback.close()`` (or use way 1).
``DTRCallback(engine=...)`` picks the engine, as dtr.enable does (default "auto").
Importing this module needs ``transformers``.
"""

from __future__ import annotations

import dataclasses

try:
    from transformers import TrainerCallback, TrainingArguments
except ImportError as exc:  # pragma: no cover - explained to the user
    raise ImportError(
        "dtr: dtr.trainer needs Hugging Face transformers (pip install transformers); "
        "without it, wrap your loop in `with dtr.enable(...)` instead"
    ) from exc

from .errors import ConfigError
from .session import Session, enable


@dataclasses.dataclass
class DTRTrainingArguments(TrainingArguments):
    """TrainingArguments with dtr's settings (None: the environment, then dtr's default).

    Attributes:
        dtr_budget: the memory budget, as for dtr.enable(budget=...): "2GiB", bytes, ...
        dtr_heuristic: the eviction heuristic, as for dtr.enable(heuristic=...).
    """

    dtr_budget: str | None = dataclasses.field(
        default=None, metadata={"help": "dtr memory budget, e.g. '2GiB' (DTR_MEMORY_BUDGET)"}
    )
    dtr_heuristic: str | None = dataclasses.field(
        default=None, metadata={"help": "dtr eviction heuristic, e.g. 'dtr' (DTR_HEURISTIC)"}
    )


class DTRCallback(TrainerCallback):
    """Runs ``Trainer.train()`` inside a dtr session.

    Args:
        budget, heuristic, **options: as for :func:`dtr.enable`; when budget or heuristic
            is None, ``args.dtr_budget`` / ``args.dtr_heuristic`` of a
            :class:`DTRTrainingArguments` are used, then the environment.

    Attributes:
        session: the session of the last (or current) training run, None before one.
    """

    def __init__(self, budget: object = None, heuristic: str | None = None, **options):
        if "log_steps" in options:
            raise ConfigError(
                "dtr: DTRCallback ends a dtr step at every Trainer step by itself; "
                "drop the log_steps option"
            )
        self.budget, self.heuristic, self.options = budget, heuristic, options
        self.session: Session | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.close()  # a run that raised left its session open
        budget = self.budget if self.budget is not None else getattr(args, "dtr_budget", None)
        heuristic = self.heuristic or getattr(args, "dtr_heuristic", None)
        session = enable(budget, heuristic, **self.options)
        session.__enter__()
        self.session = session

    def on_step_end(self, args, state, control, **kwargs):
        if self.session is not None and self.session.active:
            self.session.end_step()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Leave the session if it is still open (idempotent)."""
        if self.session is not None and self.session.active:
            self.session.__exit__(None, None, None)

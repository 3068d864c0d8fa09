"""A Hugging Face Trainer run under dtr (dtr/trainer.py): a tiny random-init GPT-2 trained
for a few steps with dropout on and gradient accumulation, under a budget from
DTRTrainingArguments, equals the same Trainer run without dtr bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dtr  # noqa: E402
from dtr.trainer import DTRCallback, DTRTrainingArguments  # noqa: E402

STEPS = 3


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, length=24, vocab=64):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model():
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _train(tmp_path, callback=None, **dtr_args):
    args = DTRTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=7,
        disable_tqdm=True,
        **dtr_args,
    )
    model = _model()
    callbacks = [callback] if callback is not None else []
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=callbacks
    )
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("eager"))


@pytest.fixture(scope="module")
def unbudgeted_peak(tmp_path_factory):
    cb = DTRCallback()
    _train(tmp_path_factory.mktemp("peak"), cb)
    return cb.session.stats().peak_resident_bytes


def test_trainer_under_a_budget_from_training_arguments(tmp_path, eager, unbudgeted_peak, caplog):
    caplog.set_level(logging.INFO, logger="dtr")
    cb = DTRCallback(cost_model="roofline")
    budget = int(unbudgeted_peak * 0.6)
    params = _train(tmp_path, cb, dtr_budget=f"{budget}B", dtr_heuristic="dtr_eq")
    stats = cb.session.stats()
    assert stats.budget_bytes == budget and stats.heuristic == "dtr_eq"
    assert stats.evictions > 0 and stats.remats > 0
    assert stats.peak_resident_bytes <= stats.budget_bytes
    assert not cb.session.active and dtr.session.current() is None
    assert [s.step for s in cb.session.steps()] == list(range(1, STEPS + 1))
    assert sum(1 for r in caplog.records if r.getMessage().startswith("dtr step")) == STEPS
    for name, value in eager.items():
        assert type(params[name]) is torch.Tensor
        assert torch.equal(params[name], value), f"{name} differs from the eager Trainer run"


def test_callback_arguments_beat_training_arguments(tmp_path, eager, unbudgeted_peak):
    cb = DTRCallback(budget=int(unbudgeted_peak * 0.7), heuristic="dtr")
    params = _train(tmp_path, cb, dtr_budget="1GiB", dtr_heuristic="lru")
    stats = cb.session.stats()
    assert stats.budget_bytes == int(unbudgeted_peak * 0.7) and stats.heuristic == "dtr"
    assert all(torch.equal(params[k], v) for k, v in eager.items())


def test_a_failed_run_is_closed_by_the_next_one(tmp_path):
    cb = DTRCallback()
    cb.on_train_begin(None, None, None)  # as the Trainer does, then training raises
    assert cb.session.active
    with pytest.raises(dtr.DTRError, match="already (active|open)"):
        dtr.enable().__enter__()
    cb.close()
    assert dtr.session.current() is None
    with pytest.raises(dtr.ConfigError, match="log_steps"):
        DTRCallback(log_steps=True)


def test_trainer_on_either_engine(tmp_path, eager, engine):
    """DTRCallback(engine=...): the Trainer's run on each engine, under a budget that binds
    (0.6 of that engine's own unbudgeted peak), bitwise as eager."""
    free = DTRCallback(engine=engine)
    _train(tmp_path / "free", free)
    budget = int(free.session.stats().peak_resident_bytes * 0.6)
    cb = DTRCallback(engine=engine, cost_model="roofline")
    params = _train(tmp_path / "run", cb, dtr_budget=f"{budget}B")
    stats = cb.session.stats()
    assert cb.session.engine == engine and stats.budget_bytes == budget
    assert stats.evictions > 0 and stats.remats > 0
    assert stats.peak_resident_bytes <= budget and not cb.session.active
    assert [s.step for s in cb.session.steps()] == list(range(1, STEPS + 1))
    for name, value in eager.items():
        assert type(params[name]) is torch.Tensor
        assert torch.equal(params[name], value), f"{name} differs from the eager Trainer run"

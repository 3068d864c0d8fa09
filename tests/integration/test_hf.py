"""Hugging Face ``transformers`` models nobody here wrote, trained bitwise identically to
eager PyTorch.

Both are built from a config with random weights (no download): GPT-2 (causal LM, eager
attention, dropout, the LM head tied to the token embedding) and BERT (masked LM, SDPA
attention with dropout, a padding attention mask). The loops are the ones the
transformers docs teach: the model computes its own loss from ``labels``, the whole
output object stays alive across the optimizer step, gradients are clipped, and AdamW
runs with a linear warm-up schedule (SGD with momentum as the second optimizer). After
training, ``model.eval()`` and an evaluation under ``torch.no_grad()`` inside the block.

Runs and comparisons are those of ``tests/integration/test_nn_blocks.py`` (``check``, in
tests/utils.py), under both engines (the subclass engine and the native one): eagerly; under
dtr with no budget, which reports the peak P; at 50% and 30% of P, where dtr must both
evict and recompute and stay within the budget; and in stress mode on a one-layer
version. Losses, gradients after every step, evaluation logits, parameters and buffers
must be equal in every bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel
from transformers import logging as hf_logging
from transformers.optimization import get_linear_schedule_with_warmup

import dtr
from tests.utils import Case, check, record_grads

VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers():
    # Small vocabularies make transformers warn about default special-token ids.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity(level)


def _gpt2_build(small: bool):
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=1 if small else 4,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    g = torch.Generator().manual_seed(1)
    batch, seq = (2, 8) if small else (4, 32)
    data = []
    for _ in range(2 if small else 3):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    return model, data


def _bert_build(small: bool):
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1 if small else 4,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    model = BertForMaskedLM(config)
    assert config.hidden_dropout_prob > 0 and config.attention_probs_dropout_prob > 0
    g = torch.Generator().manual_seed(2)
    batch, seq = (2, 8) if small else (4, 32)
    data = []
    for _ in range(2 if small else 3):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, seq // 2 :] = 0  # the first sequence is padded
        # Predict 30% of the real tokens; -100 is ignored by the loss.
        labels = torch.where((torch.rand(batch, seq, generator=g) < 0.3) & (mask == 1), ids, -100)
        data.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return model, data


def _train(optimizer: str, model, data, run):
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=4)
    for batch in data:
        outputs = model(**batch)  # kept until the next step, as in the docs' loops
        outputs.loss.backward()
        run.outputs.append(nn.utils.clip_grad_norm_(params, 1.0))
        record_grads(run, model)
        opt.step()
        sched.step()
        opt.zero_grad()
        run.losses.append(outputs.loss.item())
    model.eval()
    with torch.no_grad():
        inputs = {k: v for k, v in data[0].items() if k != "labels"}
        run.outputs.append(dtr.materialize(model(**inputs).logits))
    model.train()


# AdamW, as the transformers docs train, in every mode; SGD with momentum as a second
# optimizer at the tightest budget only (each run costs seconds on the test machine).
CASES = {
    f"{model}-{optimizer}": Case(
        f"{model}-{optimizer}",
        build,
        functools.partial(_train, optimizer),
        ratios=(0.5, 0.3) if optimizer == "adamw" else (0.3,),
        stress=optimizer == "adamw",
    )
    for model, build in (("gpt2", _gpt2_build), ("bert", _bert_build))
    for optimizer in ("adamw", "sgd")
}


@pytest.mark.parametrize(
    "name, mode", [(name, mode) for name, case in CASES.items() for mode in case.modes()]
)
def test_hf_model_matches_eager(name, mode):
    check(CASES[name], mode)


@pytest.mark.parametrize(
    "name, mode", [(name, mode) for name, case in CASES.items() for mode in case.modes()]
)
def test_native_hf_model_matches_eager(name, mode):
    """The same loops under the native engine."""
    pytest.importorskip("dtr._C", reason="the native engine is C++")
    check(CASES[name], mode, engine="native")

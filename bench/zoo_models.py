"""The zoo: models from the libraries users train with (torchvision, timm, transformers),
random init at small sizes, and the repo's programs in the shapes those models take
(bench/models.py SHAPES). Each entry builds its model and batches from seeds; ``loss``
runs one forward pass to a scalar."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import models
from .thirdparty import require


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    source: str  # the library the model comes from ("bench" for the repo's programs)
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]


def _images(n: int = 4, size: int = 64, classes: int = 10):
    def batch(g):
        return torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)

    return batch


def _classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _torchvision(name: str, **kwargs) -> Callable[[], nn.Module]:
    return lambda: getattr(require("torchvision").models, name)(num_classes=10, **kwargs)


def _timm(name: str, **kwargs) -> Callable[[], nn.Module]:
    return lambda: require("timm").create_model(name, pretrained=False, num_classes=10, **kwargs)


def _swin() -> nn.Module:
    swin = require("timm.models.swin_transformer")
    return swin.SwinTransformer(
        img_size=64, patch_size=4, window_size=4, embed_dim=32, depths=(2, 2, 2),
        num_heads=(2, 4, 8), num_classes=10,
    )


VOCAB = 256


def _token_batch(n: int = 4, seq: int = 32):
    def batch(g):
        return (torch.randint(0, VOCAB, (n, seq), generator=g),)

    return batch


def _causal_lm(model, batch):
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def _masked_lm(model, batch):
    (ids,) = batch
    labels = torch.where(ids % 7 == 0, ids, torch.full_like(ids, -100))
    return model(input_ids=ids, labels=labels).loss


def _seq2seq(model, batch):
    (ids,) = batch
    return model(input_ids=ids, labels=ids.flip(1)).loss


def _hf(model_class: str, config_class: str, **config) -> Callable[[], nn.Module]:
    def build():
        transformers = require("transformers")
        cfg = getattr(transformers, config_class)(vocab_size=VOCAB, **config)
        return getattr(transformers, model_class)(cfg)

    return build


_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def _bench(name: str) -> Entry:
    spec = models.SHAPES[name]
    n = spec.batch_size(1)
    return Entry(name, "bench", lambda: spec.build(1), lambda g: spec.batch(g, 1, n), spec.loss)


ZOO: dict[str, Entry] = {
    e.name: e
    for e in [
        Entry("resnet18", "torchvision", _torchvision("resnet18"), _images(), _classify),
        Entry("mobilenet_v3_small", "torchvision", _torchvision("mobilenet_v3_small"), _images(), _classify),
        Entry("efficientnet_b0", "torchvision", _torchvision("efficientnet_b0"), _images(), _classify),
        Entry("densenet121", "torchvision", _torchvision("densenet121"), _images(2), _classify),
        Entry("shufflenet_v2", "torchvision", _torchvision("shufflenet_v2_x0_5"), _images(), _classify),
        Entry("convnext_atto", "timm", _timm("convnext_atto"), _images(), _classify),
        Entry("vit_tiny", "timm", _timm("vit_tiny_patch16_224", img_size=64), _images(), _classify),
        Entry("swin_small_config", "timm", _swin, _images(), _classify),
        Entry("regnetx_002", "timm", _timm("regnetx_002"), _images(), _classify),
        Entry(
            "gpt2", "transformers",
            _hf("GPT2LMHeadModel", "GPT2Config", n_embd=64, n_layer=2, n_head=4, n_positions=64),
            _token_batch(), _causal_lm,
        ),
        Entry(
            "llama", "transformers",
            _hf("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, **_DECODER),
            _token_batch(), _causal_lm,
        ),
        Entry(
            "qwen2", "transformers",
            _hf("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2, **_DECODER),
            _token_batch(), _causal_lm,
        ),
        Entry(
            "bert", "transformers",
            _hf("BertForMaskedLM", "BertConfig", **_DECODER),
            _token_batch(), _masked_lm,
        ),
        Entry(
            "t5", "transformers",
            _hf("T5ForConditionalGeneration", "T5Config", d_model=64, d_ff=128, d_kv=16,
                num_layers=2, num_heads=4, decoder_start_token_id=0),
            _token_batch(), _seq2seq,
        ),
        Entry(
            "mamba", "transformers",
            _hf("MambaForCausalLM", "MambaConfig", hidden_size=64, state_size=8, num_hidden_layers=2),
            _token_batch(), _causal_lm,
        ),
        Entry(
            "rwkv", "transformers",
            _hf("RwkvForCausalLM", "RwkvConfig", hidden_size=64, attention_hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, context_length=64),
            _token_batch(), _causal_lm,
        ),
        *(_bench(name) for name in models.SHAPES),
    ]
}

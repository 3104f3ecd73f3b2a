"""Every causal-LM architecture of the installed transformers, built tiny and random from its default config: where
transformers' own ``DynamicCache`` generates, ``AsymKVCache`` generates the same tokens with a window wider than the
run, and runs (quantizing what it can) with a small one; where it has sliding-window layers, the same again with
those quantized too (``quantize_sliding=True``).

A model without any attention layer (Mamba and other recurrent-only models) is refused with a ``ValueError``: a KV
cache has nothing to hold there. Layer types the cache does not know (transformers adds some every release: ``hybrid``, ``hybrid_sliding``,
``heavily_compressed_attention``, ...) are kept as transformers' own layers, with one
:class:`~hf_asymkv.core.cache.UnquantizedLayersWarning` naming them (issue 41: three architectures of 5.25 were
refused outright). An architecture is skipped, with the reason, where its shrunk default config does not build or
its ``DynamicCache`` run fails (encoder-decoder heads, models that need extra inputs, ...); that is transformers'
side, not ours. Run once, on the newest transformers (CI step 1); each architecture costs well under a second.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hf_asymkv import AsymKVCache, cache_kwargs
from hf_asymkv.bench.memory import cache_nbytes
from hf_asymkv.core.cache import UnquantizedLayersWarning
from hf_asymkv.core.shapes import layer_shapes

pytestmark = pytest.mark.usefixtures("single_thread")

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, vocab_size=1024, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
"""Given at construction to every config whose default has the attribute (so that derived fields, such as
``layer_types``, follow); the others keep their defaults."""
MOE_SIZES = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=64, shared_expert_intermediate_size=64)
"""Also given where the config accepts them (a config that refuses them is built without)."""
MAX_PARAMETERS = 20_000_000
"""A config that stays larger than this after shrinking (nested sub-configs) is skipped: not tiny."""
PROMPT, NEW = 12, 12
SMALL = dict(residual_length=8, key_block_size=8)  # 4 sinks + 8 + 8: the run quantizes a block


def _config(name: str):
    default = CONFIG_MAPPING[name]()
    sizes = {k: v for k, v in SIZES.items() if hasattr(default, k)}
    try:
        return CONFIG_MAPPING[name](**sizes, **{k: v for k, v in MOE_SIZES.items() if hasattr(default, k)})
    except Exception:  # a model whose validation refuses the MoE sizes (ZAYA: one expert per token)
        return CONFIG_MAPPING[name](**sizes)


def _tiny(name: str):
    config = _config(name)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if parameters > MAX_PARAMETERS:
        pytest.skip(f"{name}: {parameters / 1e6:.0f}M parameters after shrinking the default config")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # a fixed number of tokens
    return model


def _generate(model, ids, cache) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, **cache_kwargs(cache), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


@pytest.mark.parametrize("name", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_asymkv_generates_what_dynamic_cache_does(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own notes on shrunk configs
        try:
            model = _tiny(name)
            ids = torch.randint(3, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
            reference = _generate(model, ids, DynamicCache(config=model.config))
        except Exception as exc:  # transformers' side: the architecture does not run this way
            pytest.skip(f"{name}: DynamicCache run fails: {type(exc).__name__}: {str(exc)[:120]}")
    shapes = layer_shapes(model.config)
    if not any(s.holds_kv or s.unknown for s in shapes):  # recurrent only (Mamba, ...): no K/V to quantize
        with pytest.raises(ValueError, match="has no attention layers"):
            AsymKVCache(model.config)
        return
    unknown = sorted({s.layer_type for s in shapes if s.unknown})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnquantizedLayersWarning)
        wide = AsymKVCache(model.config, residual_length=4096)
        small = AsymKVCache(model.config, **SMALL)
    said = [w for w in caught if issubclass(w.category, UnquantizedLayersWarning)]
    assert len(said) == (2 if unknown else 0)  # one per cache, naming the types
    assert all(str(unknown) in str(w.message) for w in said)
    assert torch.equal(_generate(model, ids, wide), reference)
    assert _generate(model, ids, small).shape == reference.shape
    assert small.memory_footprint()["total"] == cache_nbytes(small)
    if any(s.layer_type == "sliding_attention" for s in shapes):  # quantize_sliding: our layer in their place
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnquantizedLayersWarning)
            wide = AsymKVCache(model.config, residual_length=4096, quantize_sliding=True)
            small = AsymKVCache(model.config, **SMALL, quantize_sliding=True)
        assert torch.equal(_generate(model, ids, wide), reference)
        assert _generate(model, ids, small).shape == reference.shape
        assert small.memory_footprint()["total"] == cache_nbytes(small)

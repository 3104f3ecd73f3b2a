"""The static cache's attention over its codes (``attn_implementation="asymkv_sdpa"`` with ``max_cache_len``) against
SDPA over the static layer's dense read-out: layer by layer across block flushes (left padding, grouped-query heads,
several storage formats), and through ``generate``. The compiled form is in ``test_static_compile.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig

from hf_asymkv import AsymKVCache, AsymKVConfig, cache_kwargs, register_attention
from hf_asymkv.core.attention import ATTN_IMPLEMENTATION, FUSED_MAX_QUERY_TOKENS, asymkv_sdpa_attention
from hf_asymkv.core.quant import sqnr_db
from hf_asymkv.core.static_attention import StaticQuantizedKV, static_fused_attention

pytestmark = pytest.mark.releases  # depends on transformers' behaviour: CI reruns it on older releases

PROMPT, STEPS, PADS = 40, 24, 9
SMALL = dict(key_block_size=8, residual_length=8)  # a flush every 8 tokens
CONFIGS = {  # the presets' formats, and the other kinds of scales the fused path reads
    "balanced": AsymKVConfig(**SMALL),
    "compact": AsymKVConfig(key_format="int4", key_symmetric=False, value_bits=3, **SMALL),
    "int2-keys-2-bit-values": AsymKVConfig(key_format="int2", key_symmetric=False, value_bits=2, **SMALL),
    "int1-values": AsymKVConfig(key_format="int3", key_symmetric=False, key_wide_fraction=0.25, value_bits=1,
                                **SMALL),
    "quality": AsymKVConfig(value_bits=6, **SMALL),
    "fp8-keys-grouped-values": AsymKVConfig(key_format="fp8_e4m3", value_group_size=8, value_rotation=False, **SMALL),
    "rotated-token-keys": AsymKVConfig(key_format="int4", key_granularity="token", key_rotation=True, **SMALL),
    "no-sinks": AsymKVConfig(sink_tokens=0, **SMALL),
    "symmetric-sub-byte": AsymKVConfig(key_format="int4", value_bits=3, value_symmetric=True, **SMALL),
    "tensor-scales": AsymKVConfig(key_granularity="tensor", value_granularity="channel", value_rotation=False,
                                  **SMALL),
    "codes-along-head-dim": AsymKVConfig(key_format="int4", key_block_size=1, value_bits=5, residual_length=8),
}


class _Module:  # what transformers' SDPA reads of an attention module
    training = False
    is_causal = True
    num_key_value_groups = 2


def _reference(q, key: StaticQuantizedKV, value: StaticQuantizedKV, mask, scaling):
    n_rep = q.shape[1] // key.shape[1]
    k, v = (t.dense().repeat_interleave(n_rep, dim=1) for t in (key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def _mask(start: int, q_len: int, max_len: int) -> torch.Tensor:
    """``[2, 1, q, max_len]`` bool: causal from ``start``; row 1 does not see its ``PADS`` left pads."""
    position = torch.arange(max_len)
    causal = position[None, :] <= (start + torch.arange(q_len))[:, None]
    rows = torch.stack([causal, causal & (position >= PADS)])
    return rows[:, None]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("n_rep, q_len", [(1, 1), (2, 1), (2, 3)])
def test_fused_equals_sdpa_over_the_dense_read_out(name, n_rep, q_len):
    """Every step of a left-padded batch across flushes: the attention over the codes equals SDPA over the dense
    read-out (row 1's first real tokens live in the sink overlay once their block is stored)."""
    heads, d = 2, 16
    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=heads * n_rep,
                         num_key_value_heads=heads, head_dim=d)
    max_len = PROMPT + STEPS * q_len
    cache = AsymKVCache(config, CONFIGS[name], max_cache_len=max_len)
    layer = cache.layers[0]
    layer.return_views = True
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2, heads, max_len, d, generator=g) * 2 for _ in range(2))
    queries = torch.randn(2, heads * n_rep, max_len, d, generator=g)
    positions = torch.stack([torch.arange(PROMPT), (torch.arange(PROMPT) - PADS).clamp(min=0)])
    layer.update(keys[:, :, :PROMPT], values[:, :, :PROMPT], kwargs={"position_ids": positions})
    for start in range(PROMPT, max_len, q_len):
        span = slice(start, start + q_len)
        pos = torch.stack([torch.arange(start, start + q_len), torch.arange(start, start + q_len) - PADS])
        key, value = layer.update(keys[:, :, span], values[:, :, span], kwargs={"position_ids": pos})
        assert isinstance(key, StaticQuantizedKV) and key.shape == (2, heads, max_len, d)
        q, mask = queries[:, :, span], _mask(start, q_len, max_len)
        got = static_fused_attention(q, key, value, mask, 0.25)
        want = _reference(q, key, value, mask, 0.25)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"{name}, step at {start}")
    stored = int(layer.blocks_stored) * layer.block_size
    assert stored >= 3 * layer.block_size
    if layer.sink_count:  # the overlay was read: row 1's sinks lie inside the stored blocks
        assert layer.sink_count <= PADS < layer.sink_count + stored


def _views(name: str, prefill: int, q_len: int, max_len: int, seed: int, dtype=torch.float32):
    """A one-row static layer of config ``name`` (4 query heads on 2 K/V heads of 16 channels) handing views, after a
    ``prefill``-token update: ``(key, value, query)`` of a ``q_len``-token update."""
    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    layer = AsymKVCache(config, CONFIGS[name], max_cache_len=max_len).layers[0]
    layer.return_views = True
    g = torch.Generator().manual_seed(seed)
    layer.update(*torch.randn(2, 1, 2, prefill, 16, generator=g).to(dtype))
    key, value = layer.update(*torch.randn(2, 1, 2, q_len, 16, generator=g).to(dtype))
    return key, value, torch.randn(1, 4, q_len, 16, generator=g).to(dtype)


def test_without_a_mask_it_is_causal_from_the_filled_length():
    """No mask: positions up to each query's own (the static layer's filler after them is not attended)."""
    key, value, q = _views("balanced", 30, 2, 64, seed=1)
    want = _reference(q, key, value, _mask(30, 2, 64)[:1], 0.3)
    torch.testing.assert_close(static_fused_attention(q, key, value, None, 0.3), want, atol=2e-5, rtol=1e-4)


def test_half_precision_inputs():
    key, value, q = _views("compact", 40, 1, 64, seed=2, dtype=torch.bfloat16)
    got = static_fused_attention(q, key, value, None, 0.25)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 1, 4, 16)
    k, v = (t.dense().float().repeat_interleave(2, dim=1) for t in (key, value))
    mask = _mask(40, 1, 64)[:1]
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=0.25).transpose(1, 2)
    # the dense read-out is rounded to bf16 (the layer's dtype); ours reads the codes in float32
    assert sqnr_db(want, got.float()) > 35


@pytest.mark.parametrize("why", ["sliding_window", "long_query"])
def test_refused_calls_take_sdpa_over_the_dense_read_out(monkeypatch, why):
    import hf_asymkv.core.attention as attention_mod

    calls = []
    monkeypatch.setattr(attention_mod, "static_fused_attention", lambda *a, **k: calls.append(1))
    q_len = FUSED_MAX_QUERY_TOKENS + 1 if why == "long_query" else 1
    key, value, q = _views("balanced", 40, q_len, 80, seed=3)
    mask = _mask(40, q_len, 80)[:1]
    kwargs = {"sliding_window": 4096} if why == "sliding_window" else {}
    got, _ = asymkv_sdpa_attention(_Module(), q, key, value, mask, scaling=0.25, **kwargs)
    assert not calls
    n_rep = 2
    want = torch.nn.functional.scaled_dot_product_attention(
        q, key.dense().repeat_interleave(n_rep, 1), value.dense().repeat_interleave(n_rep, 1), attn_mask=mask,
        scale=0.25).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_view_refuses_writes():
    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cache = AsymKVCache(config, max_cache_len=16)
    cache.layers[0].return_views = True
    key, _ = cache.layers[0].update(*torch.randn(2, 1, 2, 4, 16))
    with pytest.raises(ValueError, match="cannot be written"):
        key[:, :, 0] = 0.0


def test_default_attention_gets_dense_tensors_from_a_static_cache(llama):
    cache = AsymKVCache(llama.config, max_cache_len=32)
    out = cache.update(*torch.randn(2, 1, 2, 4, 16), layer_idx=0)
    assert all(isinstance(t, torch.Tensor) for t in out)


@pytest.mark.parametrize("preset", ["balanced", "compact", "max"])
def test_generate_matches_the_dense_static_path(llama, prompt, padded_batch, preset, single_thread):
    """Greedy generation, one prompt and a left-padded batch: the same tokens as the static cache's dense read-out,
    logits within float32 rounding."""
    register_attention()
    fused = copy.deepcopy(llama)
    fused.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids, mask = padded_batch
    for inputs in ({"input_ids": prompt[:, :40]}, {"input_ids": ids, "attention_mask": mask}):
        out = {}
        for tag, model in (("dense", llama), ("fused", fused)):
            cache = AsymKVCache.from_preset(preset, model.config, max_cache_len=inputs["input_ids"].shape[1] + 16,
                                            **SMALL)
            out[tag] = model.generate(**inputs, **cache_kwargs(cache), max_new_tokens=16, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True, disable_compile=True)
            assert cache.stats()["blocks_quantized"] >= 4 * len(cache.layers)
        assert torch.equal(out["dense"].sequences, out["fused"].sequences)
        assert min(sqnr_db(a, b) for a, b in zip(out["dense"].logits, out["fused"].logits)) > 80

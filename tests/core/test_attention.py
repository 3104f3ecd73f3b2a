"""The fused attention (``attn_implementation="asymkv_sdpa"``) against the reference path: decode the cache
densely, then transformers' SDPA. Float rounding differs (the fold reorders products), so tensors are compared
by SQNR; generated tokens must be identical."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from helpers import layer_config
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_asymkv import AsymKVCache, cache_kwargs, register_attention
from hf_asymkv.core.attention import (
    ATTN_IMPLEMENTATION,
    FUSED_MAX_QUERY_TOKENS,
    asymkv_sdpa_attention,
    fused_attention,
)
from hf_asymkv.core.kv_view import QuantizedKV
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.core.quant import QuantSpec, sqnr_db

pytestmark = pytest.mark.releases  # depends on transformers' behaviour: CI reruns it on older releases

SQNR_FLOOR_DB = 100.0  # fp32 rounding differences only (quantization error is identical on both paths)

# (id, key spec, value spec, sink tokens)
SPECS = [
    ("int8-channel/int4-token64", QuantSpec("int8", "channel"), QuantSpec("int4", "token", 16, symmetric=False), 0),
    ("fp8-channel/int4-token8", QuantSpec("fp8_e4m3", "channel"), QuantSpec("int4", "token", 8, symmetric=False), 0),
    ("int4sym/int4sym", QuantSpec("int4", "channel"), QuantSpec("int4", "token", 16), 0),
    ("int8-tensor/int8-tensor", QuantSpec("int8", "tensor"), QuantSpec("int8", "tensor"), 0),
    ("int8-asym-channel/int8-channel", QuantSpec("int8", "channel", symmetric=False),
     QuantSpec("int8", "channel", symmetric=False), 0),
    ("int8/int4+sinks", QuantSpec("int8", "channel"), QuantSpec("int4", "token", 16, symmetric=False), 3),
    ("int4-asym-wide/int3", QuantSpec("int4", "channel", symmetric=False, wide_fraction=0.25),
     QuantSpec("int3", "token", 16, symmetric=False), 0),
    ("int3-sym-wide/int4+sinks", QuantSpec("int3", "channel", wide_fraction=0.5),
     QuantSpec("int4", "token", 16, symmetric=False), 2),
]


class _Module(torch.nn.Module):
    """What the attention functions read from the calling attention module."""

    def __init__(self, n_rep: int):
        super().__init__()
        self.num_key_value_groups = n_rep
        self.is_causal = True


def _filled_layer(kspec, vspec, sinks, *, heads=2, tokens=70, head_dim=16, dtype=torch.float32, seed=0):
    """A layer holding ``tokens`` tokens (block 8, window 8): sinks, several quantized blocks and a window."""
    g = torch.Generator().manual_seed(seed)
    layer = AsymKVLayer(layer_config(kspec, vspec, 8, residual_length=8, sink_tokens=sinks), return_views=True)
    k = torch.randn(1, heads, tokens, head_dim, generator=g)
    k[..., 3] *= 20  # an outlier channel, as real keys have
    v = torch.randn(1, heads, tokens, head_dim, generator=g)
    layer.update(k.to(dtype), v.to(dtype))
    return layer, g


def _reference(module, q, key, value, mask, scaling):
    out, _ = sdpa_attention_forward(module, q, key.dense(), value.dense(), mask, scaling=scaling)
    return out


@pytest.mark.parametrize("q_len", [1, 5], ids=["decode", "chunk"])
@pytest.mark.parametrize("n_rep", [1, 3], ids=["mha", "gqa3"])
@pytest.mark.parametrize("kspec,vspec,sinks", [s[1:] for s in SPECS], ids=[s[0] for s in SPECS])
def test_fused_matches_reference(kspec, vspec, sinks, n_rep, q_len):
    layer, g = _filled_layer(kspec, vspec, sinks)
    new_k, new_v = torch.randn(2, 1, 2, q_len, 16, generator=g)
    key, value = layer.update(new_k, new_v)
    assert isinstance(key, QuantizedKV) and key.n_quantized > 0
    # as attention modules make it: projected [B, q, Hq, D], then transposed (not contiguous when q_len > 1)
    q = torch.randn(1, q_len, 2 * n_rep, 16, generator=g).transpose(1, 2)
    module = _Module(n_rep)
    # no mask: causal (bottom-right aligned) for q_len > 1, as SDPA's is_causal path would be
    fused = fused_attention(q, key, value, None, 0.25)
    ref = _reference(module, q, key, value, None, 0.25) if q_len == 1 else None
    if ref is None:
        kv_len = key.shape[2]
        causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]
        ref = _reference(module, q, key, value, causal, 0.25)
    assert fused.shape == ref.shape == (1, q_len, 2 * n_rep, 16)
    assert sqnr_db(ref, fused) > SQNR_FLOOR_DB


def test_fused_applies_a_padding_mask():
    """A bool mask that hides the first 10 positions of batch row 1 (left padding)."""
    kspec, vspec, _ = SPECS[0][1:]
    layer, g = _filled_layer(kspec, vspec, 0)
    layer.batch_repeat_interleave(2)
    key, value = layer.update(*torch.randn(2, 2, 2, 1, 16, generator=g))
    mask = torch.ones(2, 1, 1, key.shape[2], dtype=torch.bool)
    mask[1, :, :, :10] = False
    q = torch.randn(2, 4, 1, 16, generator=g)
    ref = _reference(_Module(2), q, key, value, mask, 0.25)
    fused = fused_attention(q, key, value, mask, 0.25)
    assert sqnr_db(ref, fused) > SQNR_FLOOR_DB
    unmasked = fused_attention(q, key, value, None, 0.25)
    assert torch.allclose(unmasked[0], fused[0]) and not torch.allclose(unmasked[1], fused[1])


def test_fused_half_precision_inputs():
    """bf16 K/V/query: scores and softmax run in fp32; the result is the reference's to bf16 accuracy."""
    kspec, vspec, _ = SPECS[0][1:]
    layer, g = _filled_layer(kspec, vspec, 0, dtype=torch.bfloat16)
    key, value = layer.update(*torch.randn(2, 1, 2, 1, 16, generator=g).bfloat16())
    q = torch.randn(1, 4, 1, 16, generator=g).bfloat16()
    fused = fused_attention(q, key, value, None, 0.25)
    assert fused.dtype == torch.bfloat16
    assert sqnr_db(_reference(_Module(2), q, key, value, None, 0.25), fused) > 35


@pytest.mark.parametrize("why", ["sliding_window", "token-keys"])
def test_unfoldable_cases_fall_back_to_dense_sdpa(why):
    kspec = QuantSpec("int8", "token", 16) if why == "token-keys" else QuantSpec("int8", "channel")
    layer, g = _filled_layer(kspec, QuantSpec("int4", "token", 16, symmetric=False), 0)
    key, value = layer.update(*torch.randn(2, 1, 2, 1, 16, generator=g))
    q = torch.randn(1, 4, 1, 16, generator=g)
    kwargs = {"sliding_window": 4} if why == "sliding_window" else {}
    out, _ = asymkv_sdpa_attention(_Module(2), q, key, value, None, scaling=0.25, **kwargs)
    ref, _ = sdpa_attention_forward(_Module(2), q, key.dense(), value.dense(), None, scaling=0.25, **kwargs)
    assert torch.equal(out, ref)


def test_softcap_is_refused_like_sdpa():
    layer, g = _filled_layer(QuantSpec("int8", "channel"), QuantSpec("int4", "token", 16, symmetric=False), 0)
    key, value = layer.update(*torch.randn(2, 1, 2, 1, 16, generator=g))
    with pytest.raises(ValueError, match="softcap"):
        asymkv_sdpa_attention(_Module(2), torch.randn(1, 4, 1, 16), key, value, None, scaling=0.25, softcap=30.0)


def test_nothing_is_registered_on_import():
    code = ("import hf_asymkv, hf_asymkv.core.attention; from transformers import AttentionInterface; "
            f"assert {ATTN_IMPLEMENTATION!r} not in AttentionInterface._global_mapping")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_attention_gets_dense_tensors(llama):
    cache = AsymKVCache(llama.config)
    assert not cache.fused_attention
    assert all(not layer.return_views for layer in cache.layers)


def _fused_copy(model):
    register_attention()
    fused = copy.deepcopy(model)
    fused.set_attn_implementation(ATTN_IMPLEMENTATION)
    return fused


@pytest.mark.parametrize("name, sliding", [("llama", False), ("hybrid", False), ("shared_kv", False), ("hybrid", True),
                                           ("shared_kv", True)],
                         ids=["llama", "hybrid", "shared_kv", "hybrid-quantized-sliding", "shared_kv-quantized-sliding"])
def test_generate_matches_reference_path(request, name, sliding, prompt, single_thread):
    """Greedy generation with a small window: same tokens, logits within fp32 rounding, with either path (quantized
    sliding layers hand the fused attention dense K/V, a window's worth)."""
    model = request.getfixturevalue(name)
    fused = _fused_copy(model)
    kwargs = {"residual_length": 8, "key_block_size": 8, "quantize_sliding": sliding}
    out = {}
    for tag, m in (("ref", model), ("fused", fused)):
        cache = AsymKVCache(m.config, **kwargs)
        assert cache.fused_attention == (tag == "fused")
        res = m.generate(prompt, **cache_kwargs(cache), max_new_tokens=12, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
        out[tag] = res
        assert cache.stats()["tokens_quantized"] > 0
    assert torch.equal(out["ref"].sequences, out["fused"].sequences)
    for a, b in zip(out["ref"].logits, out["fused"].logits):
        assert sqnr_db(a, b) > 80


def test_generate_left_padded_batch(llama, padded_batch, single_thread):
    ids, mask = padded_batch
    fused = _fused_copy(llama)
    kwargs = {"residual_length": 8, "key_block_size": 8}
    ref = llama.generate(ids, attention_mask=mask, **cache_kwargs(AsymKVCache(llama.config, **kwargs)),
                         max_new_tokens=8, do_sample=False)
    got = fused.generate(ids, attention_mask=mask, **cache_kwargs(AsymKVCache(fused.config, **kwargs)),
                         max_new_tokens=8, do_sample=False)
    assert torch.equal(ref, got)


# ------------------------------------------------------------------------------------------------ long queries
@pytest.mark.parametrize("q_len, fused_expected", [(FUSED_MAX_QUERY_TOKENS, True), (FUSED_MAX_QUERY_TOKENS + 1, False)],
                         ids=["at-threshold", "above-threshold"])
def test_long_queries_take_the_dense_path(monkeypatch, q_len, fused_expected):
    """Above the threshold the fused path (whose temporaries grow with the query) is not entered, and the result
    is exactly the reference path's."""
    import hf_asymkv.core.attention as attention_mod

    calls = []
    monkeypatch.setattr(attention_mod, "fused_attention", lambda *a, **k: calls.append(1) or fused_attention(*a, **k))
    native = attention_mod.native_fused_attention  # the CPU kernel, the default fused path on CPU
    monkeypatch.setattr(attention_mod, "native_fused_attention", lambda *a, **k: calls.append(1) or native(*a, **k))
    layer, g = _filled_layer(*SPECS[0][1:])
    key, value = layer.update(*torch.randn(2, 1, 2, q_len, 16, generator=g))
    q = torch.randn(1, 4, q_len, 16, generator=g)
    n = key.shape[2]
    mask = torch.ones(q_len, n, dtype=torch.bool).tril(n - q_len)[None, None]
    got, _ = asymkv_sdpa_attention(_Module(2), q, key, value, mask, scaling=0.25)
    assert bool(calls) == fused_expected
    want = _reference(_Module(2), q, key, value, mask, 0.25)
    if fused_expected:
        assert sqnr_db(want, got) > SQNR_FLOOR_DB
    else:
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------ per-call mode
def test_attention_mode_is_read_at_every_update(llama, prompt, single_thread):
    """Switching the model's attention after the cache was built takes effect at the next step (it used to stay
    frozen at construction: a dense model then got QuantizedKV and crashed in SDPA, or the reverse)."""
    model = copy.deepcopy(llama)
    register_attention()
    cache = AsymKVCache(model.config, residual_length=8, key_block_size=8)
    assert not cache.fused_attention
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    assert cache.fused_attention
    out_fused = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=6, do_sample=False)
    assert all(layer.return_views for layer in cache.layers)
    model.set_attn_implementation("sdpa")
    assert not cache.fused_attention
    more = model.generate(out_fused, **cache_kwargs(cache), max_new_tokens=6, do_sample=False)
    assert not any(layer.return_views for layer in cache.layers)
    ref_cache = AsymKVCache(llama.config, residual_length=8, key_block_size=8)
    first = llama.generate(prompt, **cache_kwargs(ref_cache), max_new_tokens=6, do_sample=False)
    ref = llama.generate(first, **cache_kwargs(ref_cache), max_new_tokens=6, do_sample=False)
    assert torch.equal(more, ref)


# ------------------------------------------------------------------------------------------------ generate matrix
FUSED_MODES = ["greedy", "sample", "beam", "padded_batch", "assisted", "continue", "deepcopy", "batch_select"]


@pytest.mark.parametrize("mode", FUSED_MODES, ids=FUSED_MODES)
def test_fused_generate_matrix_matches_dense(llama, llama_assistant, prompt, batch3, padded_batch, mode,
                                             single_thread):
    """Every decoding mode gives the same tokens through the fused path as through the dense one, with a small
    window so that blocks are quantized, read, rolled back and copied."""
    from test_cache import MODES, SMALL

    ctx = {"prompt": prompt, "batch3": batch3, "padded_batch": padded_batch, "assistant": llama_assistant}
    fused = _fused_copy(llama)
    dense = MODES[mode](llama, lambda: AsymKVCache(llama.config, **SMALL), ctx)
    got = MODES[mode](fused, lambda: AsymKVCache(fused.config, **SMALL), ctx)
    assert all(c.stats()["tokens_quantized"] > 0 for c in got.caches)
    assert torch.equal(got.sequences, dense.sequences)
    for a, b in got.must_match:
        assert torch.equal(a, b)

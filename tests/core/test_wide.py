"""Wide key channels (:mod:`hf_asymkv.core.wide`, ``key_wide_fraction``): the codes equal a ``bits + 1`` code on each
block's widest channels and a ``bits`` code elsewhere, every reader (dense, crop, fused, static) reads the high bits,
the bytes are what the format says, and bad settings are refused by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import llama_config
from helpers import layer_config

from hf_asymkv import AsymKVCache, AsymKVConfig, cache_kwargs
from hf_asymkv.core.config import CONFIG_VERSION
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.core.quant import QuantSpec, compute_scale_zero, dequantize, quantize
from hf_asymkv.core.store import encode_blocks
from hf_asymkv.core.wide import choose_channels

BLOCK = 16


def _keys(head_dim: int, tokens: int = 2 * BLOCK, seed: int = 0) -> torch.Tensor:
    """``[1, 2, tokens, head_dim]`` keys whose channels differ in width by 50x, in a random order per head."""
    g = torch.Generator().manual_seed(seed)
    widths = torch.stack([torch.linspace(0.1, 5, head_dim)[torch.randperm(head_dim, generator=g)] for _ in range(2)])
    return torch.randn(1, 2, tokens, head_dim, generator=g) * widths[None, :, None, :] + 0.3


def _plain(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    scale, zero = compute_scale_zero(x, spec)
    return dequantize(quantize(x, scale, zero, spec), scale, zero, spec)


@pytest.mark.parametrize("head_dim,fraction", [(64, 0.25), (16, 0.25), (80, 0.25), (64, 0.1)])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_codes_are_one_bit_wider_on_each_blocks_widest_channels(head_dim, fraction, bits, symmetric):
    spec = QuantSpec(f"int{bits}", "channel", None, symmetric, torch.bfloat16, block_size=BLOCK, wide_fraction=fraction)
    narrow = dataclasses.replace(spec, wide_fraction=0.0)
    wider = dataclasses.replace(narrow, fmt=f"int{bits + 1}")
    x = _keys(head_dim)
    codes, scale, zero, wide = encode_blocks(x, spec)
    count = spec.wide_count(head_dim)
    assert wide.channels.shape == (1, 2, 2, count) and wide.bits.shape == (1, 2, 2 * BLOCK, -(-count // 8))
    # the chosen channels are each block's widest (largest b-bit scale; equal scales: the lower channel first)
    narrow_scale, _ = compute_scale_zero(x, narrow)
    widest = narrow_scale.float().argsort(dim=-1, descending=True, stable=True)[..., :count].sort(-1).values
    assert torch.equal(wide.channels.long(), widest)
    chosen = torch.zeros(1, 2, 2, head_dim, dtype=torch.bool).scatter_(-1, widest, True)
    expected = torch.where(chosen.repeat_interleave(BLOCK, 2), _plain(x, wider), _plain(x, narrow))
    assert torch.equal(dequantize(codes, scale, zero, spec, wide=wide), expected)
    # without the high bits the wide channels decode wrong: the test sees them
    assert not torch.equal(dequantize(codes, scale, zero, spec), expected)


@pytest.mark.slow(reason="an inductor compile of the encoder; fast twin: "
                         "tests/core/test_wide.py::test_codes_are_one_bit_wider_on_each_blocks_widest_channels")
@pytest.mark.parametrize("head_dim,fraction", [(16, 0.25), (64, 0.25)])  # 4 wide slots in one byte; 16 in two
def test_inductor_encodes_what_eager_encodes(head_dim, fraction):
    """A block flushed inside a compiled step stores the eager bytes: inductor's CPU code for the high bits' packing
    once added 24 to every byte (a uint8 sum over 8 lanes, torch 2.13 on an AVX2 CPU), so a compiled cache read other
    codes than an eager one (tests/core/test_static_compile.py saw it as other tokens, 11 steps in)."""
    spec = QuantSpec("int4", "channel", None, False, torch.bfloat16, block_size=8, wide_fraction=fraction)

    def encode(x):
        codes, scale, zero, wide = encode_blocks(x, spec)
        return codes.data, scale, zero, wide.bits, wide.channels

    x = _keys(head_dim, tokens=16)
    eager = encode(x)
    compiled = torch.compile(encode, fullgraph=True, dynamic=False)(x)
    assert eager[3].max() > 0  # some high bits are set: the packing is exercised
    for name, want, got in zip(("codes", "scales", "zeros", "high bits", "channels"), eager, compiled):
        assert torch.equal(want, got), name


@pytest.mark.parametrize("head_dim", [64, 128])
def test_equal_scales_choose_the_lower_channels(head_dim):
    """Ties (frequent among bfloat16 scales) are broken by channel, not by topk's implementation, so that the Triton
    append kernel can choose the same channels."""
    scale = torch.ones(1, 1, 2, head_dim, dtype=torch.bfloat16)
    scale[0, 0, 1, -1] = 2.0  # block 1: the last channel is the widest, the others tie
    count = head_dim // 4
    channels = choose_channels(scale, count)
    assert channels[0, 0, 0].tolist() == list(range(count))
    assert channels[0, 0, 1].tolist() == list(range(count - 1)) + [head_dim - 1]


def test_a_calibrated_range_keeps_its_range_with_the_wider_step():
    spec = QuantSpec("int4", "channel", None, True, torch.bfloat16, block_size=BLOCK, wide_fraction=0.25)
    x = _keys(64)
    calibrated = torch.full((1, 2, 2, 64), 6.0 / 7, dtype=torch.bfloat16)  # range 6 for every channel
    calibrated[..., :16] = 12.0 / 7
    codes, scale, zero, wide = encode_blocks(x, spec, calibrated)
    assert zero is None and torch.equal(wide.channels[0, 0, 0].long(), torch.arange(16))
    assert torch.allclose(scale[..., :16].float(), torch.tensor(12.0 / 15), rtol=1e-2)
    assert torch.equal(scale[..., 16:], calibrated[..., 16:])
    out = dequantize(codes, scale, zero, spec, wide=wide)
    inside = x.abs() <= 6
    step = scale.float().repeat_interleave(BLOCK, 2)
    assert ((out - x).abs() <= step / 2 + 1e-6)[inside].all()


def _layer(spec: QuantSpec, **settings) -> AsymKVLayer:
    value = QuantSpec("int3", "token", 16, symmetric=False)
    return AsymKVLayer(layer_config(spec, value, BLOCK, residual_length=8, **settings))


def test_dense_read_out_and_crop_read_the_high_bits():
    spec = QuantSpec("int4", "channel", symmetric=False, wide_fraction=0.25)
    layer = _layer(spec)
    k, v = _keys(64, 70), torch.randn(1, 2, 70, 64)
    layer.update(k, v)  # (the prefill itself attends its exact keys)
    keys = layer.key_store.dense()
    n = layer.key_store.blocks.length
    assert n == 3 * BLOCK  # the rest stays in the window
    spec = dataclasses.replace(spec, block_size=BLOCK)
    codes, scale, zero, wide = encode_blocks(k[:, :, :n], spec)
    expected = dequantize(codes, scale, zero, spec, wide=wide)
    assert torch.equal(keys[:, :, :n], expected) and torch.equal(keys[:, :, n:], k[:, :, n:])
    layer.crop(-30)  # 40 kept: into the third block: its kept tokens go back to the window as attention saw them
    assert torch.equal(layer.key_store.dense(), expected[:, :, :40])


def test_footprint_counts_the_high_bits_and_the_channels():
    config = llama_config()
    cache = AsymKVCache.from_preset("compact", config, key_block_size=BLOCK, residual_length=8)
    plain = AsymKVCache.from_preset("compact", config, key_block_size=BLOCK, residual_length=8, key_wide_fraction=0.0)
    heads, head_dim = config.num_key_value_heads, config.head_dim
    for c in (cache, plain):
        kv = torch.randn(2, 1, heads, 100, head_dim)
        for layer in range(config.num_hidden_layers):
            c.update(kv[0], kv[1], layer)
    wide, base = cache.memory_footprint(), plain.memory_footprint()
    quantized = cache.layers[0].key_store.blocks.length
    count = max(1, round(head_dim * 0.25))
    per_layer_bits = heads * quantized * -(-count // 8)
    per_layer_channels = heads * quantized // BLOCK * count
    assert wide["key_wide_bits"] == config.num_hidden_layers * per_layer_bits
    assert wide["key_wide_channels"] == config.num_hidden_layers * per_layer_channels
    assert "key_wide_bits" not in base and "value_wide_bits" not in wide
    assert wide["total"] - base["total"] == config.num_hidden_layers * (per_layer_bits + per_layer_channels)


def test_static_store_reads_what_the_dynamic_store_reads(llama, prompt):
    settings = dict(key_block_size=8, residual_length=8)
    dynamic = AsymKVCache.from_preset("compact", llama.config, **settings)
    static = AsymKVCache.from_preset("compact", llama.config, max_cache_len=prompt.shape[1] + 4, **settings)
    with torch.no_grad():
        a = llama(prompt, **cache_kwargs(dynamic), use_cache=True)
        b = llama(prompt, **cache_kwargs(static), use_cache=True)
    assert torch.equal(a.logits, b.logits)
    footprint = static.memory_footprint()
    assert footprint["key_wide_bits"] > 0 and footprint["key_wide_channels"] > 0


@pytest.mark.parametrize("settings,message", [
    (dict(key_wide_fraction=1.0), r"key_wide_fraction must be a number in \[0, 1\), got 1.0"),
    (dict(key_wide_fraction=-0.1), r"key_wide_fraction must be a number in \[0, 1\), got -0.1"),
    (dict(key_wide_fraction=True), r"key_wide_fraction must be a number in \[0, 1\), got True"),
    (dict(key_wide_fraction=0.25), r"key_wide_fraction=0.25 needs int4, int3 or int2 keys per 'channel', unrotated; "
                                    r"got key_format='int8'"),
    (dict(key_format="int4", key_granularity="token", key_wide_fraction=0.25), "key_granularity='token'"),
    (dict(key_format="int4", key_rotation=True, key_wide_fraction=0.25), "key_rotation=True"),
    (dict(layer_overrides={1: {"key_wide_fraction": 0.25}}), r"layer_overrides\[1\]: key_wide_fraction=0.25 needs"),
])
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        AsymKVConfig(**settings)


def test_head_dims_above_256_are_refused_when_the_layer_sees_them():
    spec = QuantSpec("int4", "channel", symmetric=False, wide_fraction=0.25)
    with pytest.raises(ValueError, match="head_dim=512 is above 256"):
        spec.packed_dim(512)


def test_the_setting_round_trips_and_older_dicts_have_none():
    config = AsymKVConfig(key_format="int3", key_symmetric=False, key_wide_fraction=0.125,
                          layer_overrides={0: {"key_wide_fraction": 0.5}})
    data = json.loads(json.dumps(config.to_dict()))
    assert data["config_version"] == CONFIG_VERSION and AsymKVConfig.from_dict(data) == config
    assert AsymKVConfig.from_dict({"config_version": 4, "key_format": "int4"}).key_wide_fraction == 0.0
    assert "+0.125 wide" in config.describe()

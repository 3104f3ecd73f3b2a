"""Presets and the means behind them: Hadamard rotation, exact byte counts, `from_preset` and its errors."""

from __future__ import annotations

import pytest
import torch
from conftest import llama_config
from helpers import layer_config
from transformers import LlamaConfig

from hf_asymkv import PRESETS, AsymKVCache, AsymKVConfig
from hf_asymkv.core.attention import fused_attention
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.core.presets import preset_config
from hf_asymkv.core.quant import QuantSpec, sqnr_db
from hf_asymkv.core.rotation import hadamard, hadamard_block, hadamard_transform, rotate, unrotate

pytestmark = pytest.mark.usefixtures("single_thread")


# ------------------------------------------------------------------------------------------------ rotation
@pytest.mark.parametrize("dim, block", [(64, 64), (128, 128), (16, 16), (80, 16), (96, 32), (7, 1)])
def test_hadamard_is_orthonormal_in_float64(dim, block):
    h = hadamard(dim, torch.float64)
    assert hadamard_block(dim) == block
    assert torch.allclose(h @ h.T, torch.eye(dim, dtype=torch.float64), atol=1e-15, rtol=0)
    assert torch.allclose(h.abs()[:block, :block], torch.full((block, block), block**-0.5, dtype=torch.float64),
                          atol=1e-16, rtol=0)
    assert torch.equal(h, h.T)  # Sylvester blocks are symmetric


def test_rotation_round_trips_against_float64():
    x = torch.randn(2, 3, 40, 64, dtype=torch.float64)
    x[..., 5] *= 50  # an outlier channel: rotation spreads it over all 64
    y = rotate(x)
    assert y.dtype == torch.float32
    peak = lambda t: (t.abs().amax(-1) / t.norm(dim=-1)).mean()  # noqa: E731  (1 / sqrt(64) when flat)
    assert peak(x) > 0.8 and peak(y.double()) < 0.5
    back = unrotate(y.double())
    assert sqnr_db(x, back) > 130  # float32 rotation, float64 inverse: float32 rounding only


@pytest.mark.parametrize("dim", [64, 128, 80, 96], ids=lambda d: f"head_dim-{d}")
def test_the_butterfly_is_the_rotation(dim):
    """What the stores quantize (``hadamard_transform``, the append kernel's order) is ``x @ H`` to float32 rounding,
    the block-diagonal matrix of head_dims that are not powers of two included."""
    x = torch.randn(2, 3, 40, dim, dtype=torch.float64)
    y = hadamard_transform(x.float())
    assert y.dtype == torch.float32
    assert sqnr_db(x @ hadamard(dim, torch.float64), y.double()) > 135
    assert sqnr_db(rotate(x.float()).double(), y.double()) > 130


def _filled(vspec: QuantSpec, kspec: QuantSpec | None = None, sinks: int = 3, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    kspec = kspec or QuantSpec("int8", "channel", scale_dtype=torch.bfloat16)
    layer = AsymKVLayer(layer_config(kspec, vspec, 8, residual_length=8, sink_tokens=sinks), return_views=True)
    k, v = torch.randn(2, 1, 2, 70, 16, generator=g)
    v[..., 2] *= 30
    key, value = layer.update(k.to(dtype), v.to(dtype))
    return layer, k, v, g


def test_rotated_values_quantize_better_and_keep_exact_tokens_exact():
    """The rotation's purpose (less V error with an outlier channel) and its contract: sinks and window as given."""
    errors = {}
    for rotated in (False, True):
        layer, k, v, _ = _filled(QuantSpec("int4", "token", 16, False, rotated=rotated))
        layer.return_views = False
        _, values = layer.update(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16))
        assert torch.equal(values[:, :, :3], v[:, :, :3]) and torch.equal(values[:, :, -8:], v[:, :, -8:])
        errors[rotated] = sqnr_db(v, values)
    assert errors[True] > errors[False] + 3


@pytest.mark.parametrize("vspec", [QuantSpec("int4", "token", 16, False, rotated=True),
                                   QuantSpec("int3", "token", 8, False, rotated=True),
                                   QuantSpec("int2", "token", 16, False, rotated=True)], ids=["V4", "V3-g8", "V2"])
@pytest.mark.parametrize("q_len", [1, 5], ids=["decode", "chunk"])
def test_fused_rotated_values_equal_dense(vspec, q_len):
    """The fused path mixes rotated codes and rotates the output back: the dense read-out's attention within fp32
    rounding."""
    kspec = QuantSpec("int4", "channel", symmetric=False, scale_dtype=torch.bfloat16)
    layer, _, _, g = _filled(vspec, kspec)
    key, value = layer.update(*torch.randn(2, 1, 2, q_len, 16, generator=g))
    q = torch.randn(1, 4, q_len, 16, generator=g)
    n = key.shape[2]
    mask = torch.ones(q_len, n, dtype=torch.bool).tril(n - q_len)[None, None]
    got = fused_attention(q, key, value, mask, 0.25)
    kd, vd = key.dense().repeat_interleave(2, 1), value.dense().repeat_interleave(2, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q, kd, vd, mask, scale=0.25).transpose(1, 2)
    assert sqnr_db(want, got) > 100


def test_crop_into_a_rotated_block_returns_unrotated_values():
    layer, _, v, _ = _filled(QuantSpec("int8", "token", 16, False, rotated=True), sinks=0)
    layer.return_views = False
    layer.crop(-30)  # 40 tokens left: 32 in blocks, 8 back from a partly removed block
    _, values = layer.update(torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16))
    assert sqnr_db(v[:, :, :40], values) > 35


# ------------------------------------------------------------------------------------------------ presets
def _tiny(head_dim: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                       num_hidden_layers=2, intermediate_size=32, vocab_size=64)


def _ratio_after(cache: AsymKVCache, tokens: int, head_dim: int) -> float:
    for i in range(len(cache.layers)):
        kv = torch.randn(2, 1, 1, tokens, head_dim, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i))
        cache.update(kv[0], kv[1], i)
    footprint = cache.memory_footprint()
    return footprint["bf16_equivalent"] / footprint["total"]


# Bytes are a function of shapes only: the ratio vs bf16 after a 4096-token prefill, capacity included, for
# head_dim 64 (SmolLM2) and 128. The README's table quotes the same figures measured on the real model.
RATIOS = {"quality": (2.0, 2.0), "balanced": (2.4, 2.4), "lean": (3.2, 3.2), "compact": (3.5, 3.5),
          "tight": (4.95, 4.95), "max": (5.5, 5.5)}


@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("preset", list(PRESETS), ids=list(PRESETS))
def test_preset_bytes_reach_their_ratio(preset, head_dim):
    floor = RATIOS[preset][0 if head_dim == 64 else 1]
    assert _ratio_after(AsymKVCache.from_preset(preset, _tiny(head_dim)), 4096, head_dim) >= floor


def test_bytes_are_exact_for_3_bit_values():
    """A 3-bit rotated value costs 3/8 byte plus its group's fp16 scale and zero, nothing else."""
    cache = AsymKVCache(_tiny(64), value_bits=3, value_rotation=True, residual_length=0, sink_tokens=0, key_block_size=32,
                        growth_factor=2.0, max_growth_tokens=1024)
    for i in range(2):
        cache.update(torch.zeros(1, 1, 1024, 64), torch.randn(1, 1, 1024, 64), i)
    f = cache.memory_footprint()
    assert f["value_codes"] == 2 * 1024 * 64 * 3 // 8
    assert f["value_scales"] == f["value_zeros"] == 2 * 1024 * 2


def test_presets_are_configs_and_overrides_apply():
    assert all(isinstance(c, AsymKVConfig) for c in PRESETS.values())
    assert list(PRESETS) == ["quality", "balanced", "lean", "compact", "tight", "max"]
    cache = AsymKVCache.from_preset("compact", llama_config(), residual_length=8)
    assert cache.cache_config.residual_length == 8
    assert cache.cache_config.value_bits == PRESETS["compact"].value_bits
    assert preset_config("max") is PRESETS["max"]


def test_unknown_preset_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"Unknown preset 'tiny'; presets: \['quality', 'balanced', 'lean', 'compact', 'tight', 'max'"):
        AsymKVCache.from_preset("tiny", llama_config())


def test_preset_refuses_a_bad_override_by_name():
    with pytest.raises(ValueError, match=r"unknown AsymKVCache settings \['window'\]"):
        AsymKVCache.from_preset("balanced", llama_config(), window=8)
    with pytest.raises(ValueError, match="from_preset builds the cache_config"):
        AsymKVCache.from_preset("balanced", llama_config(), cache_config=AsymKVConfig())


def test_calibrated_ranges_apply_to_symmetric_keys_and_are_refused_otherwise():
    ranges = {0: torch.ones(2, 16), 1: torch.ones(2, 16)}
    cache = AsymKVCache.from_preset("balanced", llama_config(), key_absmax=ranges)
    assert all(layer.key_absmax is not None for layer in cache.layers)
    with pytest.raises(ValueError, match="calibrated key ranges .* key_symmetric=True"):
        AsymKVCache.from_preset("compact", llama_config(), key_absmax=ranges)

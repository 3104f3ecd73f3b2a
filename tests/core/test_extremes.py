"""Extreme inputs and misuse: every model dtype, magnitudes from 1e-6 to 1e5, all-equal tokens, zeros, NaN/inf,
and public-class misuse. Each case gives a clear error or a documented result, never a silent wrong number."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import llama_config
from helpers import layer_config

from hf_asymkv import AsymKVCache, AsymKVLayer, QuantSpec

B, H, D, BLOCK = 1, 2, 16, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _layer(key_format: str = "int8", value_bits: int = 4, *, key_absmax=None, **settings) -> AsymKVLayer:
    """A layer as `AsymKVCache` builds it (bf16 key scales, fp16 value scale/zero), window 0 so that everything
    past the first block is quantized."""
    settings.setdefault("residual_length", 0)
    config = layer_config(QuantSpec(key_format, "channel", D, True, torch.bfloat16),
                          QuantSpec(f"int{value_bits}", "token", D, False, torch.float16), BLOCK, **settings)
    return AsymKVLayer(config, key_absmax=key_absmax)


def _roundtrip(layer: AsymKVLayer, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store ``k, v`` (a whole number of blocks), then read them back from the quantized blocks."""
    layer.update(k, v)
    assert layer.key_store.blocks.length == k.shape[2]
    return layer.update(k[:, :, :0], v[:, :, :0])


def _tokens(scale: float, dtype: torch.dtype, seed: int = 0, n: int = 2 * BLOCK) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, n, D, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_fp8_e5m2_keys_keep_their_precision_in_every_dtype(dtype):
    """E5M2 scales of keys with |k| < 3.5 are below float16's normal range; cast to float16 they lost 11-55% of
    small-range channels. The relative error must be the format's own (2 mantissa bits: <= 12.5% per element)."""
    k = (_tokens(1.0, torch.float32) * torch.logspace(-3, 0, D)).to(dtype)  # channel ranges from 1e-3 to 1
    keys, _ = _roundtrip(_layer("fp8_e5m2"), k, _tokens(1.0, dtype, seed=1))
    err = (keys.float() - k.float()).norm(dim=2) / k.float().norm(dim=2)  # per (head, channel)
    assert err.max() <= 0.08  # E5M2's rounding error is <= 12.5% per element, ~4-5% RMS


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("magnitude", [1e5, -1e5], ids=["plus1e5", "minus1e5"])
def test_values_beyond_float16_metadata_decode_right(dtype, magnitude):
    """A value of -1e5 used to decode to -65536 in a bf16 model: its zero was clamped into float16. The store now
    switches its value metadata to float32 (lossless) and the int4 error stays within half a step."""
    if dtype == torch.float16:
        pytest.skip("a float16 model cannot hold 1e5 in the first place")
    v = _tokens(1.0, dtype)
    v[:, :, 3, 5] = magnitude
    layer = _layer()
    _, values = _roundtrip(layer, _tokens(1.0, dtype, seed=1), v)
    step = (v[:, :, 3].float().amax() - v[:, :, 3].float().amin()) / 15
    assert (values[:, :, 3].float() - v[:, :, 3].float()).abs().max() <= step / 2 * 1.01 + 1e-3 * abs(magnitude)
    assert layer.value_store.spec.scale_dtype == torch.float32
    assert layer.value_store.blocks.scales.data.dtype == torch.float32


def test_value_metadata_stays_float16_while_the_range_fits():
    layer = _layer()
    _roundtrip(layer, _tokens(1.0, torch.bfloat16), _tokens(100.0, torch.bfloat16, seed=1))
    assert layer.value_store.blocks.scales.data.dtype == torch.float16


def test_metadata_widening_keeps_earlier_blocks():
    """Rows written in float16 before the switch decode exactly as before it."""
    layer = _layer()
    k1, v1 = _tokens(1.0, torch.float32), _tokens(1.0, torch.float32, seed=1)
    before, _ = _roundtrip(layer, k1, v1)
    _, values_before = layer.update(k1[:, :, :0], v1[:, :, :0])
    big = _tokens(1.0, torch.float32, seed=2)
    big[..., 0] = -1e5
    layer.update(_tokens(1.0, torch.float32, seed=3), big)
    _, values_after = layer.update(k1[:, :, :0], v1[:, :, :0])
    assert torch.equal(values_after[:, :, : v1.shape[2]], values_before)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_tiny_magnitudes(dtype):
    """1e-6 keys keep their relative precision (bf16 scales reach 1e-38); 1e-6 values are stored with an absolute
    error below half the smallest normal float16 step (3.1e-5), the documented floor of float16 value metadata."""
    k, v = _tokens(1e-6, dtype), _tokens(1e-6, dtype, seed=1)
    keys, values = _roundtrip(_layer(), k, v)
    if dtype != torch.float16:  # float16 itself cannot hold 1e-6 keys with relative precision
        rel = (keys.float() - k.float()).norm() / k.float().norm()
        assert rel < 0.02
    assert (values.float() - v.float()).abs().max() <= 3.1e-5


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("fill", [0.0, 0.3, -2.0], ids=["zeros", "equal+", "equal-"])
def test_all_equal_tokens(dtype, fill):
    """Zeros decode to exactly 0; all-equal tokens decode to their value up to the metadata's rounding."""
    k = torch.full((B, H, 2 * BLOCK, D), fill, dtype=dtype)
    keys, values = _roundtrip(_layer(), k, k.clone())
    tol = 0 if fill == 0 else abs(fill) * 2**-8
    assert (keys.float() - fill).abs().max() <= tol
    assert (values.float() - fill).abs().max() <= tol + 3.1e-5 * (fill != 0)


def test_nonfinite_values_are_counted_and_warned_once():
    """NaN and inf keys are stored as documented (NaN as 0, +-inf as the group's extreme), counted in stats, and
    the first occurrence warns: never silently."""
    k, v = _tokens(1.0, torch.float32), _tokens(1.0, torch.float32, seed=1)
    k[0, 0, 2, 3] = float("nan")
    k[0, 1, 4, 5] = float("inf")
    v[0, 0, 1, 0] = float("-inf")
    layer = _layer()
    with pytest.warns(RuntimeWarning, match="quantized K/V hold 3 NaN/inf values"):
        keys, values = _roundtrip(layer, k, v)
    assert layer.stats["nonfinite_values"] == 3
    assert keys[0, 0, 2, 3] == 0
    assert keys[0, 1, 4, 5] == keys[0, 1, :BLOCK, 5].max() > 0
    assert values[0, 0, 1, 0] == values[0, 0, 1].min()
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second occurrence is only counted
        layer.update(k, v)
    assert layer.stats["nonfinite_values"] == 6


def test_nonfinite_in_the_window_stays_as_is():
    """Exact tokens are stored exactly, NaN included (as DynamicCache would)."""
    layer = _layer(residual_length=64)
    k = _tokens(1.0, torch.float32)
    k[0, 0, 0, 0] = float("nan")
    keys, _ = layer.update(k, k.clone())
    assert torch.isnan(keys[0, 0, 0, 0]) and layer.stats["nonfinite_values"] == 0


# ------------------------------------------------------------------------------------------------ misuse
@pytest.mark.parametrize("spec, words", [
    (QuantSpec("int8", "channel", symmetric=False), "symmetric=False"),
    (QuantSpec("int8", "token", 16), "'token'"),
], ids=["asymmetric", "per-token"])
def test_calibrated_range_needs_a_symmetric_per_channel_key_spec(spec, words):
    """An asymmetric key spec with a calibrated range used to decode every negative key as 0."""
    with pytest.raises(ValueError, match=f"calibrated key range .* needs a key spec with granularity='channel' and "
                                         f"symmetric=True, got .*{words}"):
        AsymKVLayer(layer_config(spec, QuantSpec("int4", "token", 16, False), 1), key_absmax=torch.ones(H, D))


def test_layer_refuses_an_unknown_overflow_policy():
    with pytest.raises(ValueError, match=r"overflow_policy must be one of \['widen', 'clip', 'error'\], got 'drop'"):
        _layer(overflow_policy="drop")


@pytest.mark.parametrize("shape, layer_text", [((3, 16), "layer 1 has shape (3, 16)"), ((2, 8), "layer 0 has shape (2, 8)")],
                         ids=["heads", "head_dim"])
def test_scales_of_another_shape_are_refused_at_construction(shape, layer_text):
    """A range whose head count or head_dim disagrees with one layer is named when the cache is built, not at the
    first update deep inside generate."""
    layer = 1 if shape[0] == 3 else 0
    ranges = {0: torch.ones(2, 16), 1: torch.ones(2, 16)}
    ranges[layer] = torch.ones(*shape)
    with pytest.raises(ValueError, match=rf"calibrated key range of {layer_text.replace('(', '[(]').replace(')', '[)]')}"
                                         r", the model's layer \d needs \[kv_heads, head_dim\] = \[2, 16\]"):
        AsymKVCache(llama_config(), key_absmax=ranges)

"""Peer emulations: each quantizer's codes and scales as the peer defines them (hand-computed tensors), exact
engine bytes for known shapes, orthonormal rotations, and the caches on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch
from conftest import hybrid_config, llama_config

from hf_asymkv.bench import peer_formats as pf
from hf_asymkv.bench.peers import PEERS, KiviLayer, PeerCache, PeerLayer, kivi_split, make_peer_cache
from hf_asymkv.bench.schemes import make_cache


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum()))


def test_q4_0_scale_is_signed_max_over_minus_8_and_codes_offset_8():
    block = torch.zeros(32)
    block[3], block[7], block[9] = -4.0, 1.0, 3.0  # the largest magnitude is negative
    codes, d = pf.q4_0_codes(block)
    assert float(d[0]) == 0.5  # max / -8 = -4 / -8: the extreme value lands exactly on code 0
    assert codes[0, 3] == 0 and codes[0, 0] == 8 and codes[0, 7] == 10  # 1/0.5 + 8.5 = 10.5 -> trunc 10
    assert codes[0, 9] == 14  # 3/0.5 + 8.5 = 14.5 -> 14
    assert torch.equal(pf.dequantize_q4_0(codes, d, block.shape)[[3, 7, 9]], torch.tensor([-4.0, 1.0, 3.0]))


def test_q4_0_positive_max_gets_negative_scale_and_codes_stay_in_0_15():
    x = torch.randn(4, 64) * 3
    x[0, 5] = 50.0
    codes, d = pf.q4_0_codes(x)
    assert d[0, 0] < 0 and float(d[0, 0]) == pytest.approx(-50 / 8, rel=1e-3)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and codes.shape == (4, 2, 32)
    assert sqnr_db(x, pf.dequantize_q4_0(codes, d, x.shape)) > 12


def test_q8_0_scale_amax_over_127_in_fp16():
    x = torch.linspace(-2, 1, 32)
    codes, d = pf.q8_0_codes(x)
    assert d.dtype == torch.float16 and float(d[0]) == pytest.approx(2 / 127, rel=1e-3)
    assert codes[0, 0] == -127 and codes.dtype == torch.int8
    assert sqnr_db(x, pf.dequantize_q8_0(codes, d, x.shape)) > 38


def test_llama_blocks_need_rows_of_32():
    with pytest.raises(ValueError, match="divisible by 32"):
        pf.q8_0_codes(torch.randn(2, 48))


def test_int8_per_token_head_symmetric_fp32_scale():
    x = torch.tensor([[1.0, -2.54, 0.5]])
    codes, scale = pf.int8_per_token_head_codes(x)
    assert scale.dtype == torch.float32 and float(scale[0]) == pytest.approx(2.54 / 127)
    assert codes.tolist() == [[50, -127, 25]]


def test_int4_per_token_head_zero_point_lives_in_the_scale_mantissa():
    x = torch.randn(3, 5, 64)
    codes, packed = pf.int4_per_token_head_codes(x)
    assert int(codes.max()) <= 15 and codes.dtype == torch.uint8 and packed.dtype == torch.float32
    zp = packed.view(torch.int32) & 0xF
    lo, hi = x.amin(-1), x.amax(-1)
    assert torch.equal(zp, torch.round(-lo / ((hi - lo) / 15)).clamp(0, 15).to(torch.int32))
    assert sqnr_db(x, pf.dequantize_int4_per_token_head(codes, packed)) > 15


def test_asym_uniform_min_max_codes():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    codes, scale, lo = pf.asym_uniform_codes(x, 2, -1)
    assert codes.tolist() == [[0, 1, 2, 3]] and float(scale) == 1.0 and float(lo) == 0.0


def test_fp8_per_tensor_saturates_beyond_the_calibrated_range():
    out = pf.fp8_per_tensor(torch.tensor([1.0, 10.0]), scale=2.0 / 448)
    assert out.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("n", [16, 64, 128])
def test_hadamard_is_orthonormal_in_float64(n):
    h = pf.hadamard(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    s = pf.random_signs(n)
    r = s[:, None] * h
    assert torch.allclose(r @ r.T, torch.eye(n, dtype=torch.float64), atol=1e-12)


def test_hadamard_refuses_other_sizes():
    with pytest.raises(ValueError, match="power-of-two"):
        pf.hadamard(48)


# Engine bytes for 1000 tokens, 3 layers, 2 kv heads, head_dim 64, written out by hand from each format.
_BYTES = {
    "vllm-int8-pth": 3 * 1000 * 2 * 2 * (64 + 4),
    "vllm-int4-pth": 3 * 1000 * 2 * 2 * (32 + 4),
    "vllm-tq-k8v4": 2 * 1000 * 2 * 64 * 2 * 2 + 1000 * 2 * (64 + 32 + 4),  # layers 0 and 2 exact, layer 1 TQ
    "vllm-fp8-tensor": 3 * (1000 * 2 * 2 * 64 + 8),
    "llama-q8_0": 3 * 1000 * 2 * (128 // 32) * 34,
    "llama-q4_0-rot": 3 * 1000 * 2 * (128 // 32) * 18,
    # KIVI: K 896 quantized (7 x 128) + 104 exact, V 872 quantized + 128 exact; 2-bit codes, fp16 scale+min
    "kivi-2": 3 * 2 * ((896 + 872) * 64 * 2 // 8 + 896 // 32 * 64 * 4 + 872 * 2 * 4 + (104 + 128) * 64 * 2),
}


@pytest.mark.parametrize("name", list(_BYTES))
def test_engine_nbytes_exact_for_a_known_shape(name):
    assert PEERS[name].engine_nbytes(1000, layers=3, kv_heads=2, head_dim=64) == _BYTES[name]


def test_kivi_windows():
    assert kivi_split(100) == (0, 0) and kivi_split(300) == (256, 172) and kivi_split(256) == (256, 128)


def test_kivi_layer_quantizes_after_the_step_that_filled_the_window():
    layer = KiviLayer(bits=2)
    k, v = torch.randn(1, 2, 300, 32), torch.randn(1, 2, 300, 32)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k)  # the prefill's own attention is exact
    keys, values = layer.update(k[:, :, :1], v[:, :, :1])
    assert layer.keys_done == 256 and layer.values_done == 172
    assert torch.equal(keys[:, :, 256:300], k[:, :, 256:]) and not torch.equal(keys[:, :, :256], k[:, :, :256])
    assert torch.equal(values[:, :, 172:300], v[:, :, 172:])
    # per channel over 32 tokens: 2-bit codes hit each group's min and max exactly
    assert torch.allclose(keys[:, :, :32].amax(2), k[:, :, :32].amax(2), atol=2e-2)


@pytest.mark.parametrize("name", list(PEERS))
def test_peer_cache_on_a_tiny_llama(name):
    cache = make_cache(name, llama_config())
    assert isinstance(cache, PeerCache)
    k, v = torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16)
    for i in range(2):
        keys, values = cache.update(k, v, i)
    keys, values = cache.update(k[:, :, :1], v[:, :, :1], 1)
    assert keys.shape == (1, 2, 201, 16) and sqnr_db(k, keys[:, :, :200]) > 6
    assert cache.engine_nbytes() > 0


@pytest.mark.parametrize("name", ["llama-q4_0", "kivi-2", "vllm-tq-k8v4"])
def test_peer_cache_keeps_sliding_layers_exact_like_ours(name):
    """On a model with sliding-window layers only the full-attention layers take the peer's format; the sliding
    ones stay transformers' exact bounded layers, counted at 2 bytes per element for the tokens they hold."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    config = hybrid_config()
    cache = make_cache(name, config)
    sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    assert sliding and full
    assert all(isinstance(cache.layers[i], DynamicSlidingWindowLayer) for i in sliding)
    heads, dim = config.num_key_value_heads, config.head_dim
    k = torch.randn(1, heads, 300, dim)
    for i in range(config.num_hidden_layers):
        cache.update(k, k.clone(), i)
    held = [cache.layers[i].keys.shape[-2] for i in sliding]
    exact = 2 * 2 * heads * dim * sum(held)
    quantized = sum(PEERS[name].layer_nbytes(300, heads, dim, exact=not isinstance(cache.layers[i], (PeerLayer, KiviLayer)))
                    for i in full)
    assert cache.engine_nbytes() == exact + quantized
    assert max(held) < 300  # the sliding layers really are bounded


def test_unknown_peer_lists_the_known_ones():
    with pytest.raises(ValueError, match="known peers"):
        make_peer_cache("vllm-int3", llama_config())


def test_scheme_names_list_every_peer():
    """bench/schemes.py names the peers without importing torch; the two lists must agree."""
    from hf_asymkv.bench.schemes import PEER_SCHEMES, SCHEMES

    assert list(PEER_SCHEMES) == list(PEERS)
    assert all(name in SCHEMES for name in PEERS)


def test_peer_format_needs_a_registered_scheme_name():
    """Peer names are written once, in the torch-free scheme registry the CLI reads."""
    from hf_asymkv.bench.peers import PeerFormat

    with pytest.raises(ValueError, match=r"peer format 'vllm-int3' has no scheme name; add it to PEER_SCHEMES"):
        PeerFormat("vllm-int3", "", "", None, lambda h, d: 0)

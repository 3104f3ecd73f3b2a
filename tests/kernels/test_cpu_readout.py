"""The native CPU read-out (hf_asymkv/kernels/cpu_readout.c) against the torch read-out: the same bits.

Every stored format a layer can hold is filled through a real layer (prefill, then single tokens, so the region has
blocks quantized at different times), and the whole read-out a decode step uses (``QuantizedKV.dense``: sinks,
codes, window) is compared bit for bit with ``HF_ASYMKV_CPU_READOUT=torch``. Runs wherever a C compiler exists; CI
has one, so there it cannot skip.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from hf_asymkv import AsymKVCache, AsymKVConfig
from hf_asymkv.core.packing import PackedCodes, pack_codes
from hf_asymkv.core.quant import QuantSpec, compute_scale_zero, dequantize, native_readout, quantize
from hf_asymkv.core.rotation import dequantize_rotated, rotate
from hf_asymkv.core.store import encode_blocks, stored_form
from hf_asymkv.kernels import cpu_readout

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the native read-out cannot be built here")

CONFIGS = {
    "balanced": dict(),
    "quality": dict(key_format="int8", value_bits=6),
    "lean": dict(key_format="int4", key_symmetric=False, key_block_size=32, value_bits=4, residual_length=32),
    "compact": dict(key_format="int4", key_symmetric=False, key_block_size=64, key_wide_fraction=0.25,
                    value_bits=3, residual_length=32),
    "tight": dict(key_format="int3", key_symmetric=False, key_block_size=64, value_bits=2, residual_length=32),
    "int2 keys, 2-bit values (max before 2026-12-05)": dict(key_format="int2", key_symmetric=False, key_block_size=32,
                                                           value_bits=2),
    "1-bit values": dict(key_format="int3", key_symmetric=False, key_block_size=64, key_wide_fraction=0.25,
                         value_bits=1, residual_length=32),
    "1-bit plain values per 8 channels": dict(value_rotation=False, value_group_size=8, value_bits=1),
    "wide symmetric int3": dict(key_format="int3", key_block_size=32, key_wide_fraction=0.3, value_bits=5),
    "wide int2": dict(key_format="int2", key_symmetric=False, key_block_size=16, key_wide_fraction=0.1),
    "int8 asymmetric keys, int8 values": dict(key_symmetric=False, value_bits=8, key_block_size=16),
    "plain values per 16 channels": dict(value_rotation=False, value_group_size=16, value_bits=4),
    "symmetric values": dict(value_symmetric=True, value_bits=4, value_rotation=False, key_format="int4"),
    "symmetric rotated values": dict(value_symmetric=True, value_bits=6),
    "head_dim layout (block 1)": dict(key_format="int4", key_block_size=1, value_bits=3, residual_length=8),
    "head_dim layout (block 4, 3 bits)": dict(key_format="int3", key_block_size=4, value_bits=5),
    "per-token keys": dict(key_format="int4", key_granularity="token", key_group_size=32, key_block_size=16),
    "per-tensor keys": dict(key_granularity="tensor", key_block_size=16),
    "rotated keys": dict(key_rotation=True, key_block_size=16),
    "fp8 keys (torch path)": dict(key_format="fp8_e4m3", key_block_size=16),
}


def filled_layer(settings: dict, head_dim: int = 64, batch: int = 2, tokens: int = 300):
    """A layer of a tiny Llama-shaped cache after a prefill and 40 single-token steps (random K/V)."""
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         num_hidden_layers=1, intermediate_size=16, vocab_size=32)
    cache = AsymKVCache(config, AsymKVConfig(**settings))
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, batch, 2, tokens, head_dim, generator=g)
    k[..., 3] *= 20  # an outlier channel
    layer = cache.layers[0]
    layer.update(k, v)
    for step in range(40):
        layer.update(*torch.randn(2, batch, 2, 1, head_dim, generator=g))
    return layer


def read_out(layer, choice: str, monkeypatch) -> list[torch.Tensor]:
    """Each store's whole quantized region read out, then one more decode step's dense K and V (on a copy)."""
    monkeypatch.setenv(cpu_readout.ENV_VAR, choice)
    regions = [store.blocks.decode(0, store.blocks.length, torch.float32) for store in (layer.key_store, layer.value_store)]
    step = torch.randn(2, regions[0].shape[0], 2, 1, regions[0].shape[-1],
                       generator=torch.Generator().manual_seed(1))
    return regions + list(copy.deepcopy(layer).update(*step))


@pytest.mark.parametrize("settings", CONFIGS.values(), ids=CONFIGS.keys())
def test_native_read_out_equals_torch_bit_for_bit(settings, monkeypatch):
    layer = filled_layer(settings)
    expected = read_out(layer, "torch", monkeypatch)
    got = read_out(layer, "native", monkeypatch)  # raises where it cannot build: no silent torch-against-torch
    for name, e, g in zip(("K codes", "V codes", "K", "V"), expected, got):
        assert torch.equal(e, g), f"{name}: max difference {(e - g).abs().max().item()}"


@pytest.mark.parametrize("head_dim", [80, 96, 40], ids=lambda d: f"head_dim{d}")
def test_block_diagonal_rotation_and_odd_head_dims(head_dim, monkeypatch):
    """Hadamard blocks of 16, 32 and 8 (the largest power of two dividing head_dim), wide channels rounded."""
    settings = dict(key_format="int4", key_symmetric=False, key_block_size=16, key_wide_fraction=0.25, value_bits=3)
    layer = filled_layer(settings, head_dim=head_dim, batch=1, tokens=100)
    for e, g in zip(read_out(layer, "torch", monkeypatch), read_out(layer, "native", monkeypatch)):
        assert torch.equal(e, g)


def test_native_serves_the_presets_read_out(monkeypatch):
    """The native path really runs for float32 CPU outputs (not silently the torch one)."""
    monkeypatch.setenv(cpu_readout.ENV_VAR, "auto")
    layer = filled_layer(CONFIGS["compact"], batch=1)
    codes, scale, zero, wide = layer.key_store.blocks.parts(0, layer.key_store.blocks.length)
    out = torch.empty(1, 2, codes.tokens, 64)
    assert native_readout(out, codes, layer.key_store.blocks.spec)
    assert not native_readout(out.bfloat16(), codes, layer.key_store.blocks.spec)
    monkeypatch.setenv(cpu_readout.ENV_VAR, "torch")
    assert not native_readout(out, codes, layer.key_store.blocks.spec)


def test_float32_scales_round_as_torch(monkeypatch):
    """Float32 metadata (wide ranges): ``code * scale`` rounds, then ``+ zero`` rounds again, in both paths."""
    spec = QuantSpec("int4", "channel", symmetric=False, scale_dtype=torch.float32, block_size=32)
    x = torch.randn(2, 3, 128, 64) * 1e5
    scale, zero = compute_scale_zero(x, spec)
    codes = quantize(x, scale, zero, spec)
    monkeypatch.setenv(cpu_readout.ENV_VAR, "torch")
    expected = dequantize(codes, scale, zero, spec)
    monkeypatch.setenv(cpu_readout.ENV_VAR, "native")
    assert torch.equal(dequantize(codes, scale, zero, spec), expected)


def test_rotated_into_a_slice_of_a_larger_buffer(monkeypatch):
    """``out`` may be a token slice of the dense tensor (as ``QuantizedKV.dense`` passes it); the rest is untouched."""
    spec = QuantSpec("int4", "token", 64, symmetric=False, rotated=True, block_size=32)
    y = rotate(torch.randn(2, 2, 96, 64))
    scale, zero = compute_scale_zero(y, spec)
    codes = quantize(y, scale, zero, spec)
    monkeypatch.setenv(cpu_readout.ENV_VAR, "torch")
    expected = dequantize_rotated(codes, scale, zero, spec)
    monkeypatch.setenv(cpu_readout.ENV_VAR, "native")
    buffer = torch.full((2, 2, 100, 64), 7.0)
    dequantize_rotated(codes, scale, zero, spec, out=buffer[:, :, 2:98])
    assert torch.equal(buffer[:, :, 2:98], expected)
    assert (buffer[:, :, :2] == 7).all() and (buffer[:, :, 98:] == 7).all()


def test_strided_codes_are_read_as_they_lie(monkeypatch):
    """Codes sliced out of a larger capacity along tokens (the stores' buffers) and a reordered batch."""
    spec = QuantSpec("int3", "channel", symmetric=False, block_size=32)
    x = torch.randn(3, 2, 128, 64)
    scale, zero = compute_scale_zero(x, spec)
    codes = quantize(x, scale, zero, spec)
    sliced = PackedCodes(codes.data[[2, 0], :, 32:96], codes.bits, codes.layout, codes.block_size)
    buffer = torch.cat([codes.data, codes.data], dim=2)[:, :, 32:160]  # rows contiguous per (b, h), not dense
    strided = PackedCodes(buffer, codes.bits, codes.layout, codes.block_size)
    monkeypatch.setenv(cpu_readout.ENV_VAR, "torch")
    expected = [dequantize(c, scale, zero, spec) for c in (strided,)]
    expected_sliced = dequantize(sliced, scale[[2, 0], :, 1:3], zero[[2, 0], :, 1:3], spec)
    monkeypatch.setenv(cpu_readout.ENV_VAR, "native")
    assert torch.equal(dequantize(strided, scale, zero, spec), expected[0])
    assert torch.equal(dequantize(sliced, scale[[2, 0], :, 1:3], zero[[2, 0], :, 1:3], spec), expected_sliced)


def test_unknown_choice_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv(cpu_readout.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=r"HF_ASYMKV_CPU_READOUT='fast'.*'auto', 'native', 'torch'"):
        cpu_readout.requested()


def test_native_refuses_what_it_cannot_serve(monkeypatch):
    monkeypatch.setenv(cpu_readout.ENV_VAR, "native")
    spec = QuantSpec("int4", "channel", block_size=2)
    codes = pack_codes(torch.randint(0, 16, (1, 1, 4, 8), dtype=torch.uint8), 4, 2)
    scale = torch.ones(1, 1, 2, 8, dtype=spec.scale_dtype)
    with pytest.raises(RuntimeError, match="float32 outputs.*got torch.bfloat16 out"):
        dequantize(codes, scale, None, spec, dtype=torch.bfloat16)


def test_a_build_failure_falls_back_once_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_readout, "_library", lambda: (None, "no C compiler found"))
    cpu_readout._warn_once.cache_clear()
    spec = QuantSpec("int4", "channel", block_size=2)
    codes = pack_codes(torch.randint(0, 16, (1, 1, 4, 8), dtype=torch.uint8), 4, 2)
    scale = torch.ones(1, 1, 2, 8, dtype=spec.scale_dtype)
    monkeypatch.setenv(cpu_readout.ENV_VAR, "auto")
    with caplog.at_level("WARNING", logger=cpu_readout.__name__):
        first = dequantize(codes, scale, None, spec)
        dequantize(codes, scale, None, spec)
    assert [r.message.count("no C compiler found") for r in caplog.records] == [1]
    monkeypatch.setenv(cpu_readout.ENV_VAR, "native")
    with pytest.raises(RuntimeError, match="cannot be built: no C compiler found"):
        dequantize(codes, scale, None, spec)
    monkeypatch.setenv(cpu_readout.ENV_VAR, "torch")
    assert torch.equal(dequantize(codes, scale, None, spec), first)


def test_build_writes_one_library_and_no_leftovers(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ASYMKV_CACHE", str(tmp_path))
    compiler = shutil.which("cc") or shutil.which("gcc")
    built = cpu_readout._build(compiler)
    assert built.parent == tmp_path / "native" and built.suffix == ".so"
    assert [p.name for p in (tmp_path / "native").iterdir()] == [built.name]
    assert cpu_readout._build(compiler) == built  # cached: the same file, not rebuilt


def test_a_failing_compiler_names_itself_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ASYMKV_CACHE", str(tmp_path))
    failing = tmp_path / "broken-cc"
    failing.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo broken 1.0 && exit 0\necho 'no such flag' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match="broken-cc failed to compile cpu_readout.c: no such flag"):
        cpu_readout._build(str(failing))
    assert list((tmp_path / "native").iterdir()) == []


FORMAT_CASES = [(bits, granularity, symmetric, scale_dtype, variant)
                for bits in (1, 2, 3, 4, 5, 6, 8) for granularity in ("channel", "token", "tensor")
                for symmetric in (True, False) for scale_dtype in (torch.float16, torch.bfloat16, torch.float32)
                for variant in ("plain", "rotated", "wide")
                if (variant == "plain" or variant == "rotated" and granularity == "token"
                    or variant == "wide" and granularity == "channel" and 1 < bits <= 4)
                and not (bits == 1 and (symmetric or granularity == "tensor"))]  # int1: asymmetric, token/channel


def _case_id(case) -> str:
    bits, granularity, symmetric, scale_dtype, variant = case
    return f"int{bits}-{granularity}-{'sym' if symmetric else 'asym'}-{str(scale_dtype)[6:]}-{variant}"


@st.composite
def blocks_of(draw, bits: int, granularity: str, symmetric: bool, scale_dtype: torch.dtype, variant: str):
    """A spec of the given format with a random block, head_dim, group, wide share, and whole blocks of K/V at a
    random magnitude with an outlier channel: ``(spec, x)``."""
    head_dim = draw(st.sampled_from([8, 16, 24, 32, 40, 64, 96, 128]))
    rotated = variant == "rotated"
    group = head_dim if rotated or granularity != "token" else draw(st.sampled_from(
        [g for g in (4, 8, 16, head_dim) if head_dim % g == 0]))
    wide = draw(st.sampled_from([0.1, 0.25, 0.5])) if variant == "wide" else 0.0
    block = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
    spec = QuantSpec(f"int{bits}", granularity, group, symmetric=symmetric, scale_dtype=scale_dtype,
                     rotated=rotated, block_size=block, wide_fraction=wide)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), block * draw(st.integers(1, 4)), head_dim)
    x = torch.randn(shape, generator=g) * 10.0 ** draw(st.integers(-3, 3))
    x[..., draw(st.integers(0, head_dim - 1))] *= 30
    return spec, x


@pytest.mark.parametrize("case", FORMAT_CASES, ids=_case_id)
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_every_format_reads_out_bit_for_bit(case, data):
    """Every integer format x granularity x symmetry x metadata dtype (x rotation, x wide channels), random shapes."""
    spec, x = data.draw(blocks_of(*case))
    codes, scale, zero, wide = encode_blocks(stored_form(x, spec, clean=True), spec)

    def read() -> torch.Tensor:
        if spec.rotated:
            return dequantize_rotated(codes, scale, zero, spec)
        return dequantize(codes, scale, zero, spec, wide=wide)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_readout.ENV_VAR, "torch")
        expected = read()
        patch.setenv(cpu_readout.ENV_VAR, "native")
        got = read()
    assert torch.equal(got, expected), f"{spec}: max difference {(got - expected).abs().max().item()}"


@pytest.mark.parametrize("head_dim, group, bits, symmetric, tokens, block", [
    (256, 128, 4, False, 300, 32),  # Gemma's values: two groups per token, token-packed blocks
    (256, 64, 3, False, 5, 1),      # four groups, head_dim-packed
    (128, 32, 2, True, 40, 32),     # symmetric
    (96, 32, 4, False, 17, 1),      # three Hadamard blocks of 32, one group each
    (256, 128, 6, True, 1, 1),
], ids=["d256-g128", "d256-g64", "d128-g32-sym", "d96-g32", "d256-one-token"])
def test_rotated_values_in_several_groups_per_token(head_dim, group, bits, symmetric, tokens, block):
    """Rotated per-token codes with a scale per group of channels (head_dim 256 in groups of 128: Gemma-3) read out by
    exact int8 products per group and butterflies across groups: the float64 read-out (dequantize, then H^T) to
    float32 rounding, alone and into a slice of a larger buffer."""
    from hf_asymkv.core import rotation

    spec = QuantSpec(f"int{bits}", "token", group, symmetric=symmetric, rotated=True, block_size=block)
    y = rotate(torch.randn(2, 3, tokens, head_dim, generator=torch.Generator().manual_seed(head_dim + group)))
    scale, zero = compute_scale_zero(y, spec)
    codes = quantize(y, scale, zero, spec)
    assert rotation._grouped_integer_path(codes, spec, head_dim)
    expected = dequantize(codes, scale, zero, spec).double() @ rotation.hadamard(head_dim, torch.float64).T
    got = dequantize_rotated(codes, scale, zero, spec)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)
    buffer = torch.full((2, 3, tokens + 4, head_dim), 7.0)
    dequantize_rotated(codes, scale, zero, spec, out=buffer[:, :, 2:-2])
    assert torch.equal(buffer[:, :, 2:-2], got)
    assert (buffer[:, :, :2] == 7).all() and (buffer[:, :, -2:] == 7).all()
    half = dequantize_rotated(codes, scale, zero, spec, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, got.to(torch.bfloat16))

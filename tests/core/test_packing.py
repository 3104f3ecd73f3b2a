"""`PackedCodes`: stored codes carry their layout, so nothing decodes them in a layout they were not packed in."""

from __future__ import annotations

import pytest
import torch

from hf_asymkv.core.packing import CODE_LAYOUTS, PackedCodes, pack_codes, unpack_codes
from hf_asymkv.core.quant import QuantSpec, compute_scale_zero, dequantize, quantize, sqnr_db


def _codes(bits: int, tokens: int, block: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(bits * 31 + tokens)
    return torch.randint(0, 2**bits, (1, 2, tokens, 16), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("bits, block, tokens, layout", [
    (4, 8, 32, "tokens"), (4, 8, 30, "head_dim"), (3, 4, 16, "head_dim"), (3, 8, 16, "tokens"), (4, 1, 5, "head_dim"),
    (8, 32, 64, "head_dim"),
], ids=["int4-whole-blocks", "int4-ragged", "int3-block4", "int3-block8", "block1", "8bit"])
def test_packing_records_its_layout(bits, block, tokens, layout):
    codes = _codes(min(bits, 6), tokens, block) if bits < 8 else _codes(6, tokens, block)
    packed = pack_codes(codes, bits, block)
    assert packed.layout == layout and packed.bits == bits and packed.block_size == block
    assert packed.tokens == tokens and packed.head_dim == 16
    assert torch.equal(unpack_codes(packed), codes)


@pytest.mark.parametrize("start, stop", [(4, 16), (0, 12), (3, 5)], ids=["start", "stop", "both"])
def test_misaligned_slice_of_token_packed_codes_is_refused(start, stop):
    """Before PackedCodes, a token-packed slice of 12 tokens was decoded along head_dim (wrong values, no error)."""
    packed = pack_codes(_codes(4, 32, 8), 4, 8)
    with pytest.raises(ValueError, match=rf"blocks of 8 can only be sliced at block boundaries, got tokens \[{start}, {stop}\)"):
        packed.token_slice(start, stop)


def test_aligned_slice_decodes_the_same_tokens():
    spec = QuantSpec("int4", "token", 16, symmetric=False, block_size=8)
    x = torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(0))
    scale, zero = compute_scale_zero(x, spec)
    codes = quantize(x, scale, zero, spec)
    assert codes.layout == spec.layout == "tokens"
    whole = dequantize(codes, scale, zero, spec)
    part = dequantize(codes.token_slice(8, 24), scale[:, :, 8:24], zero[:, :, 8:24], spec)
    assert torch.equal(part, whole[:, :, 8:24]) and sqnr_db(x[:, :, 8:24], part) > 15


def test_head_dim_layout_slices_anywhere():
    packed = pack_codes(_codes(4, 10, 1), 4, 1)
    assert torch.equal(unpack_codes(packed.token_slice(3, 7)), unpack_codes(packed)[:, :, 3:7])


@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=4, layout="rows", block_size=8), r"layout must be one of \['tokens', 'head_dim'\], got 'rows'"),
    (dict(bits=4, layout="tokens", block_size=8), r"4-bit codes of 12 tokens cannot be packed along tokens in blocks of 8"),
    (dict(bits=8, layout="tokens", block_size=4), r"8-bit codes of 12 tokens cannot be packed along tokens"),
    (dict(bits=3, layout="tokens", block_size=4), r"3-bit codes of 12 tokens cannot be packed along tokens in blocks of 4"),
], ids=["unknown-layout", "ragged-tokens", "8bit-tokens", "block-too-small"])
def test_packed_codes_refuse_impossible_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackedCodes(torch.zeros(1, 1, 12, 8, dtype=torch.uint8), **kwargs)


def test_decode_refuses_codes_of_another_width():
    spec = QuantSpec("int4", "token", 16, symmetric=False)
    x = torch.randn(1, 1, 4, 16)
    scale, zero = compute_scale_zero(x, spec)
    codes = quantize(x, scale, zero, QuantSpec("int2", "token", 16, symmetric=False))
    with pytest.raises(ValueError, match=r"codes are 2-bit, the spec \(int4\) reads 4-bit codes"):
        dequantize(codes, scale, zero, spec)


def test_layouts_listed():
    assert CODE_LAYOUTS == ("tokens", "head_dim")

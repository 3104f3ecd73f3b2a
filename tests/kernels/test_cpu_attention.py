"""The native CPU decode attention (hf_asymkv/kernels/cpu_attention.c) against its torch twin
(:func:`hf_asymkv.core.attention.fused_attention`) and against softmax attention over the dequantized K/V in float64.

Every preset's storage is filled through a real layer (a prefill, then single tokens, so the blocks were quantized at
different times) and read as the fused attention gets it (``QuantizedKV``). The kernel sums in another order than the
twin and uses its own ``exp``: results agree to float32 rounding (SQNR against the float64 reference above 105 dB,
against the twin above 100 dB, the twin's own distance to the reference). Runs wherever a C compiler exists; CI has one.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from hf_asymkv.core.attention import asymkv_sdpa_attention, fused_attention
from hf_asymkv.core.backend import native_fused_attention
from hf_asymkv.core.kv_view import QuantizedKV
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.core.packing import plane_widths
from hf_asymkv.core.presets import PRESETS
from hf_asymkv.core.quant import sqnr_db, storage_offset
from hf_asymkv.kernels import backend, cpu_attention

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler: the native kernel cannot be built here"),
              pytest.mark.usefixtures("single_thread")]

PRESET_NAMES = list(PRESETS)
REFERENCE_DB = {torch.float32: 105.0, torch.bfloat16: 40.0}  # bf16: the output's own rounding (8 bits of mantissa)
TWIN_DB = {torch.float32: 100.0, torch.bfloat16: 40.0}


class _Module(torch.nn.Module):
    is_causal = True


def stored(preset: str, *, head_dim: int = 64, kv_heads: int = 2, batch: int = 1, tokens: int = 300, q_len: int = 1,
           dtype: torch.dtype = torch.float32, pads: tuple[int, ...] | None = None, seed: int = 0):
    """``(key, value)`` a layer of ``preset`` hands the fused attention after a prefill of ``tokens``, 20 single-token
    steps and one step of ``q_len`` tokens; ``pads``: left padding per row (the positions transformers passes)."""
    layer = AsymKVLayer(PRESETS[preset].resolved([head_dim]).layer_config(), return_views=True)
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.randn(batch, kv_heads, n, head_dim, generator=g)
        k[..., 3] *= 20  # an outlier channel, as real keys have
        return k.to(dtype), torch.randn(batch, kv_heads, n, head_dim, generator=g).to(dtype)

    def update(n: int, start: int):
        kwargs = {}
        if pads is not None:
            kwargs = {"position_ids": (torch.arange(start, start + n)[None] - torch.tensor(pads)[:, None]).clamp(min=0)}
        return layer.update(*draw(n), kwargs=kwargs)

    update(tokens, 0)
    for step in range(20):
        update(1, tokens + step)
    return update(q_len, tokens + 20)


def reference(query: torch.Tensor, key: QuantizedKV, value: QuantizedKV, mask: torch.Tensor | None,
              scaling: float) -> torch.Tensor:
    """Softmax attention in float64 over the dequantized K/V (exact sinks over padded positions): ``[B, q, Hq, D]``."""
    n_rep = query.shape[1] // key.tail.shape[1]
    k, v = (t.dense().double().repeat_interleave(n_rep, 1) for t in (key, value))
    scores = query.double() @ k.transpose(-1, -2) * scaling
    q_len, kv_len = query.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)


def native(query, key, value, mask=None, scaling=0.125) -> torch.Tensor:
    out = native_fused_attention(query, key, value, mask, scaling, None)
    assert out is not None, "the native kernel did not serve this call"
    return out


def check(query, key, value, mask=None, scaling=0.125):
    got = native(query, key, value, mask, scaling)
    assert got.shape == (query.shape[0], query.shape[2], query.shape[1], query.shape[3]) and got.dtype == query.dtype
    assert sqnr_db(reference(query, key, value, mask, scaling), got) > REFERENCE_DB[query.dtype]
    assert sqnr_db(fused_attention(query, key, value, mask, scaling), got) > TWIN_DB[query.dtype]


# ------------------------------------------------------------------------------------------------ every preset
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("n_rep", [1, 3, 4], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("preset", PRESET_NAMES, ids=PRESET_NAMES)
def test_every_preset_matches_twin_and_reference(preset, n_rep, head_dim, dtype):
    key, value = stored(preset, head_dim=head_dim, dtype=dtype)
    assert key.n_quantized >= 128 and key.n_prefix == 4
    query = torch.randn(1, 2 * n_rep, 1, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    check(query, key, value, scaling=head_dim**-0.5)


@pytest.mark.parametrize("head_dim", [32, 96, 256], ids=["1-byte", "3-bytes", "8-bytes"])
@pytest.mark.parametrize("preset", ["compact", "max"])
def test_wide_channel_bits_of_every_width(preset, head_dim):
    """A quarter of the channels wide: 8, 24 or 64 of them, so each token's wide bits take 1, 3 or 8 bytes (the
    kernel reads 1, 2, 4 and 8 bytes as one load and other widths byte by byte; d64 and d128 above take 2 and 4)."""
    key, value = stored(preset, head_dim=head_dim)
    assert key.wide is not None
    query = torch.randn(1, 6, 1, head_dim, generator=torch.Generator().manual_seed(1))
    check(query, key, value, scaling=head_dim**-0.5)


@pytest.mark.parametrize("q_len", [2, 5], ids=["q2", "q5"])
@pytest.mark.parametrize("preset", ["balanced", "compact"], ids=["balanced", "compact"])
def test_several_query_tokens_are_causal(preset, q_len):
    """No mask: causal over the new tokens (bottom-right aligned), as SDPA's is_causal path."""
    key, value = stored(preset, q_len=q_len)
    check(torch.randn(1, 6, q_len, 64, generator=torch.Generator().manual_seed(2)), key, value)


@pytest.mark.parametrize("preset", PRESET_NAMES, ids=PRESET_NAMES)
def test_left_padded_batch_reads_each_rows_exact_sinks(preset):
    """Batch of 3 with left padding: each row's first real tokens are exact copies over the quantized region (the
    overlay), the pads are masked."""
    pads = (0, 13, 70)
    key, value = stored(preset, batch=3, pads=pads)
    assert key.overlay is not None and int(key.overlay.valid.sum()) > 0
    kv = key.shape[2]
    mask = (torch.arange(kv)[None] >= torch.tensor(pads)[:, None])[:, None, None]  # [B, 1, 1, kv]
    check(torch.randn(3, 6, 1, 64, generator=torch.Generator().manual_seed(4)), key, value, mask)


@pytest.mark.parametrize("kind", ["bool-per-head", "float", "float-bf16"])
def test_masks_of_every_form(kind):
    """A per-head boolean mask, and additive float masks (float32, and bf16 converted) hiding random columns."""
    key, value = stored("balanced", batch=2)
    kv, g = key.shape[2], torch.Generator().manual_seed(5)
    visible = torch.rand(2, 6 if kind == "bool-per-head" else 1, 1, kv, generator=g) > 0.3
    mask = visible if kind == "bool-per-head" else torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    if kind == "float-bf16":
        mask = mask.bfloat16()
    check(torch.randn(2, 6, 1, 64, generator=g), key, value, mask)


def test_two_threads_split_the_history(monkeypatch):
    """Split into runs over threads and merged: the same result to float rounding."""
    key, value = stored("compact", tokens=2000)
    query = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(6))
    one = native(query, key, value)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert cpu_attention.run_splits(1, 2, key.n_quantized // 64, 2) > 1
    assert sqnr_db(one, native(query, key, value)) > 110


# ------------------------------------------------------------------------------------------------ edge cases
def _parts(kv: QuantizedKV, *, blocks: int, prefix: bool, tail: int) -> QuantizedKV:
    """``kv`` cut to its first ``blocks`` blocks, with or without its sinks and with its last ``tail`` window tokens."""
    n = blocks * kv.spec.block_size
    cut = dataclasses.replace(kv, prefix=kv.prefix if prefix else None, codes=kv.codes.token_slice(0, n),
                              tail=kv.tail[:, :, -tail:], overlay=None)
    tg = kv.spec.token_group
    cut.scale = kv.scale[:, :, : n // tg]
    cut.zero = None if kv.zero is None else kv.zero[:, :, : n // tg]
    if kv.wide is not None:
        cut.wide = kv.wide.token_slice(0, n, kv.spec.block_size)
    return cut


@pytest.mark.parametrize("case, blocks, prefix, tail", [
    ("no-blocks", 0, True, 40), ("sinks-only", 0, True, 1), ("window-only", 0, False, 40), ("one-block", 1, False, 1),
    ("blocks-and-window", 2, False, 33)], ids=["no-blocks", "sinks-only", "window-only", "one-block", "no-sinks"])
@pytest.mark.parametrize("preset", ["balanced", "compact"], ids=["balanced", "compact"])
def test_parts_that_are_empty(preset, case, blocks, prefix, tail):
    key, value = stored(preset)
    key, value = (_parts(t, blocks=blocks, prefix=prefix, tail=tail) for t in (key, value))
    check(torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(7)), key, value)


def test_a_fully_masked_row_is_nan_like_the_twin():
    key, value = stored("balanced", batch=2)
    mask = torch.ones(2, 1, 1, key.shape[2], dtype=torch.bool)
    mask[1] = False
    query = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(8))
    got, twin = native(query, key, value, mask), fused_attention(query, key, value, mask, 0.125)
    assert bool(got[1].isnan().all()) and bool(twin[1].isnan().all())
    assert sqnr_db(twin[0], got[0]) > TWIN_DB[torch.float32]


# ------------------------------------------------------------------------------------------------ the choice
def test_auto_takes_the_native_kernel_on_cpu(monkeypatch):
    calls, original = [], cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    key, value = stored("balanced")
    query = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(9))
    got, _ = asymkv_sdpa_attention(_Module(), query, key, value, None, scaling=0.125)
    assert calls == [1]
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    twin, _ = asymkv_sdpa_attention(_Module(), query, key, value, None, scaling=0.125)
    assert calls == [1] and torch.equal(twin, fused_attention(query, key, value, None, 0.125))
    assert sqnr_db(twin, got) > TWIN_DB[torch.float32]


def _fp8_keys():
    config = PRESETS["balanced"].resolved([64])
    spec = dataclasses.replace(config.key_spec(), fmt="fp8_e4m3")
    layer = AsymKVLayer(dataclasses.replace(config.layer_config(), key_spec=spec), return_views=True)
    g = torch.Generator().manual_seed(10)
    layer.update(torch.randn(1, 2, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g))
    return layer.update(torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g))


def test_forced_native_names_what_it_cannot_serve(monkeypatch):
    key, value = _fp8_keys()
    query = torch.randn(1, 6, 1, 64)
    monkeypatch.setenv(backend.ENV_VAR, "native")
    with pytest.raises(ValueError, match="HF_ASYMKV_ATTENTION_BACKEND=native cannot serve.*fp8_e4m3 keys"):
        asymkv_sdpa_attention(_Module(), query, key, value, None, scaling=0.125)
    monkeypatch.setenv(backend.ENV_VAR, "auto")  # the default falls back to the twin
    got, _ = asymkv_sdpa_attention(_Module(), query, key, value, None, scaling=0.125)
    assert torch.equal(got, fused_attention(query, key, value, None, 0.125))


def _codes_part(**fields) -> cpu_attention.QuantizedPart:
    base = dict(codes=torch.zeros(1, 2, 32, 32, dtype=torch.uint8), scale=torch.ones(1, 2, 32, 1),
                zero=torch.zeros(1, 2, 32, 1), bits=4, planes=(4,), tokens_layout=True)
    return cpu_attention.QuantizedPart(**{**base, **fields})


KEYS = cpu_attention.QuantizedPart(torch.zeros(1, 2, 32, 64, dtype=torch.int8), torch.ones(1, 2, 2, 64), None, 8,
                                   (8,), False)
BAD = {
    "head-dim": (torch.zeros(1, 2, 1, 60), KEYS, _codes_part(), "head_dim 60"),
    "planes": (torch.zeros(1, 2, 1, 64), KEYS, _codes_part(planes=(2, 1)), "bit-plane sets (2, 1) for 4-bit codes"),
    "code-dtype": (torch.zeros(1, 2, 1, 64), dataclasses.replace(KEYS, codes=KEYS.codes.half()), _codes_part(),
                   "keys codes of dtype torch.float16"),
    "value-groups": (torch.zeros(1, 2, 1, 64), KEYS, _codes_part(scale=torch.ones(1, 2, 32, 16),
                                                                 zero=torch.zeros(1, 2, 32, 16)), "value scales"),
    "strided": (torch.zeros(1, 2, 1, 64), KEYS, _codes_part(codes=torch.zeros(1, 2, 32, 64, dtype=torch.uint8)[..., ::2]),
                "values parts whose rows are not contiguous"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_problems_are_named(case):
    rows, keys, values, message = BAD[case]
    why = cpu_attention.problem(rows, keys, values, 16, [], None)
    assert why is not None and message in why


def test_layout_constants_come_from_packing(monkeypatch):
    """The kernel reads the plane widths and storage offsets that packing.py and quant.py define, as the core passes
    them (max: 3-bit keys in planes 2 + 1 with wide channels, 1-bit values)."""
    seen, original = {}, cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a, **k: seen.update(k) or original(*a, **k))
    key, value = stored("max")
    native(torch.randn(1, 6, 1, 64), key, value)
    assert seen["keys"].planes == plane_widths(3) == (2, 1) and seen["keys"].wide_channels is not None
    assert seen["values"].planes == plane_widths(1) and seen["values"].offset == storage_offset(value.spec) == 0
    assert seen["hadamard"] == 64

"""Choosing the fused attention's backend (``HF_ASYMKV_ATTENTION_BACKEND``) and the errors of requests the
Triton kernel cannot serve."""

from __future__ import annotations

import pytest
import torch
from helpers import layer_config

from hf_asymkv.core.attention import asymkv_sdpa_attention, fused_attention
from hf_asymkv.core.backend import kernel_regions
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.core.presets import PRESETS
from hf_asymkv.core.quant import QuantSpec, sqnr_db
from hf_asymkv.kernels import backend, decode
from hf_asymkv.kernels.decode import decode_attention
from hf_asymkv.kernels.regions import ExactSegment, QuantizedRegion, StoredCodes, unsupported

ENV = backend.ENV_VAR


class _Module(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def _layer_kv(key_spec=None, block=16, q_len=1, sinks=4):
    """A layer's ``QuantizedKV`` keys and values (balanced formats unless ``key_spec``), 2 KV heads, head_dim 64."""
    config = PRESETS["balanced"].resolved([64])
    layer = AsymKVLayer(layer_config(key_spec or config.key_spec(), config.value_spec(), block, residual_length=8,
                                     sink_tokens=sinks), return_views=True)
    g = torch.Generator().manual_seed(0)
    layer.update(torch.randn(1, 2, 60, 64, generator=g), torch.randn(1, 2, 60, 64, generator=g))
    key, value = layer.update(torch.randn(1, 2, q_len, 64, generator=g), torch.randn(1, 2, q_len, 64, generator=g))
    return key, value, torch.randn(1, 4, q_len, 64, generator=g)


# ------------------------------------------------------------------------------------------------ choice
@pytest.mark.parametrize("value, expected", [(None, "auto"), ("", "auto"), ("Triton", "triton"), (" torch ", "torch")])
def test_requested_backend(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert backend.requested_backend() == expected


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "cuda")
    with pytest.raises(ValueError, match=r"HF_ASYMKV_ATTENTION_BACKEND='cuda'.*allowed: \['auto', 'triton', 'torch', 'native'\]"):
        backend.choose_backend(torch.device("cpu"), None)


@pytest.mark.parametrize("requested", ["auto", "torch", "native"])
def test_cpu_tensors_take_torch_unless_triton_is_forced(monkeypatch, requested):
    monkeypatch.setenv(ENV, requested)
    assert backend.choose_backend(torch.device("cpu"), None) == "torch"


def test_forced_triton_runs_on_cpu_under_the_interpreter(monkeypatch):
    monkeypatch.setenv(ENV, "triton")
    assert backend.choose_backend(torch.device("cpu"), None) == "triton"


def test_forced_triton_without_triton_says_how_to_install(monkeypatch):
    monkeypatch.setenv(ENV, "triton")
    monkeypatch.setattr(backend, "triton_version", lambda: None)
    with pytest.raises(ImportError, match=r"Triton is not installed \(pip install 'hf-asymkv\[gpu\]'\)"):
        backend.choose_backend(torch.device("cpu"), None)
    monkeypatch.setenv(ENV, "auto")
    assert backend.choose_backend(torch.device("cuda"), None) == "torch"


def test_forced_triton_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv(ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CPU tensors with TRITON_INTERPRET=1.*'cpu'"):
        backend.choose_backend(torch.device("cpu"), None)


def test_auto_takes_triton_on_cuda_when_served(monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    assert backend.choose_backend(torch.device("cuda"), None) == "triton"
    assert backend.choose_backend(torch.device("cuda"), "rotated keys") == "torch"


# ------------------------------------------------------------------------------------------------ the attention
def test_forced_triton_serves_the_attention(monkeypatch):
    calls, original = [], decode.launch_decode_attention
    monkeypatch.setattr(decode, "launch_decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setenv(ENV, "triton")
    key, value, query = _layer_kv(q_len=3)
    got, _ = asymkv_sdpa_attention(_Module(), query, key, value, None, scaling=0.125)
    assert calls == [1]
    assert sqnr_db(fused_attention(query, key, value, None, 0.125), got) >= 60


@pytest.mark.parametrize("q_len", [1, 3], ids=["q1", "q3"])
@pytest.mark.parametrize("with_mask", [True, False], ids=["padding-mask", "no-mask"])
def test_forced_triton_serves_left_padded_sinks(monkeypatch, q_len, with_mask):
    """Left-padded rows keep their sinks as an exact overlay over the quantized region (hf_asymkv.core.sinks): the
    kernel gets it through masks (overlaid positions out of the quantized stream, the sinks beside the prefix) and
    matches the torch fused path, which reads the overlay directly."""
    config = PRESETS["balanced"].resolved([64])
    layer = AsymKVLayer(layer_config(config.key_spec(), config.value_spec(), 16, residual_length=8, sink_tokens=4),
                        return_views=True)
    g = torch.Generator().manual_seed(3)
    pads, n = torch.tensor([0, 7]), 60
    pos = (torch.arange(n)[None] - pads[:, None]).clamp(min=0)
    layer.update(torch.randn(2, 2, n, 64, generator=g), torch.randn(2, 2, n, 64, generator=g),
                 kwargs={"position_ids": pos})
    step = torch.arange(n, n + q_len)[None] - pads[:, None]
    key, value = layer.update(torch.randn(2, 2, q_len, 64, generator=g), torch.randn(2, 2, q_len, 64, generator=g),
                              kwargs={"position_ids": step})
    assert key.overlay is not None and bool(key.overlay.valid[1].all()) and not bool(key.overlay.valid[0].any())
    kv = key.shape[2]
    mask = None
    if with_mask:  # what SDPA gets for this batch: row 1's pads hidden, causal over the new tokens
        cols, rows = torch.arange(kv), torch.arange(kv - q_len, kv)[:, None]
        mask = ((cols[None] <= rows) & (cols[None] >= torch.tensor([0, 7])[:, None, None]))[:, None]
    query = torch.randn(2, 4, q_len, 64, generator=g)
    monkeypatch.setenv(ENV, "triton")
    got, _ = asymkv_sdpa_attention(_Module(), query, key, value, mask, scaling=0.125)
    assert sqnr_db(fused_attention(query, key, value, mask, 0.125), got) >= 60


@pytest.mark.parametrize("why, kwargs, key_spec, block, message", [
    ("sliding-window", {"sliding_window": 4}, None, 16, "attention with sliding_window"),
    ("attention-sinks", {"s_aux": torch.zeros(4)}, None, 16, "attention with s_aux"),
    ("token-keys", {}, QuantSpec("int8", "token", 64), 16, "keys with one scale per 'token' group"),
    ("small-blocks", {}, None, 8, "key scales shared by 8 tokens"),
    ("rotated-keys", {}, QuantSpec("int8", "channel", rotated=True), 16, "rotated keys"),
], ids=["sliding-window", "attention-sinks", "token-keys", "small-blocks", "rotated-keys"])
def test_forced_triton_names_what_it_cannot_serve(monkeypatch, why, kwargs, key_spec, block, message):
    key, value, query = _layer_kv(key_spec, block)
    monkeypatch.setenv(ENV, "triton")
    with pytest.raises(ValueError, match=f"HF_ASYMKV_ATTENTION_BACKEND=triton cannot serve.*{message}"):
        asymkv_sdpa_attention(_Module(), query, key, value, None, scaling=0.125, **kwargs)
    monkeypatch.setenv(ENV, "auto")  # the default falls back to torch
    out, _ = asymkv_sdpa_attention(_Module(), query, key, value, None, scaling=0.125, **kwargs)
    assert out.shape == (1, 1, 4, 64)


def test_kernel_regions_follow_the_stored_order():
    key, value, _ = _layer_kv()
    region, segments = kernel_regions(key, value)
    assert [s.start for s in segments] == [0, 4 + key.n_quantized]
    assert region.start == 4 and region.tokens == key.n_quantized == 48
    assert region.keys.bits == 8 and region.values.layout == "tokens" and region.values.bits == 4
    assert region.values.rotated and not region.keys.rotated


# ------------------------------------------------------------------------------------------------ bad requests
def _codes(bits=8, dtype=torch.int8, tokens=32, width=64, scale_rows=2, **kwargs) -> StoredCodes:
    return StoredCodes(torch.zeros(1, 2, tokens, width, dtype=dtype), torch.ones(1, 2, scale_rows, 64), None, bits,
                       True, **kwargs)


GOOD_VALUES = StoredCodes(torch.zeros(1, 2, 32, 32, dtype=torch.uint8), torch.ones(1, 2, 32, 1),
                          torch.zeros(1, 2, 32, 1), 4, False, "tokens", 16)
BAD = {
    "head-dim": (torch.zeros(1, 4, 1, 512), None, "head_dim 512"),
    "query-dtype": (torch.zeros(1, 4, 1, 64, dtype=torch.float64), None, "a query of dtype torch.float64"),
    "heads": (torch.zeros(1, 3, 1, 64), QuantizedRegion(_codes(), GOOD_VALUES), "3 query heads over 2 KV heads"),
    "rows": (torch.zeros(1, 32, 16, 64), QuantizedRegion(_codes(), GOOD_VALUES), "at most 128 rows"),
    "code-dtype": (torch.zeros(1, 4, 1, 64), QuantizedRegion(_codes(dtype=torch.float16), GOOD_VALUES),
                   "keys codes of dtype torch.float16"),
    "seven-bits": (torch.zeros(1, 4, 1, 64), QuantizedRegion(_codes(7, torch.uint8, width=56), GOOD_VALUES),
                   "keys codes of 7 bits"),
    "head-dim-mismatch": (torch.zeros(1, 4, 1, 64), QuantizedRegion(_codes(width=32), GOOD_VALUES),
                          "keys codes of head_dim 32 beside a query of head_dim 64"),
    "block-packing": (torch.zeros(1, 4, 1, 64), QuantizedRegion(_codes(), StoredCodes(
        GOOD_VALUES.codes, GOOD_VALUES.scale, GOOD_VALUES.zero, 4, False, "tokens", 12)), "blocks of 12 tokens"),
    "layout": (torch.zeros(1, 4, 1, 64), QuantizedRegion(_codes(), StoredCodes(
        GOOD_VALUES.codes, GOOD_VALUES.scale, GOOD_VALUES.zero, 4, False, "rows")), "packed along 'rows'"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_unsupported_requests_are_named(case):
    query, region, message = BAD[case]
    problem = unsupported(query, region)
    assert problem is not None and message in problem
    with pytest.raises(ValueError, match="the Triton decode attention cannot serve"):
        decode_attention(query, 0.125, quantized=region)


def test_decode_attention_refuses_bad_calls():
    query = torch.randn(1, 4, 1, 64)
    seg = ExactSegment(torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64))
    with pytest.raises(ValueError, match="3 exact segments"):
        decode_attention(query, 0.125, exact=[seg] * 3)
    with pytest.raises(ValueError, match="at least one key"):
        decode_attention(query, 0.125, exact=[ExactSegment(seg.keys[:, :, :0], seg.values[:, :, :0])])
    with pytest.raises(ValueError, match=r"attention mask of shape \(1, 1, 2, 5\)"):
        decode_attention(query, 0.125, exact=[seg], attention_mask=torch.ones(1, 1, 2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="4 columns for keys up to column 5"):
        decode_attention(query, 0.125, exact=[seg], attention_mask=torch.ones(1, 1, 1, 4, dtype=torch.bool))

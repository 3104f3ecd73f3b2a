"""`AsymKVLayer` fed by hand with ``[B, H, n, D]`` tensors: storage invariants, exactness, crop, batch ops,
memory accounting and calibrated key ranges."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import layer_config

from hf_asymkv import AsymKVLayer
from hf_asymkv.core.compat import CROP_TAKES_LENGTH_TO_KEEP
from hf_asymkv.core.quant import QuantSpec, compute_scale_zero, dequantize, quantize
from hf_asymkv.core.store import GrowableBuffer

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.releases]

B, H, D = 2, 3, 16
KEY_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")


def key_spec(fmt: str = "int8") -> QuantSpec:
    """Keys as `AsymKVCache` stores them: symmetric, per channel, bf16 scales."""
    return QuantSpec(fmt, "channel", D, True, torch.bfloat16)


def value_spec(bits: int = 4, group: int = D) -> QuantSpec:
    """Values as `AsymKVCache` stores them: asymmetric, per token in groups of channels, fp16 scale/zero."""
    return QuantSpec(f"int{bits}", "token", group, False, torch.float16)


def make_layer(key_format: str = "int8", value_bits: int = 4, *, block_size: int = 8, key_absmax=None,
               **settings) -> AsymKVLayer:
    settings.setdefault("residual_length", 8)
    config = layer_config(key_spec(key_format), value_spec(value_bits), block_size, **settings)
    return AsymKVLayer(config, key_absmax=key_absmax)


def kv(n: int, seed: int = 0, batch: int = B, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, H, n, D, generator=g) * torch.linspace(0.2, 4.0, D)  # channel-dependent key ranges
    v = torch.randn(batch, H, n, D, generator=g)
    return k.to(dtype), v.to(dtype)


def feed(layer: AsymKVLayer, k: torch.Tensor, v: torch.Tensor, chunks: list[int]):
    """Feed ``k, v`` in chunks of the given sizes; the dense output of the last update."""
    assert sum(chunks) == k.shape[2]
    start, out = 0, None
    for n in chunks:
        out = layer.update(k[:, :, start : start + n], v[:, :, start : start + n])
        start += n
    return out


def lengths(layer: AsymKVLayer) -> tuple[int, int, int]:
    """(sinks, quantized, window) token counts."""
    return layer.key_store.sinks.length, layer.key_store.blocks.codes.length, layer.key_store.window.length


def live(layer: AsymKVLayer) -> dict[str, torch.Tensor]:
    return {name: buf.live.clone() for name, buf in layer.buffers().items() if buf.data is not None}


def reference_dequant(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Quantize ``x`` block by block exactly once and decode: what the layer must hand back for closed blocks."""
    scale, zero = compute_scale_zero(x, spec)
    return dequantize(quantize(x, scale, zero, spec), scale, zero, spec, dtype=x.dtype)


# ------------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    "chunks", [[40], [10] + [1] * 30, [1] * 40, [7, 13, 1, 19]], ids=["prefill", "prefill+decode", "decode", "ragged"]
)
def test_update_is_exact_within_window(chunks, dtype):
    layer = make_layer(residual_length=64)
    k, v = kv(40, dtype=dtype)
    keys, values = feed(layer, k, v, chunks)
    assert keys.dtype == values.dtype == dtype
    assert torch.equal(keys, k) and torch.equal(values, v)
    assert layer.get_seq_length() == 40 and layer.stats["tokens_quantized"] == 0
    assert layer.get_mask_sizes(1) == (41, 0) and layer.get_max_length() == -1


def test_early_initialization_with_empty_tensors():
    """`Cache.early_initialization` calls `lazy_initialization` with zero-length tensors."""
    layer = make_layer()
    empty = torch.zeros(B, H, 0, D, dtype=torch.bfloat16)
    layer.lazy_initialization(empty, empty)
    assert layer.is_initialized and layer.dtype == torch.bfloat16 and layer.get_seq_length() == 0
    k, v = kv(5, dtype=torch.bfloat16)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v)


@pytest.mark.parametrize("sink_tokens", [0, 4], ids=["no_sinks", "sinks4"])
@pytest.mark.parametrize("key_format", KEY_FORMATS, ids=list(KEY_FORMATS))
def test_dense_readout_is_blockwise_quantize_dequantize(key_format, sink_tokens):
    """Sinks and window exact; every closed block decoded from codes quantized once from the exact tokens."""
    layer = make_layer(key_format, sink_tokens=sink_tokens)
    n = 100
    k, v = kv(n + 1)
    feed(layer, k[:, :, :n], v[:, :, :n], [1] * n)
    keys, values = layer.update(k[:, :, n:], v[:, :, n:])  # blocks closed earlier are now read back dequantized
    ns, nq, nw = lengths(layer)
    assert (ns, ns + nq + nw) == (sink_tokens, n + 1)
    q = slice(ns, ns + nq)
    assert torch.equal(keys[:, :, :ns], k[:, :, :ns]) and torch.equal(values[:, :, :ns], v[:, :, :ns])
    assert torch.equal(keys[:, :, ns + nq :], k[:, :, ns + nq :])
    assert torch.equal(values[:, :, ns + nq :], v[:, :, ns + nq :])
    assert torch.equal(keys[:, :, q], reference_dequant(k[:, :, q], layer.key_spec))
    assert torch.equal(values[:, :, q], reference_dequant(v[:, :, q], layer.value_spec))
    assert not torch.equal(keys[:, :, q], k[:, :, q])  # it really is quantized


# ------------------------------------------------------------------------------------------------ invariants
@pytest.mark.parametrize(
    ("residual_length", "block_size", "sink_tokens"),
    [(8, 8, 0), (16, 4, 0), (5, 8, 3), (0, 8, 0), (8, 1, 2)],
    ids=["R8-bs8", "R16-bs4", "R5-bs8-sinks3", "R0-bs8", "R8-bs1-sinks2"],
)
def test_single_token_appends_keep_invariants(residual_length, block_size, sink_tokens):
    layer = make_layer(residual_length=residual_length, block_size=block_size, sink_tokens=sink_tokens)
    n = 120
    k, v = kv(n)
    for t in range(n):
        keys, values = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        ns, nq, nw = lengths(layer)
        assert keys.shape == values.shape == (B, H, t + 1, D)
        assert ns + nq + nw == t + 1 == layer.get_seq_length()
        assert ns == min(t + 1, sink_tokens)
        assert nq % block_size == 0
        assert nw < residual_length + block_size
        if nq:
            assert nw >= residual_length
        # the newest `residual_length` tokens are always exact
        newest = min(residual_length, t + 1)
        assert torch.equal(keys[:, :, t + 1 - newest :], k[:, :, t + 1 - newest : t + 1])
        assert torch.equal(values[:, :, t + 1 - newest :], v[:, :, t + 1 - newest : t + 1])
    assert layer.stats["tokens_quantized"] == nq
    assert layer.stats["blocks_quantized"] == nq // block_size  # each block quantized exactly once


def test_closed_block_is_never_requantized():
    """Block 0's codes, scales and zeros are written once and stay bit-identical through 500 more appends (and
    the buffer reallocations they cause); its dense read-out never changes."""
    layer = make_layer(growth_factor=1.25)
    k, v = kv(520)
    feed(layer, k[:, :, :20], v[:, :, :20], [1] * 20)
    assert layer.key_store.blocks.codes.length == 8
    # K: one scale row per block (per-channel); V: one scale/zero row per token.
    block0 = {"key_codes": 8, "key_scales": 1, "value_codes": 8, "value_scales": 8, "value_zeros": 8}
    bufs = layer.buffers()
    before = {name: bufs[name].live[:, :, :rows].clone() for name, rows in block0.items()}
    first_keys, first_values = layer.update(k[:, :, 20:21], v[:, :, 20:21])
    storage = {name: bufs[name].data for name in block0}
    feed(layer, k[:, :, 21:], v[:, :, 21:], [1] * 499)
    assert all(bufs[name].data is not storage[name] for name in block0)  # reallocated along the way
    for name, rows in block0.items():
        assert torch.equal(bufs[name].live[:, :, :rows], before[name]), name
    keys, values = layer.update(k[:, :, :0], v[:, :, :0])
    assert torch.equal(keys[:, :, :8], first_keys[:, :, :8])
    assert torch.equal(values[:, :, :8], first_values[:, :, :8])
    assert layer.stats["blocks_quantized"] == layer.key_store.blocks.codes.length // 8  # one quantization per block, ever


@pytest.mark.parametrize("sink_tokens", [0, 3], ids=["no_sinks", "sinks3"])
@pytest.mark.parametrize("prefill", [70, 64, 9], ids=["prefill70", "prefill64", "prefill9"])
def test_prefill_then_decode_matches_token_by_token(prefill, sink_tokens):
    """Block boundaries are absolute positions, so chunked and token-by-token feeding close the same blocks from
    the same exact tokens: identical codes, scales and zeros, identical dense read-out afterwards."""
    n = 100
    k, v = kv(n + 1, seed=3)
    chunked, stepwise = (make_layer(sink_tokens=sink_tokens) for _ in range(2))
    feed(chunked, k[:, :, :n], v[:, :, :n], [prefill] + [1] * (n - prefill))
    feed(stepwise, k[:, :, :n], v[:, :, :n], [1] * n)
    assert lengths(chunked) == lengths(stepwise)
    a, b = live(chunked), live(stepwise)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    out_a = chunked.update(k[:, :, n:], v[:, :, n:])
    out_b = stepwise.update(k[:, :, n:], v[:, :, n:])
    assert torch.equal(out_a[0], out_b[0]) and torch.equal(out_a[1], out_b[1])


def test_buffers_grow_geometrically(monkeypatch):
    reallocations: dict[int, int] = {}
    append = GrowableBuffer.append

    def counting_append(self, x, *args):
        before = self.data
        append(self, x, *args)
        if self.data is not before:
            reallocations[id(self)] = reallocations.get(id(self), 0) + 1

    monkeypatch.setattr(GrowableBuffer, "append", counting_append)
    layer = make_layer(growth_factor=1.25)
    n = 2000
    k, v = kv(n, batch=1)
    feed(layer, k, v, [1] * n)
    bound = math.ceil(math.log(n) / math.log(1.25)) + 2  # ~36: O(log n), versus n appends
    names = {id(buf): name for name, buf in layer.buffers().items()}
    counts = {names[i]: c for i, c in reallocations.items()}
    assert max(counts.values()) <= bound, counts
    assert sum(counts.values()) <= 8 * bound, counts
    # Capacity stays within one growth step (+ one block of rounding) of what is live.
    for name, buf in layer.buffers().items():
        if buf.data is not None:
            assert buf.data.shape[2] <= math.ceil(max(buf.length, 16) * 1.25) + 8, name


def test_growth_is_capped_by_max_growth_tokens():
    """Long caches grow by at most ``max_growth_tokens`` at a time, so unused capacity stays bounded."""
    layer = make_layer(growth_factor=2.0, max_growth_tokens=32)
    n = 600
    k, v = kv(n, batch=1)
    feed(layer, k, v, [1] * n)
    for name in ("key_codes", "value_codes"):
        buf = layer.buffers()[name]
        assert buf.data.shape[2] - buf.length <= 32, (name, buf.data.shape[2], buf.length)
    scales = layer.buffers()["value_scales"]  # one row per token
    assert scales.data.shape[2] - scales.length <= 32


# ------------------------------------------------------------------------------------------------ crop
def _filled(sink_tokens: int = 2, n: int = 60, dtype=torch.float32) -> tuple:
    """A layer fed ``n`` tokens one by one plus the dense read-out of one more (empty) update."""
    layer = make_layer(sink_tokens=sink_tokens)
    k, v = kv(n + 10, seed=5, dtype=dtype)
    feed(layer, k[:, :, :n], v[:, :, :n], [1] * n)
    dense = layer.update(k[:, :, :0], v[:, :, :0])  # every closed block read back dequantized
    return layer, k, v, dense


# layer of 60 tokens, sinks 2, block 8, window 8: sinks [0, 2), quantized [2, 50), window [50, 60)
_CROPS = {
    "zero": (0, 60, 0),
    "window": (-3, 57, 0),
    "window_edge": (-10, 50, 0),
    "quantized_partial": (-13, 47, 5),
    "quantized_block_edge": (-18, 42, 0),
    "quantized_deep": (-45, 15, 5),
    "sinks": (-59, 1, 0),
    "everything": (-60, 0, 0),
    "beyond": (-1000, 0, 0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(_CROPS), ids=list(_CROPS))
def test_crop(case, dtype):
    arg, keep, requantized = _CROPS[case]
    layer, k, v, (keys, values) = _filled(dtype=dtype)
    layer.crop(arg)
    assert layer.get_seq_length() == keep
    ns, nq, nw = lengths(layer)
    assert ns + nq + nw == keep and nq % 8 == 0 and ns == min(keep, 2)
    assert layer.stats["requantized_tokens"] == requantized
    # What is kept reads back exactly as attention saw it before the crop (uncommitted tokens hold their
    # dequantized values), and new tokens append after it.
    new_k, new_v = kv(3, seed=9, dtype=dtype)
    after_k, after_v = layer.update(new_k, new_v)
    assert after_k.shape[2] == keep + 3
    assert torch.equal(after_k[:, :, :keep], keys[:, :, :keep])
    assert torch.equal(after_v[:, :, :keep], values[:, :, :keep])
    assert torch.equal(after_k[:, :, keep:], new_k) and torch.equal(after_v[:, :, keep:], new_v)


def test_crop_then_regrow_requantizes_uncommitted_tokens():
    layer, k, v, _ = _filled()
    layer.crop(-13)  # 5 tokens of the last block back to the window
    assert layer.stats["requantized_tokens"] == 5
    feed(layer, k[:, :, 47:70], v[:, :, 47:70], [1] * 23)
    ns, nq, nw = lengths(layer)
    assert ns + nq + nw == 70 and nq % 8 == 0 and 8 <= nw < 16


@pytest.mark.skipif(CROP_TAKES_LENGTH_TO_KEEP, reason="transformers < 5.14: a positive crop is the length to keep")
@pytest.mark.parametrize("arg", [1, 47, 500], ids=["one", "inside", "beyond"])
def test_positive_crop_is_refused(arg):
    """transformers' layers refuse the old 'length to keep' meaning; ours did not (it silently kept ``arg``)."""
    layer, *_ = _filled()
    with pytest.raises(ValueError, match=f"crop takes a negative number of tokens to remove \\(or 0\\), got {arg}"):
        layer.crop(arg)
    assert layer.get_seq_length() == 60


@pytest.mark.skipif(not CROP_TAKES_LENGTH_TO_KEEP, reason="transformers >= 5.14: a positive crop is refused")
@pytest.mark.parametrize("arg", [1, 47, 500], ids=["one", "inside", "beyond"])
def test_positive_crop_keeps_that_length_below_5_14(arg):
    """transformers < 5.14 rolls back with ``crop(new_length - 1)``: a positive argument is the length to keep."""
    layer, *_ = _filled()
    layer.crop(arg)
    assert layer.get_seq_length() == min(arg, 60)


def _recording(n: int = 60, sink_tokens: int = 2) -> tuple:
    """A layer fed ``n`` tokens one at a time with past recording on and ``crop(0)`` after each step (what
    ``generate`` does when it may roll back), plus the tokens it was fed."""
    layer = make_layer(sink_tokens=sink_tokens)
    layer.activate_past_recording()
    k, v = kv(n + 40, seed=7)
    for i in range(n):
        layer.update(k[:, :, i : i + 1], v[:, :, i : i + 1])
        layer.crop(0)
    return layer, k, v


def _newest_exact(layer: AsymKVLayer, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The newest ``min(length, residual_length)`` tokens of the layer are bit-exact copies of what came in."""
    n = layer.get_seq_length()
    m = min(n, layer.residual_length)
    ns, nq, nw = lengths(layer)
    if nw < m and nq:  # a token the window should hold is in a block
        return False
    window_k, window_v = layer.key_store.window.live, layer.value_store.window.live
    return torch.equal(window_k[:, :, nw - m :], k[:, :, n - m : n]) and torch.equal(window_v[:, :, nw - m :], v[:, :, n - m : n])


@pytest.mark.parametrize("draft, rejected", [(3, 3), (12, 12), (12, 5), (20, 20), (1, 0)],
                         ids=["3of3", "12of12", "5of12", "20of20", "accepted"])
def test_recorded_rollback_is_exact(draft, rejected):
    """A draft of ``draft`` tokens pushes blocks past the window; rolling back ``rejected`` of them leaves the
    newest residual_length tokens exact and quantizes nothing twice (on main before the fix: 2 quantized + 6
    exact after crop(-3) with an 8-token window)."""
    layer, k, v = _recording()
    n = layer.get_seq_length()
    layer.update(k[:, :, n : n + draft], v[:, :, n : n + draft])
    layer.crop(-rejected)
    assert layer.get_seq_length() == n + draft - rejected
    assert _newest_exact(layer, k, v)
    assert layer.stats["requantized_tokens"] == 0
    ns, nq, nw = lengths(layer)
    assert layer.residual_length <= nw < layer.residual_length + layer.block_size  # what aged out was quantized


def test_recorded_rollback_matches_a_cache_that_never_saw_the_draft():
    """After the rollback, the layer reads back exactly what a layer fed only the accepted tokens reads back."""
    layer, k, v = _recording()
    n = layer.get_seq_length()
    layer.update(k[:, :, n : n + 12], v[:, :, n : n + 12])
    layer.crop(-9)
    plain = make_layer(sink_tokens=2)
    feed(plain, k[:, :, : n + 3], v[:, :, : n + 3], [1] * (n + 3))
    empty = k[:, :, :0], v[:, :, :0]
    for got, want in zip(layer.update(*empty), plain.update(*empty)):
        assert torch.equal(got, want)


def test_recording_off_again_quantizes_at_the_next_update():
    """generate sets ``record_past = False`` when it hands the cache back; the next update flushes as usual."""
    layer, k, v = _recording()
    n = layer.get_seq_length()
    layer.update(k[:, :, n : n + 20], v[:, :, n : n + 20])  # nothing quantized while recording
    assert lengths(layer)[2] >= 20 + layer.residual_length
    layer.record_past = False
    layer.update(k[:, :, n + 20 : n + 21], v[:, :, n + 20 : n + 21])
    ns, nq, nw = lengths(layer)
    assert layer.residual_length <= nw < layer.residual_length + layer.block_size


def test_unrecorded_rollback_into_a_block_is_counted():
    """Without recording the flushed tokens are gone: a rollback into a block returns them dequantized, counted."""
    layer, k, v, _ = _filled()
    layer.crop(-3 - 8)  # the window (10 tokens) and 1 token of the last block
    assert layer.stats["requantized_tokens"] == 7
    assert not _newest_exact(layer, k, v)


def test_crop_uninitialized_is_noop():
    layer = make_layer()
    layer.crop(-5)
    assert not layer.is_initialized and layer.get_seq_length() == 0


# ------------------------------------------------------------------------------------------------ batch ops
def _batch_op(layer: AsymKVLayer, op: str):
    if op == "reorder_cache":
        layer.reorder_cache(torch.tensor([2, 0, 1]))
    elif op == "select_tensor":
        layer.batch_select_indices(torch.tensor([2, 0]))
    elif op == "select_list":
        layer.batch_select_indices([2, 0])
    elif op == "select_bool_mask":
        layer.batch_select_indices(torch.tensor([True, False, True]))
    else:
        layer.batch_repeat_interleave(2)


_ROWS = {
    "reorder_cache": [2, 0, 1],
    "select_tensor": [2, 0],
    "select_list": [2, 0],
    "select_bool_mask": [0, 2],
    "repeat_interleave": [0, 0, 1, 1, 2, 2],
}


@pytest.mark.parametrize("op", list(_ROWS), ids=list(_ROWS))
def test_batch_ops_permute_every_buffer(op):
    """A batch op on a filled layer == a layer fed the transformed batch (rows quantize independently)."""
    n = 45
    k, v = kv(n + 1, batch=3, seed=7)
    rows = torch.tensor(_ROWS[op])
    layer, expected = make_layer(sink_tokens=2), make_layer(sink_tokens=2)
    feed(layer, k[:, :, :n], v[:, :, :n], [30] + [1] * (n - 30))
    feed(expected, k[rows, :, :n], v[rows, :, :n], [30] + [1] * (n - 30))
    _batch_op(layer, op)
    a, b = live(layer), live(expected)
    assert a.keys() == b.keys() and len(a) >= 7
    for name in a:
        assert torch.equal(a[name], b[name]), name
    out = layer.update(k[rows, :, n:], v[rows, :, n:])
    ref = expected.update(k[rows, :, n:], v[rows, :, n:])
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert out[0].shape[0] == len(rows)


def test_deepcopy_and_reset():
    layer, k, v, _ = _filled()
    clone = copy.deepcopy(layer)
    out = layer.update(k[:, :, 60:61], v[:, :, 60:61])
    out_clone = clone.update(k[:, :, 60:61], v[:, :, 60:61])
    assert torch.equal(out[0], out_clone[0]) and torch.equal(out[1], out_clone[1])
    layer.reset()
    assert not layer.is_initialized and layer.get_seq_length() == 0 and not layer.stats
    assert layer.memory_footprint().get("key_codes", 0) == 0
    fresh = make_layer(sink_tokens=2)
    for target in (layer, fresh):
        feed(target, k[:, :, :30], v[:, :, :30], [20] + [1] * 10)
    a, b = live(layer), live(fresh)
    assert all(torch.equal(a[name], b[name]) for name in b) and a.keys() == b.keys()


# ------------------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_memory_footprint_counts_real_bytes(dtype):
    layer = make_layer(sink_tokens=3)
    n = 77
    k, v = kv(n, dtype=dtype)
    feed(layer, k, v, [40] + [1] * (n - 40))
    fp = layer.memory_footprint()
    bufs = layer.buffers()
    for name, buf in bufs.items():
        assert fp[name] == (buf.data.nbytes if buf.data is not None else 0), name
    assert fp["key_zeros"] == 0  # symmetric keys store no zeros
    unused = sum((buf.data.shape[2] - buf.length) * buf.data[:, :, :1].nbytes
                 for buf in bufs.values() if buf.data is not None)  # fmt: skip
    assert fp["unused_capacity"] == unused
    assert layer.key_store.blocks.codes.data.dtype == torch.int8 and layer.value_store.blocks.codes.data.dtype == torch.uint8
    assert layer.value_store.blocks.codes.data.shape[-1] == D // 2  # int4 packed two per byte
    assert layer.dense_elements() * 2 == 2 * 2 * B * H * n * D  # bf16 equivalent, K and V


def test_values_narrower_than_keys():
    """MLA-style caches (e.g. DeepSeek-V3 in transformers) store K and V of different widths."""
    layer = AsymKVLayer(layer_config(key_spec(), value_spec(group=8), 8, residual_length=8))
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(B, H, 61, 32, generator=g), torch.randn(B, H, 61, 8, generator=g)
    feed(layer, k[:, :, :60], v[:, :, :60], [30] + [1] * 30)
    keys, values = layer.update(k[:, :, 60:], v[:, :, 60:])
    assert keys.shape == (B, H, 61, 32) and values.shape == (B, H, 61, 8)
    assert layer.dense_elements() == B * H * 61 * (32 + 8)
    assert lengths(layer) == (0, 48, 13)
    layer.crop(-16)  # into the quantized region: a partial block of both widths goes back to the window
    assert layer.stats["requantized_tokens"] == 5
    after_k, after_v = layer.update(k[:, :, :1], v[:, :, :1])
    assert torch.equal(after_k[:, :, :40], keys[:, :, :40])  # whole blocks: unchanged codes
    assert torch.equal(after_v[:, :, :40], values[:, :, :40])
    assert torch.equal(after_k[:, :, 40:45], reference_dequant(k[:, :, 40:48], layer.key_spec)[:, :, :5])
    assert torch.equal(after_v[:, :, 40:45], reference_dequant(v[:, :, 40:48], layer.value_spec)[:, :, :5])


# ------------------------------------------------------------------------------------------------ calibration
def _calibrated(policy: str) -> tuple[AsymKVLayer, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys in [-1, 1] with a calibrated absmax of 1, except channel 5 of token 3 of head 1, which is 6."""
    absmax = torch.ones(H, D)
    layer = make_layer(key_absmax=absmax.clone(), overflow_policy=policy, residual_length=0)
    g = torch.Generator().manual_seed(11)
    k = torch.rand(B, H, 16, D, generator=g) * 2 - 1
    k[:, 1, 3, 5] = 6.0
    v = torch.randn(B, H, 16, D, generator=g)
    return layer, k, v, absmax


def _dequantized_keys(layer: AsymKVLayer, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    layer.update(k, v)
    keys, _ = layer.update(k[:, :, :0], v[:, :, :0])
    assert layer.key_store.blocks.codes.length == 16
    return keys


def test_calibrated_range_without_overflow_uses_calibrated_scale():
    layer, k, v, absmax = _calibrated("error")
    k[:, 1, 3, 5] = 0.5
    keys = _dequantized_keys(layer, k, v)
    assert layer.stats["key_overflow_channels"] == 0
    step = 1.0 / 127
    assert (keys - k).abs().max() <= step / 2 * 1.01
    assert torch.allclose(layer.key_store.blocks.scales.live.float(), torch.full_like(layer.key_store.blocks.scales.live.float(), step), rtol=1e-2)


def test_calibrated_overflow_widen():
    layer, k, v, _ = _calibrated("widen")
    keys = _dequantized_keys(layer, k, v)
    # channel 5 of head 1 overflows in block 0 for each batch row
    assert layer.stats["key_overflow_channels"] == B
    assert layer.stats["key_widened_blocks"] == B
    assert layer.stats["key_clipped_values"] == 0
    # No clipping: every element within half a step of its block/channel's (widened) scale.
    bound = torch.ones_like(k) / 127 / 2
    bound[:, 1, :8, 5] = 6.0 / 127 / 2
    assert ((keys - k).abs() <= bound * 1.01).all()
    assert abs(keys[0, 1, 3, 5].item() - 6.0) <= 6.0 / 127


def test_calibrated_overflow_clip():
    layer, k, v, _ = _calibrated("clip")
    keys = _dequantized_keys(layer, k, v)
    assert layer.stats["key_overflow_channels"] == B
    assert layer.stats["key_clipped_values"] == B
    assert layer.stats["key_widened_blocks"] == 0
    err = (keys - k).abs()
    assert torch.allclose(err[:, 1, 3, 5], torch.full((B,), 5.0), atol=0.05)  # saturated at the calibrated 1.0
    err[:, 1, 3, 5] = 0
    assert err.max() <= 1 / 127 / 2 * 1.01  # everything else unaffected


def test_calibrated_overflow_error_raises_and_leaves_layer_untouched():
    layer, k, v, _ = _calibrated("error")
    layer.update(k[:, :, :4], v[:, :, :4])
    state = live(layer)
    with pytest.raises(ValueError, match=r"exceed the calibrated absmax.*overflow_policy='error'"):
        layer.update(k[:, :, 4:], v[:, :, 4:])
    assert layer.get_seq_length() == 4 and lengths(layer) == (0, 0, 4)
    assert all(torch.equal(state[name], buf) for name, buf in live(layer).items())
    assert not layer.stats  # no counter moved either (key_overflow_channels was counted before the raise)


def test_calibrated_range_with_wrong_shape_raises():
    layer = make_layer(key_absmax=torch.ones(H + 1, D))
    k, v = kv(4)
    with pytest.raises(ValueError, match=r"shape \(4, 16\).*needs \(3, 16\)"):
        layer.update(k, v)


def test_returned_tensors_are_not_rewritten_by_later_updates():
    """What `update` hands out stays valid after later flushes (DynamicCache gives the same guarantee)."""
    layer = make_layer()  # block 8, window 8: the 16th token flushes the first block
    k, v = kv(20)
    keys, values = layer.update(k[:, :, :15], v[:, :, :15])  # 15 < 8 + 8: all in the window, no flush yet
    before = keys.clone(), values.clone()
    feed(layer, k[:, :, 15:], v[:, :, 15:], [1] * 5)  # the 16th token flushes; the window buffer is reused
    assert layer.stats["tokens_quantized"] > 0
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])


# ------------------------------------------------------------------------------------------------ deferral
def test_recording_left_on_defers_one_update_only():
    """transformers' assisted generate leaves recording on; before, nothing was ever quantized again (the window
    grew like a DynamicCache). Now each update's tokens are pending for one update: the window stays bounded."""
    layer = make_layer(sink_tokens=2)
    layer.activate_past_recording()
    k, v = kv(200)
    for start in range(0, 200, 5):
        layer.update(k[:, :, start : start + 5], v[:, :, start : start + 5])
        ns, nq, nw = lengths(layer)
        assert nw < layer.residual_length + layer.block_size + 5
        assert layer.pending_tokens == (3 if start == 0 else 5)  # the first 2 tokens became sinks
    assert layer.record_past and nq >= 200 - 2 - layer.residual_length - layer.block_size - 5


def test_keep_latest_exact_holds_a_prefill_until_the_next_update():
    """The mechanism a press needs: the prefill stays exact in the window until the step after it."""
    layer = make_layer()
    layer.keep_latest_exact = True
    k, v = kv(61)
    keys, _ = layer.update(k[:, :, :60], v[:, :, :60])
    assert lengths(layer) == (0, 0, 60) and torch.equal(keys, k[:, :, :60])
    layer.update(k[:, :, :0], v[:, :, :0])  # a read keeps it pending
    assert lengths(layer) == (0, 0, 60)
    layer.update(k[:, :, 60:], v[:, :, 60:])
    ns, nq, nw = lengths(layer)
    assert nq == 48 and nw == 13  # the prefill aged out at the next update; the new token is pending


def test_reset_ends_recording_and_deferral():
    layer, k, v = _recording()
    layer.keep_latest_exact = True
    layer.reset()
    assert not layer.record_past and not layer.keep_latest_exact and layer.pending_tokens == 0
    feed(layer, k[:, :, :40], v[:, :, :40], [40])
    assert lengths(layer)[1] > 0  # an update quantizes again at once

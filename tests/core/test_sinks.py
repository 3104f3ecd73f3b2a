"""Sinks of left-padded rows: each row's first real tokens stay exact (an overlay over the quantized blocks),
anchored by the ``position_ids`` transformers hands the cache; unpadded rows are stored exactly as before."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import layer_config
from transformers import DynamicCache

from hf_asymkv import AsymKVCache, AsymKVLayer, QuantSpec, cache_kwargs
from hf_asymkv.core import compat
from hf_asymkv.core.attention import fused_attention
from hf_asymkv.core.quant import sqnr_db
from hf_asymkv.core.sinks import row_starts

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.releases]

B, H, D, S = 3, 2, 16, 4
PADS = (0, 13, 30)  # left padding of each row
KSPEC = QuantSpec("int4", "channel", symmetric=False, scale_dtype=torch.bfloat16)
VSPEC = QuantSpec("int2", "token", D, False)


def positions(n: int, pads=PADS) -> torch.Tensor:
    """What generate passes for a left-padded batch: pads at 0, each row's first real token at 0."""
    return torch.stack([(torch.arange(n) - p).clamp(min=0) for p in pads])


def make_layer(**settings) -> AsymKVLayer:
    settings = {"residual_length": 8, "sink_tokens": S, **settings}
    return AsymKVLayer(layer_config(KSPEC, VSPEC, 8, **settings))


def kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, n, D, generator=g)
    v = torch.randn(B, H, n, D, generator=g)
    for row, pad in enumerate(PADS):  # sinks carry outliers, as real attention sinks do
        k[row, :, pad : pad + S] *= 20
        v[row, :, pad : pad + S] *= 20
    return k, v


def update(layer, k, v, pos=None):
    return layer.update(k, v, kwargs={} if pos is None else {"position_ids": pos})


def filled(n: int = 70, pads=PADS, **settings):
    layer = make_layer(**settings)
    k, v = kv(n + 1)
    update(layer, k[:, :, :n], v[:, :, :n], positions(n, pads))
    return layer, k, v


# ------------------------------------------------------------------------------------------------ anchors
@pytest.mark.parametrize("ids, expected", [
    (positions(6, (0, 2, 5)), [0, 2, 5]),
    (torch.arange(6)[None], None),  # unpadded (one row for all): nothing to anchor
    (positions(6, (0, 0, 0)), None),
    (positions(6, (0, 2, 5))[None].expand(3, 3, 6), [0, 2, 5]),  # multimodal rope [3, B, n]
    (positions(5, (0, 2, 5)), None),  # not this update's length
    (None, None),
], ids=["padded", "shared-row", "unpadded", "mrope", "other-length", "none"])
def test_row_starts(ids, expected):
    starts = row_starts(ids, 3, 6)
    assert (starts is None and expected is None) or starts.tolist() == expected


def test_update_position_ids_reads_the_attention_kwargs():
    pos = positions(3)
    assert compat.update_position_ids((), {"kwargs": {"position_ids": pos}}) is pos
    assert compat.update_position_ids((), {}) is None and compat.update_position_ids(({"cache_position": pos},), {}) is None


# ------------------------------------------------------------------------------------------------ the layer
@pytest.mark.parametrize("store", ["keys", "values"])
def test_each_rows_sinks_read_back_exact(store):
    """Before: a padded row's first tokens were quantized (its sink positions 0..3 held pads)."""
    layer, k, v = filled()
    keys, values = update(layer, k[:, :, 70:], v[:, :, 70:])
    got, want = (keys, k) if store == "keys" else (values, v)
    assert layer.key_store.blocks.length == 56  # positions 4..59 quantized, for every row alike
    for row, pad in enumerate(PADS):
        sinks = slice(pad, pad + S)
        assert torch.equal(got[row, :, sinks], want[row, :, sinks]), row
    assert torch.equal(got[:, :, :S], want[:, :, :S])  # the uniform sink prefix stays exact
    quantized = got[:, :, 34:60]  # past every row's sinks: quantized, not exact
    assert not torch.equal(quantized, want[:, :, 34:60]) and sqnr_db(want[:, :, 34:60], quantized) > 3
    foot = layer.memory_footprint()
    assert foot["padded_sink_keys"] == foot["padded_sink_values"] == B * H * S * D * 4


def test_unpadded_batch_is_stored_exactly_as_without_positions():
    plain, anchored = make_layer(), make_layer()
    k, v = kv(71)
    update(plain, k[:, :, :70], v[:, :, :70])
    update(anchored, k[:, :, :70], v[:, :, :70], positions(70, (0, 0, 0)))
    for got, want in zip(update(anchored, k[:, :, 70:], v[:, :, 70:]), update(plain, k[:, :, 70:], v[:, :, 70:])):
        assert torch.equal(got, want)
    assert "padded_sink_keys" not in anchored.memory_footprint() and anchored.key_store.overlay.tokens is None


def test_fused_attention_uses_the_exact_sinks():
    layer, k, v = filled()
    layer.return_views = True
    key, value = update(layer, k[:, :, 70:], v[:, :, 70:])
    assert key.overlay is not None and int(key.overlay.valid.sum()) == 2 * S
    q = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(B, 1, 1, 71, dtype=torch.bool)
    for row, pad in enumerate(PADS):
        mask[row, :, :, :pad] = False
    got = fused_attention(q, key, value, mask, D**-0.5)
    kd, vd = (t.dense().repeat_interleave(2, 1) for t in (key, value))
    want = torch.nn.functional.scaled_dot_product_attention(q, kd, vd, mask, scale=D**-0.5).transpose(1, 2)
    assert sqnr_db(want, got) > 100


def test_crop_into_a_block_returns_the_sinks_exact():
    layer, k, v = filled()
    layer.crop(-70 + 33)  # keep 33 tokens: row 2's sinks (30..33) sit in the partly removed block 28..35
    keys, values = update(layer, k[:, :, :0], v[:, :, :0])
    assert layer.stats["requantized_tokens"] == 5  # positions 28..32 back to the window
    assert torch.equal(keys[2, :, 30:33], k[2, :, 30:33]) and torch.equal(values[2, :, 30:33], v[2, :, 30:33])


def test_batch_ops_carry_the_anchors():
    rows = torch.tensor([2, 0])
    layer, k, v = filled()
    layer.batch_select_indices(rows)
    expected = make_layer()
    update(expected, k[rows, :, :70], v[rows, :, :70], positions(70, [PADS[i] for i in rows]))
    for got, want in zip(update(layer, k[rows, :, 70:], v[rows, :, 70:]),
                         update(expected, k[rows, :, 70:], v[rows, :, 70:])):
        assert torch.equal(got, want)


def test_deepcopy_and_reset_of_an_anchored_layer():
    layer, k, v = filled()
    clone = copy.deepcopy(layer)
    assert all(torch.equal(a, b) for a, b in zip(update(layer, k[:, :, 70:], v[:, :, 70:]),
                                                 update(clone, k[:, :, 70:], v[:, :, 70:])))
    layer.reset()
    assert layer.key_store.overlay.anchors is None and layer.key_store.overlay.tokens is None


# ------------------------------------------------------------------------------------------------ through generate
needs_positions = pytest.mark.skipif(not compat.UPDATE_GETS_POSITION_IDS,
                                     reason="transformers < 5.24 hands the cache no position_ids")


@needs_positions
def test_padded_generate_keeps_every_rows_sinks_exact(llama, padded_batch):
    """After generating, the cached K/V at each row's first 4 real tokens are bit for bit a DynamicCache's."""
    ids, mask = padded_batch
    caches = {"asym": AsymKVCache(llama.config, residual_length=8, key_block_size=8), "dyn": DynamicCache()}
    for cache in caches.values():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llama.generate(ids, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=8, do_sample=False)
    pads = (mask == 0).sum(1).tolist()
    assert pads[1] > S and caches["asym"].stats()["tokens_quantized"] > 0
    for i, layer in enumerate(caches["asym"].layers):
        keys, values = layer.update(torch.zeros(2, 2, 0, 16), torch.zeros(2, 2, 0, 16))
        ref = caches["dyn"].layers[i]
        for row, pad in enumerate(pads):
            sinks = slice(pad, pad + S)
            assert torch.equal(keys[row, :, sinks], ref.keys[row, :, sinks])
            assert torch.equal(values[row, :, sinks], ref.values[row, :, sinks])


@needs_positions
def test_unpadded_generate_is_unchanged(llama, batch3, monkeypatch):
    """Unpadded batches give today's tokens and logits: the anchors change nothing there."""
    def run():
        cache = AsymKVCache(llama.config, residual_length=8, key_block_size=8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return llama.generate(batch3, **cache_kwargs(cache), max_new_tokens=12, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True)

    anchored = run()
    monkeypatch.setattr("hf_asymkv.core.layer.update_position_ids", lambda args, kwargs: None)
    before = run()
    assert torch.equal(anchored.sequences, before.sequences)
    assert all(torch.equal(a, b) for a, b in zip(anchored.logits, before.logits))

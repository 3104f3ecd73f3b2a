"""``layer.keys`` / ``layer.values`` read and assigned (what kvpress presses do), and the cache holding each
multi-token update exact until its next update of any layer (:mod:`hf_asymkv.core.kv_assign`). kvpress itself is
exercised in tests/integrations/test_kvpress.py; these tests need no kvpress."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_asymkv import AsymKVCache, AsymKVConfig, AsymKVLayer, cache_kwargs
from hf_asymkv.bench.memory import cache_nbytes
from hf_asymkv.core.attention import asymkv_sdpa_attention
from hf_asymkv.core.kv_view import QuantizedKV
from hf_asymkv.core.quant import sqnr_db

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.releases]

B, H, D = 1, 2, 16
SETTINGS = dict(key_block_size=8, residual_length=8, sink_tokens=2)


def make_layer(**settings) -> AsymKVLayer:
    layer = AsymKVLayer(AsymKVConfig(**{**SETTINGS, **settings}).resolved([D]).layer_config())
    layer.hold_updates = True  # as AsymKVCache sets it
    return layer


def kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)


def kept(k: torch.Tensor, v: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a press keeps: ``n`` tokens chosen by key norm, in their order (a fresh tensor, as kvpress's gather)."""
    index = k.norm(dim=-1).topk(n, dim=-1).indices.sort(dim=-1).values[..., None].expand(-1, -1, -1, D)
    return k.gather(2, index).contiguous(), v.gather(2, index).contiguous()


def stored(layer: AsymKVLayer) -> dict[str, torch.Tensor]:
    return {name: buf.live.clone() for name, buf in layer.buffers().items() if buf.data is not None}


def test_a_held_prefill_reads_exact_in_a_fresh_tensor():
    layer = make_layer()
    k, v = kv(40)
    layer.update(k, v)
    assert layer.pending_tokens == 38 and layer.key_store.blocks.length == 0
    keys = layer.keys
    assert torch.equal(keys, k) and torch.equal(layer.values, v)
    keys.zero_()  # the caller's copy: the layer keeps none
    assert torch.equal(layer.keys, k)


def test_settle_stores_what_an_unheld_update_stores():
    held, plain = make_layer(), make_layer()
    plain.hold_updates = False
    k, v = kv(40)
    held.update(k, v)
    plain.update(k, v)
    held.settle()
    assert held.pending_tokens == 0 and held.stats == plain.stats
    assert {n: t.shape for n, t in stored(held).items()} == {n: t.shape for n, t in stored(plain).items()}
    assert all(torch.equal(t, stored(plain)[n]) for n, t in stored(held).items())


@pytest.mark.parametrize("order", ["keys first", "values first"], ids=["keys-first", "values-first"])
def test_pruned_kv_are_stored_once_and_quantized_when_they_age_out(order):
    layer = make_layer()
    k, v = kv(40)
    layer.update(k, v)
    pk, pv = kept(layer.keys, layer.values, 20)
    if order == "keys first":
        layer.keys, layer.values = pk, pv
    else:
        layer.values, layer.keys = pv, pk
    assert layer.get_seq_length() == 20 and layer.get_mask_sizes(3) == (23, 0)
    assert layer.key_store.blocks.length == 0 and torch.equal(layer.keys, pk)  # exact until it ages out
    layer.settle()
    fresh = make_layer()
    fresh.update(pk, pv)
    fresh.settle()
    assert layer.stats["tokens_quantized"] == fresh.stats["tokens_quantized"] == 8  # (20 - 2 sinks - 8 window) // 8 * 8
    assert all(torch.equal(t, stored(fresh)[n]) for n, t in stored(layer).items())  # no second quantization
    assert layer.memory_footprint() == fresh.memory_footprint()  # nothing of the 40-token prefill is left
    assert sqnr_db(pk, layer.keys) > 30


def test_a_slice_of_a_read_is_a_rollback_that_keeps_the_blocks():
    """kvpress's multi-question loop: ``layer.keys = layer.keys[:, :, :L]`` after each answer."""
    layer = make_layer()
    k, v = kv(64)
    layer.update(k[:, :, :40], v[:, :, :40])
    layer.update(k[:, :, 40:], v[:, :, 40:])  # the question: the context's blocks are quantized now
    layer.settle()
    blocks = layer.key_store.blocks.length
    codes = layer.key_store.blocks.codes.live.clone()
    keys, values = layer.keys, layer.values
    layer.keys, layer.values = keys[:, :, :40], values[:, :, :40]
    assert layer.get_seq_length() == 40 and layer.rollbacks == 1
    assert layer.key_store.blocks.length <= blocks and torch.equal(layer.key_store.blocks.codes.live,
                                                                   codes[:, :, : layer.key_store.blocks.length])
    assert torch.equal(layer.keys, keys[:, :, :40])


def test_a_replacement_is_refused_once_blocks_are_stored():
    layer = make_layer()
    k, v = kv(40)
    layer.update(k, v)
    layer.settle()
    with pytest.raises(ValueError, match=r"holds 24 quantized tokens: storing them would quantize those tokens a "
                                         r"second time\. .*DecodingPress"):
        layer.keys, layer.values = kept(k, v, 20)
    assert layer.get_seq_length() == 40


@pytest.mark.parametrize("bad, message", [
    (lambda k: k[:, :1], r"shape \(1, 1, 20, 16\) does not fit a layer holding \[batch, kv_heads, seq, head_dim\] "
                         r"= \[1, 2, 40, 16\]"),
    (lambda k: k[0], r"floating-point \[batch, kv_heads, seq, head_dim\] tensor, got a 3-d torch.float32 tensor"),
    (lambda k: k.to(torch.int64), r"got a 4-d torch.int64 tensor"),
    (lambda k: k.double(), r"is torch.float64 on cpu; the layer holds torch.float32 on cpu"),
    (lambda k: None, r"got None \(use reset\(\) to empty a layer\)"),
    (lambda k: k.tolist(), r"got list"),
], ids=["heads", "3d", "int", "dtype", "none", "list"])
def test_a_bad_assignment_names_what_is_wrong(bad, message):
    layer = make_layer()
    k, v = kv(40)
    layer.update(k, v)
    with pytest.raises(ValueError, match=message):
        layer.keys = bad(kept(k, v, 20)[0])
    assert layer.get_seq_length() == 40


def test_keys_and_values_of_different_lengths_are_refused():
    layer = make_layer()
    k, v = kv(40)
    layer.update(k, v)
    pk, pv = kept(k, v, 20)
    layer.keys = pk
    with pytest.raises(ValueError, match=r"layer.keys holds 20 tokens and layer.values 19"):
        layer.values = pv[:, :, :19]
    assert layer.get_seq_length() == 40


def test_an_update_after_half_an_assignment_is_refused():
    layer = make_layer()
    k, v = kv(40)
    layer.update(k, v)
    layer.keys = kept(k, v, 20)[0]
    assert layer.keys.shape[2] == 20  # reads what was assigned
    with pytest.raises(ValueError, match=r"layer.keys was assigned but layer.values was not: assign both"):
        layer.update(*kv(1))


def test_a_left_padded_batch_refuses_a_replacement():
    layer = make_layer()
    k, v = kv(40)
    layer.update(k, v)
    for store in layer.stores:  # what transformers 5.24+ positions give a left-padded row
        store.overlay.set_anchors(torch.tensor([3]))
    with pytest.raises(ValueError, match=r"left-padded batch whose rows' sinks are anchored"):
        layer.keys, layer.values = kept(k, v, 20)


class Attention(torch.nn.Module):
    """Stands for a model's attention module: it hands its K/V to the cache from its own ``forward``, as
    transformers' attention modules do (:mod:`hf_asymkv.core.hooks` looks for it on the stack)."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, cache, k, v):
        return cache.update(k, v, self.layer_idx)


def test_the_cache_holds_one_layer_until_its_next_update_under_a_hook(llama):
    """A forward hook on the attention module (a press) reads the layer's update exact: held until the next update
    of any layer. ``memory_footprint()`` counts what waits as ``pending_*`` and changes nothing."""
    cache = AsymKVCache(llama.config, **SETTINGS)
    k, v = kv(40)
    seen = []
    modules = [Attention(i) for i in range(2)]
    for module in modules:
        module.register_forward_hook(lambda m, args, out: seen.append(cache.layers[m.layer_idx].keys.clone()))
    modules[0](cache, k, v)
    assert cache.held_layer == 0 and cache.layers[0].key_store.blocks.length == 0
    assert torch.equal(seen[0], k)  # the hook read the exact update
    modules[1](cache, k, v)  # layer 0's update had its turn
    assert cache.held_layer == 1 and cache.layers[0].key_store.blocks.length == 24
    assert cache.layers[1].key_store.blocks.length == 0
    footprint = cache.memory_footprint()
    assert footprint["pending_keys"] == footprint["pending_values"] == 24 * B * H * D * 4
    assert cache.held_layer == 1 and cache.layers[1].key_store.blocks.length == 0  # counted as it is
    assert footprint["total"] == cache_nbytes(cache)
    cache.settle()
    assert cache.held_layer is None and cache.layers[1].key_store.blocks.length == 24
    assert "pending_keys" not in cache.memory_footprint()


@pytest.mark.parametrize("caller", ["module", "hand"])
def test_an_update_without_a_hook_is_stored_at_once(llama, caller):
    """No hook reads it: a multi-token update is quantized in the update itself, whether a module without hooks or
    user code calls ``cache.update``."""
    cache = AsymKVCache(llama.config, **SETTINGS)
    k, v = kv(40)
    if caller == "module":
        Attention(0)(cache, k, v)
    else:
        cache.update(k, v, 0)
    assert cache.held_layer is None and cache.layers[0].key_store.blocks.length == 24
    assert cache.layers[0].pending_tokens == 0


def test_a_rollback_by_assignment_is_not_a_reused_cache(llama):
    """The pipeline's next question after slicing the cache back is a rollback asked for: no CacheReuseWarning."""
    cache = AsymKVCache(llama.config, **SETTINGS)
    ids = torch.randint(3, 256, (1, 40))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        llama(ids, **cache_kwargs(cache))
        lengths = [cache.get_seq_length(i) for i in range(2)]
        for step in range(3):
            llama(ids[:, step : step + 1], **cache_kwargs(cache))
        for i, n in enumerate(lengths):
            layer = cache.layers[i]
            layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        llama(ids[:, :5], **cache_kwargs(cache))
    assert cache.get_seq_length() == 45


def test_fused_attention_refuses_head_wise_masking():
    layer = make_layer()
    out = None
    for n in (40, 1, 1):
        layer.return_views = True
        out = layer.update(*kv(n, seed=n))
    assert isinstance(out[0], QuantizedKV)
    module = torch.nn.Module()
    module.masked_key_indices = (torch.tensor([0]), torch.tensor([0]), torch.tensor([5]))
    query = torch.randn(B, 4, 1, D)
    with pytest.raises(ValueError, match=r"head-wise presses .*AdaKVPress.* Use attn_implementation='sdpa'"):
        asymkv_sdpa_attention(module, query, out[0], out[1], None)
    with pytest.raises(ValueError, match=r"QuantizedKV cannot be written to: head-wise presses"):
        out[0][0, 0, 5] = torch.zeros(D)

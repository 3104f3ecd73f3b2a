"""Per-layer overrides (``AsymKVConfig.layer_overrides``) through the cache: each layer stores with its own
settings, on the dense and the fused path, in the footprint, and bad indices are refused naming the layer."""

from __future__ import annotations

import pytest
import torch
from conftest import hybrid_config, llama_config

from hf_asymkv import AsymKVCache, cache_kwargs, register_attention
from hf_asymkv.core.attention import ATTN_IMPLEMENTATION

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.releases]

SMALL = dict(residual_length=8, key_block_size=8)
# layer 0 protected (int8 keys, 8-bit values, 16-token blocks), layer 1 the lossy base (asymmetric int2 keys)
BASE = dict(key_format="int2", key_symmetric=False, value_bits=2, **SMALL)
PROTECT = {0: {"key_format": "int8", "key_symmetric": True, "value_bits": 8, "key_block_size": 16}}


def _feed(cache: AsymKVCache, n: int = 70, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Feed every layer ``n`` random tokens (one prefill) and return each layer's dense read-out."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 1, 2, n, 16, generator=g)
    for i in range(len(cache.layers)):
        cache.update(k, v, i)
    return [cache.update(k[:, :, :0], v[:, :, :0], i) for i in range(len(cache.layers))]


def test_each_layer_stores_with_its_own_settings():
    cache = AsymKVCache(llama_config(), **BASE, layer_overrides=PROTECT)
    protected = AsymKVCache(llama_config(), **{**BASE, **PROTECT[0]})
    plain = AsymKVCache(llama_config(), **BASE)
    layer0, layer1 = cache.layers
    assert (layer0.key_spec.fmt, layer0.value_spec.bits, layer0.block_size) == ("int8", 8, 16)
    assert (layer1.key_spec.fmt, layer1.value_spec.bits, layer1.block_size) == ("int2", 2, 8)
    got, want0, want1 = _feed(cache), _feed(protected), _feed(plain)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want0[0]))  # layer 0 reads back as a protected cache's
    assert all(torch.equal(a, b) for a, b in zip(got[1], want1[1]))  # layer 1 as the plain one's
    foot = cache.memory_footprint()
    assert foot["total"] == sum(sum(v for k, v in layer.memory_footprint().items() if k != "unused_capacity")
                                for layer in cache.layers)
    assert layer0.memory_footprint()["key_codes"] > 3 * layer1.memory_footprint()["key_codes"]  # 8 vs 2 bits


def test_fused_path_honours_overrides(llama, prompt):
    register_attention()
    import copy

    fused = copy.deepcopy(llama)
    fused.set_attn_implementation(ATTN_IMPLEMENTATION)
    out = {}
    for tag, model in (("dense", llama), ("fused", fused)):
        cache = AsymKVCache(model.config, **BASE, layer_overrides=PROTECT)
        out[tag] = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=10, do_sample=False)
        assert cache.layers[0].key_spec.fmt == "int8" and cache.stats()["tokens_quantized"] > 0
    assert torch.equal(out["dense"], out["fused"])


def test_negative_index_counts_from_the_last_layer():
    cache = AsymKVCache(llama_config(), layer_overrides={-1: {"value_bits": 8}})
    assert [layer.value_spec.bits for layer in cache.layers] == [4, 8]


@pytest.mark.parametrize("overrides, message", [
    ({2: {"value_bits": 8}}, r"layer_overrides names layer 2, but the model has 2 layers"),
    ({0: {"value_group_size": 5}}, r"layer 0: value_group_size must divide head_dim=16"),
], ids=["beyond", "group"])
def test_bad_override_names_the_layer(overrides, message):
    with pytest.raises(ValueError, match=message):
        AsymKVCache(llama_config(), layer_overrides=overrides)


def test_override_of_a_sliding_layer_is_refused():
    with pytest.raises(ValueError, match=r"layer_overrides names layer 0, a 'sliding_attention' layer that is not "
                                         r"quantized; overrides apply to the quantized layers \[1, 3\]"):
        AsymKVCache(hybrid_config(), layer_overrides={0: {"value_bits": 8}})
    cache = AsymKVCache(hybrid_config(), layer_overrides={3: {"value_bits": 8}})
    assert cache.layers[3].value_spec.bits == 8 and cache.layers[1].value_spec.bits == 4


def test_calibrated_ranges_refused_where_an_override_makes_keys_asymmetric():
    ranges = {0: torch.ones(2, 16), 1: torch.ones(2, 16)}
    with pytest.raises(ValueError, match=r"layer 1: its layer_overrides make keys int4/channel symmetric=False"):
        AsymKVCache(llama_config(), key_absmax=ranges,
                    layer_overrides={1: {"key_format": "int4", "key_symmetric": False}})
    cache = AsymKVCache(llama_config(), key_absmax=ranges, layer_overrides={1: {"key_format": "int4"}})
    assert cache.layers[1].key_absmax is not None and cache.layers[1].key_spec.fmt == "int4"


def test_presets_take_overrides():
    cache = AsymKVCache.from_preset("max", llama_config(), layer_overrides=PROTECT)
    assert cache.layers[0].key_spec.fmt == "int8" and cache.layers[1].key_spec.fmt == "int3"
    assert "overrides for layers [0]" in repr(cache)


@pytest.mark.parametrize("preset", ["compact", "max"])
def test_protecting_a_layer_drops_wide_channels_its_keys_cannot_have(preset):
    """int8 keys (the documented protection) have no wide channels: the override drops the preset's there, and
    keeps them where the override leaves keys that can have them; naming them with int8 keys is still refused."""
    cache = AsymKVCache.from_preset(preset, llama_config(), layer_overrides={0: {"key_format": "int8"},
                                                                             1: {"key_block_size": 32}})
    assert cache.layers[0].key_spec.wide_fraction == 0 and cache.layers[1].key_spec.wide_fraction == 0.25
    assert cache.cache_config.overrides() == {0: {"key_format": "int8"}, 1: {"key_block_size": 32}}
    with pytest.raises(ValueError, match=r"layer_overrides\[0\]: key_wide_fraction=0.25 needs int4, int3 or int2"):
        AsymKVCache.from_preset(preset, llama_config(),
                                layer_overrides={0: {"key_format": "int8", "key_wide_fraction": 0.25}})


def test_overrides_chosen_after_the_prefill():
    """Protection chosen by measurement: keep the prefill exact, look at it, then set overrides before the next
    update; the cache then equals one built with those overrides from the start."""
    cache = AsymKVCache(llama_config(), **BASE)
    for layer in cache.layers:
        layer.keep_latest_exact = True
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, 2, 70, 16, generator=g)
    for i in range(2):
        cache.update(k, v, i)
    assert cache.stats()["tokens_quantized"] == 0  # the prefill is still exact: it can be measured
    cache.apply_layer_overrides(PROTECT)
    for layer in cache.layers:
        layer.keep_latest_exact = False
    assert cache.cache_config.overrides() == PROTECT and cache.layers[0].key_spec.fmt == "int8"
    reference = AsymKVCache(llama_config(), **BASE, layer_overrides=PROTECT)
    for i in range(2):
        reference.update(k, v, i)
    step = torch.randn(2, 1, 2, 1, 16, generator=g)
    for i in range(2):
        cache.update(*step, i)  # the deferred prefill is quantized now (and read exact this once: it is at hand)
        reference.update(*step, i)
        empty = step[0][:, :, :0]
        assert all(torch.equal(a, b) for a, b in zip(cache.update(empty, empty, i), reference.update(empty, empty, i)))


def test_overrides_refused_once_blocks_exist():
    cache = AsymKVCache(llama_config(), **BASE)
    k = torch.randn(1, 2, 40, 16)
    cache.update(k, k, 0)  # layer 0 quantizes at the cache's next update (of layer 1 here)
    cache.update(k[:, :, :1], k[:, :, :1], 1)
    with pytest.raises(ValueError, match=r"layer 0: cannot reconfigure a layer that holds 24 quantized tokens"):
        cache.apply_layer_overrides(PROTECT)
    assert cache.layers[0].key_spec.fmt == "int2" and cache.cache_config.overrides() == {}  # nothing changed
    with pytest.raises(ValueError, match=r"layer_overrides names layer 5, but the model has 2 layers"):
        cache.apply_layer_overrides({5: {"value_bits": 8}})


def test_reconfigure_refuses_other_sinks_once_tokens_are_stored():
    cache = AsymKVCache(llama_config(), **BASE)
    layer = cache.layers[1]
    layer.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16))
    other = AsymKVCache(llama_config(), **BASE, sink_tokens=0).layer_configs[1]
    with pytest.raises(ValueError, match=r"cannot change sink_tokens from 4 to 0 once tokens are stored"):
        layer.reconfigure(other)
    with pytest.raises(ValueError, match=r"AsymKVLayer takes a LayerConfig .*got dict"):
        layer.reconfigure({})

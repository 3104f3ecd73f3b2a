"""`AsymKVConfig`: one validated settings object, its versioned dict form, and its use by the cache."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import llama_config

from hf_asymkv import KEY_FORMATS, PRESETS, VALUE_BITS, AsymKVCache, AsymKVConfig
from hf_asymkv.core.config import CONFIG_VERSION


def test_defaults_are_the_documented_ones():
    c = AsymKVConfig()
    assert (c.key_format, c.value_bits, c.key_block_size, c.residual_length, c.sink_tokens) == ("int8", 4, 128, 64, 4)
    assert c.value_rotation and not c.key_rotation and c.key_symmetric
    assert c == PRESETS["balanced"]  # the default is the balanced preset (README, Presets)
    assert c.key_format in KEY_FORMATS and c.value_bits in VALUE_BITS


def test_frozen():
    with pytest.raises(AttributeError):
        AsymKVConfig().value_bits = 2


@pytest.mark.parametrize("field, value, message", [
    ("key_format", "int5", r"key_format must be one of \['int8', 'fp8_e4m3', 'fp8_e5m2', 'int4', 'int3', 'int2'\], got 'int5'"),
    ("value_bits", 7, r"value_bits must be one of \[1, 2, 3, 4, 5, 6, 8\], got 7"),
    ("value_bits", True, r"value_bits must be one of \[1, 2, 3, 4, 5, 6, 8\], got True"),
    ("key_granularity", "row", r"key_granularity must be one of \['channel', 'token', 'tensor'\]"),
    ("value_granularity", None, "value_granularity must be one of"),
    ("overflow_policy", "ignore", r"overflow_policy must be one of \['widen', 'clip', 'error'\]"),
    ("value_symmetric", 1, "value_symmetric must be True or False, got 1"),
    ("key_symmetric", "no", "key_symmetric must be True or False, got 'no'"),
    ("value_rotation", 1, "value_rotation must be True or False, got 1"),
    ("key_rotation", None, "key_rotation must be True or False, got None"),
    ("key_block_size", 0, "key_block_size must be an int >= 1, got 0"),
    ("key_block_size", 8.0, "key_block_size must be an int >= 1, got 8.0"),
    ("residual_length", -1, "residual_length must be an int >= 0, got -1"),
    ("sink_tokens", "4", "sink_tokens must be an int >= 0, got '4'"),
    ("max_growth_tokens", 0, "max_growth_tokens must be an int >= 1"),
    ("value_group_size", 0, "value_group_size must be an int >= 1, got 0"),
    ("key_group_size", -8, "key_group_size must be an int >= 1, got -8"),
    ("growth_factor", 1.0, "growth_factor must be a number > 1, got 1.0"),
    ("growth_factor", True, "growth_factor must be a number > 1, got True"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 20 else None)
def test_bad_field_is_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        AsymKVConfig(**{field: value})


def test_unknown_setting_is_a_value_error_listing_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown AsymKVCache settings \['window'\]; allowed: \['key_format'"):
        AsymKVConfig.from_kwargs(window=8)
    with pytest.raises(ValueError, match=r"unknown AsymKVCache settings \['window'\]"):
        AsymKVCache(llama_config(), window=8)


def test_replace_validates():
    c = AsymKVConfig().replace(sink_tokens=4)
    assert c.sink_tokens == 4 and c.value_bits == 4
    with pytest.raises(ValueError, match="sink_tokens must be an int >= 0"):
        c.replace(sink_tokens=-4)


def test_dict_round_trip_through_json():
    c = AsymKVConfig(key_format="fp8_e4m3", value_bits=2, sink_tokens=4, value_group_size=32)
    d = json.loads(json.dumps(c.to_dict()))
    assert d["config_version"] == CONFIG_VERSION == 5
    assert AsymKVConfig.from_dict(d) == c


@pytest.mark.parametrize("preset", list(PRESETS), ids=list(PRESETS))
def test_presets_round_trip_through_json(preset):
    c = PRESETS[preset]
    assert AsymKVConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_version_1_dicts_read_with_the_new_fields_off():
    """A version-1 ``asymkv_config.json`` (no key_symmetric / rotation fields) keeps its old meaning."""
    c = AsymKVConfig.from_dict({"config_version": 1, "key_format": "int8", "value_bits": 4, "sink_tokens": 4})
    assert (c.key_symmetric, c.value_rotation, c.key_rotation) == (True, False, False)
    assert c == AsymKVConfig(sink_tokens=4, residual_length=128, value_rotation=False)


@pytest.mark.parametrize("version", [1, 2])
def test_older_dicts_keep_the_defaults_of_their_version(version):
    """Version 3 changed the defaults (window 64, 4 sinks, rotated V); an older dict that omits them keeps its
    version's (window 128, no sinks, V unrotated)."""
    c = AsymKVConfig.from_dict({"config_version": version})
    assert (c.residual_length, c.sink_tokens, c.value_rotation) == (128, 0, False)
    assert AsymKVConfig.from_dict({"config_version": 3}) == AsymKVConfig()


def test_asymmetric_keys_need_an_integer_format():
    with pytest.raises(ValueError, match="key_symmetric=False needs an integer key_format, got 'fp8_e4m3'"):
        AsymKVConfig(key_format="fp8_e4m3", key_symmetric=False)


def test_from_dict_fills_defaults_and_reads_unversioned_dicts():
    """Version-1 publish folders stored only the settings they changed, without a config_version."""
    assert AsymKVConfig.from_dict({"residual_length": 64}) == AsymKVConfig(sink_tokens=0, value_rotation=False)


@pytest.mark.parametrize("data, message", [
    ([1], "settings must be a JSON object, got list"),
    ({"config_version": 6}, r"settings: config_version 6 is not supported \(supported: \[1, 2, 3, 4, 5\]\); upgrade hf-asymkv"),
    ({"window": 8}, r"settings: unknown AsymKVCache settings \['window'\]"),
    ({"residual_length": [8]}, "settings: setting 'residual_length' must be a JSON scalar"),
    ({"value_bits": 7}, r"settings: value_bits must be one of \[1, 2, 3, 4, 5, 6, 8\], got 7"),
], ids=["not-object", "future-version", "unknown", "not-scalar", "bad-value"])
def test_from_dict_names_the_problem(data, message):
    with pytest.raises(ValueError, match=message):
        AsymKVConfig.from_dict(data)


@pytest.mark.parametrize("head_dims, value_group", [([64], 64), ([128], 128), ([256], 128), ([80], 80), ([64, 256], 64)])
def test_resolved_group_sizes(head_dims, value_group):
    c = AsymKVConfig().resolved(head_dims)
    assert c.value_group_size == value_group
    assert c.key_group_size == min(head_dims)
    assert AsymKVConfig().value_group_size is None  # the config itself stays model-agnostic


@pytest.mark.parametrize("settings", [dict(value_symmetric=True), dict(value_granularity="tensor")],
                         ids=["symmetric", "per-tensor"])
def test_one_bit_values_need_asymmetric_groups(settings):
    with pytest.raises(ValueError, match=r"value_bits=1 needs asymmetric values per 'token' or 'channel'"):
        AsymKVConfig(value_bits=1, **settings)
    assert AsymKVConfig(value_bits=1).resolved([64]).value_spec().fmt == "int1"


def test_resolved_refuses_a_group_that_does_not_divide_and_lists_divisors():
    with pytest.raises(ValueError, match=r"value_group_size must divide head_dim=16 \(one of \[1, 2, 4, 8, 16\]\), got 6"):
        AsymKVConfig(value_group_size=6).resolved([16])
    with pytest.raises(ValueError, match=r"key_group_size must divide every head_dim \[16, 32\]"):
        AsymKVConfig(key_group_size=32).resolved([16, 32])


def test_specs():
    c = AsymKVConfig(value_bits=2).resolved([64])
    k, v = c.key_spec(), c.value_spec()
    assert (k.fmt, k.granularity, k.symmetric, k.scale_dtype) == ("int8", "channel", True, torch.bfloat16)
    assert (v.fmt, v.granularity, v.group_size, v.symmetric, v.scale_dtype) == ("int2", "token", 64, False, torch.float16)


def test_cache_reads_one_config_and_settings_override_it():
    base = AsymKVConfig(residual_length=32, sink_tokens=2)
    cache = AsymKVCache(llama_config(), base, value_bits=8)
    assert cache.cache_config == AsymKVConfig(residual_length=32, sink_tokens=2, value_bits=8).resolved([16])
    assert cache.settings["value_bits"] == 8 and cache.value_spec.fmt == "int8"
    layer = cache.layers[0]
    assert (layer.residual_length, layer.sink_tokens) == (32, 2)
    assert "window=32" in repr(cache) and "sinks=2" in repr(cache)


def test_cache_refuses_a_cache_config_of_another_type():
    with pytest.raises(ValueError, match="cache_config must be an AsymKVConfig, got dict"):
        AsymKVCache(llama_config(), {"value_bits": 2})


# ------------------------------------------------------------------------------------------------ per-layer overrides
PROTECT = {0: {"key_format": "int8", "key_symmetric": True, "value_bits": 8}, -1: {"residual_length": 128}}


def test_layer_overrides_are_normalized_and_read_back():
    c = AsymKVConfig(key_format="int4", key_symmetric=False, layer_overrides=PROTECT)
    assert c.overrides() == PROTECT
    assert c == AsymKVConfig(key_format="int4", key_symmetric=False, layer_overrides=dict(reversed(PROTECT.items())))
    hash(c)  # still immutable and hashable
    layer0 = c.for_layer(0)
    assert (layer0.key_format, layer0.key_symmetric, layer0.value_bits, layer0.layer_overrides) == ("int8", True, 8, ())
    assert c.for_layer(5) == AsymKVConfig(key_format="int4", key_symmetric=False)  # no override: the base settings
    assert "overrides for layers [-1, 0]" in c.describe()


def test_layer_overrides_round_trip_through_json():
    c = AsymKVConfig(layer_overrides=PROTECT)
    d = json.loads(json.dumps(c.to_dict()))
    assert d["config_version"] == CONFIG_VERSION and d["layer_overrides"] == {"0": PROTECT[0], "-1": PROTECT[-1]}
    assert AsymKVConfig.from_dict(d) == c
    assert AsymKVConfig().replace(layer_overrides=PROTECT) == c and c.replace(value_bits=2).overrides() == PROTECT


def test_older_dicts_have_no_overrides():
    assert AsymKVConfig.from_dict({"config_version": 3}).layer_overrides == ()


@pytest.mark.parametrize("overrides, message", [
    ({0: {"key_format": "int5"}}, r"layer_overrides\[0\]: key_format must be one of .*got 'int5'"),
    ({-2: {"residual_length": -1}}, r"layer_overrides\[-2\]: residual_length must be an int >= 0, got -1"),
    ({3: {"key_format": "fp8_e4m3", "key_symmetric": False}}, r"layer_overrides\[3\]: key_symmetric=False needs an integer"),
    ({1: {"growth_factor": 2.0}}, r"layer_overrides\[1\]: unknown or not per-layer settings \['growth_factor'\]"),
    ({"0": {"value_bits": 2}}, r"layer_overrides keys must be layer indices \(int\), got '0'"),
    ({True: {"value_bits": 2}}, r"layer_overrides keys must be layer indices \(int\), got True"),
    ([0], r"layer_overrides must be a dict"),
], ids=["bad-format", "bad-window", "fp8-asym", "not-per-layer", "str-index", "bool-index", "not-a-dict"])
def test_bad_layer_override_is_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        AsymKVConfig(layer_overrides=overrides)


@pytest.mark.parametrize("data, message", [
    ({"config_version": 4, "layer_overrides": {"zero": {}}}, r"settings: layer_overrides keys must be layer indices, got 'zero'"),
    ({"config_version": 4, "layer_overrides": {"0": {"value_bits": [2]}}}, r"settings: layer_overrides\[0\] must be an object"),
    ({"config_version": 4, "layer_overrides": [1]}, r"settings: layer_overrides must be a JSON object"),
    ({"config_version": 4, "layer_overrides": {"1": {"value_bits": 7}}}, r"settings: layer_overrides\[1\]: value_bits must"),
], ids=["bad-key", "non-scalar", "not-object", "bad-value"])
def test_from_dict_names_bad_overrides(data, message):
    with pytest.raises(ValueError, match=message):
        AsymKVConfig.from_dict(data)


TYPES = ["full_attention", "sliding_attention", "full_attention", "full_attention"]


def test_layer_configs_apply_each_override_once():
    c = AsymKVConfig(layer_overrides={0: {"key_block_size": 32, "value_bits": 2}, -1: {"sink_tokens": 0}}).resolved([16])
    configs = c.layer_configs({0: 16, 2: 16, 3: 16}, TYPES)
    assert sorted(configs) == [0, 2, 3]
    assert configs[0].block_size == 32 and configs[0].value_spec.bits == 2 and configs[0].sink_tokens == 4
    assert configs[3].sink_tokens == 0 and configs[3].block_size == 128
    assert configs[2] == c.layer_config()


@pytest.mark.parametrize("overrides, message", [
    ({4: {"value_bits": 2}}, r"layer_overrides names layer 4, but the model has 4 layers \(indices 0 to 3, or -1 to -4"),
    ({-5: {"value_bits": 2}}, r"layer_overrides names layer -5, but the model has 4 layers"),
    ({1: {"value_bits": 2}}, r"layer_overrides names layer 1, a 'sliding_attention' layer that is not quantized; "
                             r"overrides apply to the quantized layers \[0, 2, 3\]"),
    ({3: {"value_bits": 2}, -1: {"value_bits": 8}}, r"layer_overrides names layer 3 twice \(as -1 and 3\)"),
    ({2: {"value_group_size": 12}}, r"layer 2: value_group_size must divide head_dim=16"),
], ids=["beyond", "beyond-negative", "sliding", "twice", "group"])
def test_layer_configs_refuse_bad_indices_naming_the_layer(overrides, message):
    c = AsymKVConfig(layer_overrides=overrides).resolved([16])
    with pytest.raises(ValueError, match=message):
        c.layer_configs({0: 16, 2: 16, 3: 16}, TYPES)


def test_quantize_sliding_is_written_only_when_set_and_read_back():
    """A config that leaves it off writes no ``quantize_sliding`` key, so the 0.1 releases (which refuse unknown keys)
    still read its ``asymkv_config.json``; one that sets it round-trips."""
    off, on = AsymKVConfig(), AsymKVConfig(quantize_sliding=True)
    assert "quantize_sliding" not in off.to_dict() and on.to_dict()["quantize_sliding"] is True
    assert AsymKVConfig.from_dict(off.to_dict()) == off and AsymKVConfig.from_dict(on.to_dict()) == on

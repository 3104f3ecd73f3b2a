"""Sensitivity per (layer, width) and the allocation of widths under a bytes budget."""

import math

import pytest
import torch

from hf_asymkv.calibration.allocate import allocate, allocation_overrides, check_sensitivity, preset_bits
from hf_asymkv.calibration.sensitivity import KEY_WIDTHS, VALUE_WIDTHS, layer_sensitivity, width_bits
from hf_asymkv.core.config import AsymKVConfig
from hf_asymkv.core.presets import PRESETS


def _sensitivity(keys: dict[str, list[float]], values: dict[str, list[float]]) -> dict:
    layers = list(range(len(next(iter(keys.values())))))
    return {"version": 1, "layers": layers, "keys": keys, "values": values}


def test_width_bits_count_codes_and_scales():
    assert width_bits(KEY_WIDTHS["int4"], 64) == 4 + 32 / 64  # scale and zero per (channel, 64-token block)
    assert width_bits(KEY_WIDTHS["int8"], 64) == 8 + 16 / 128  # symmetric: scale only
    assert width_bits(VALUE_WIDTHS["v2"], 64) == 2 + 32 / 64  # scale and zero per token and 64-channel group
    assert preset_bits(PRESETS["tight"], 64) == (3.5 + 2.5) / 2
    assert width_bits(VALUE_WIDTHS["v1"], 64) == 1 + 32 / 64
    # max's keys: tight's with a high-bit byte per token for 16 of 64 channels and 16 one-byte indices per block
    assert width_bits(KEY_WIDTHS["int3w"], 64) == 3 + 32 / 64 + 8 / 64 * 2 + 16 * 8 / (64 * 64)
    assert preset_bits(PRESETS["max"], 64) == (width_bits(KEY_WIDTHS["int3w"], 64) + 1.5) / 2
    # compact's keys: a byte of high bits per token for 16 of 64 channels, and 16 one-byte indices per block
    assert width_bits(KEY_WIDTHS["int4w"], 64) == 4 + 32 / 64 + 8 / 64 * 2 + 16 * 8 / (64 * 64)
    assert preset_bits(PRESETS["compact"], 64) == (width_bits(KEY_WIDTHS["int4w"], 64) + 3 + 32 / 64) / 2
    with pytest.raises(ValueError, match=r"width settings must name key_format or value_bits, got \{'sink_tokens'"):
        width_bits({"sink_tokens": 4}, 64)


def test_greedy_spends_the_budget_where_kl_per_bit_is_largest():
    # layer 0's keys are 100x more sensitive than layer 1's; values cost little everywhere
    sens = _sensitivity({"int2": [1.0, 0.01], "int4": [0.01, 0.001]},
                        {"v2": [0.001, 0.001], "v4": [0.0005, 0.0005]})
    floor = (3 + 2.5) / 2
    assert allocate(sens, floor, 64) == {0: ("int2", "v2"), 1: ("int2", "v2")}  # no room: every layer cheapest
    one_upgrade = floor + (4.5 - 3) / 4  # the bits of one layer's keys int2 -> int4
    assert allocate(sens, one_upgrade, 64) == {0: ("int4", "v2"), 1: ("int2", "v2")}
    assert allocate(sens, 100.0, 64) == {0: ("int4", "v4"), 1: ("int4", "v4")}  # all that helps, and no more


def test_a_wider_setting_that_does_not_help_is_not_bought():
    sens = _sensitivity({"int2": [0.1], "int8": [0.2]}, {"v2": [0.0]})  # measured worse at the wider width
    assert allocate(sens, 100.0, 64) == {0: ("int2", "v2")}


def test_overrides_make_a_valid_config():
    overrides = allocation_overrides({0: ("int4", "v2"), 29: ("int8", "v8")})
    config = AsymKVConfig(**PRESETS["max"].settings() | {"layer_overrides": overrides})
    assert config.for_layer(0).key_format == "int4" and config.for_layer(0).value_bits == 2
    assert config.for_layer(29).key_format == "int8" and config.for_layer(29).key_symmetric


def test_overrides_on_compact_do_not_inherit_its_wide_channels():
    """compact's keys have wide channels; a layer given int8 (or int3) keys must not keep them (int8 has none)."""
    overrides = allocation_overrides({0: ("int8", "v4"), 1: ("int3", "v2"), 2: ("int4w", "v3")})
    config = PRESETS["compact"].replace(layer_overrides=overrides)
    assert [config.for_layer(i).key_wide_fraction for i in range(3)] == [0.0, 0.0, 0.25]


@pytest.mark.parametrize(("sens", "message"), [
    ({"version": 9}, "sensitivity: version 9 is not supported"),
    ([], "sensitivity: version 'list' is not supported"),
    ({"version": 1, "layers": []}, "'layers' must be a non-empty list"),
    ({"version": 1, "layers": [0], "keys": {"int5": [0.1]}, "values": {"v2": [0.1]}}, "unknown keys width 'int5'"),
    ({"version": 1, "layers": [0, 1], "keys": {"int2": [0.1]}, "values": {"v2": [0.1, 0.1]}},
     r"keys\['int2'\] must hold 2 finite costs"),
    ({"version": 1, "layers": [0], "keys": {"int2": [math.nan]}, "values": {"v2": [0.1]}}, "finite costs >= 0"),
    ({"version": 1, "layers": [0], "keys": {"int2": [0.1]}, "values": {}}, "'values' must map widths"),
], ids=["version", "not-a-dict", "no-layers", "unknown-width", "wrong-count", "nan", "no-values"])
def test_malformed_sensitivity_is_refused(sens, message):
    with pytest.raises(ValueError, match=message):
        check_sensitivity(sens)
    with pytest.raises(ValueError, match=message):
        allocate(sens, 4.0, 64)


def test_a_budget_below_the_cheapest_widths_is_refused():
    sens = _sensitivity({"int2": [0.1], "int4": [0.01]}, {"v2": [0.1]})
    with pytest.raises(ValueError, match=r"budget_bits 2.0 is below the cheapest widths' 2.750"):
        allocate(sens, 2.0, 64)


def test_sensitivity_of_a_tiny_model(llama, single_thread):
    ids = torch.randint(3, llama.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    sens = layer_sensitivity(llama, ids, queries=8)
    check_sensitivity(sens)
    assert sens["layers"] == [0, 1] and sens["tokens"] == 300
    for i in range(2):  # fewer key bits cost more attention KL, 8-bit keys next to nothing
        assert sens["keys"]["int2"][i] > sens["keys"]["int4"][i] > sens["keys"]["int8"][i]
        assert sens["keys"]["int8"][i] < 1e-3 * sens["keys"]["int2"][i] + 1e-7
    # layer 1's values feed no later layer: every width costs what its 8-bit keys (measured with them) cost
    assert all(abs(sens["values"][w][1] - sens["keys"]["int8"][1]) < 1e-12 for w in VALUE_WIDTHS)
    assert sens["values"]["v2"][0] > 10 * sens["values"]["v8"][0]  # layer 0's values move layer 1's attention


@pytest.mark.parametrize(("ids", "queries", "message"), [
    (torch.zeros(300, dtype=torch.long), 8, r"ids must be \[1, T\] token ids, got shape \(300,\)"),
    (torch.zeros(1, 300, dtype=torch.long), 300, r"queries must be in \[1, 299\] for a 300-token window, got 300"),
], ids=["shape", "queries"])
def test_sensitivity_bad_input(llama, ids, queries, message):
    with pytest.raises(ValueError, match=message):
        layer_sensitivity(llama, ids, queries)


def test_prefill_sensitivity_from_the_prefill_keys(llama, single_thread):
    """From the prefill alone: per layer and width, the keys' relative round-trip error. Per-channel
    asymmetric codes absorb a per-channel offset (a k_proj bias): the same keys plus offsets lose no more in
    absolute terms, so less relative to their size; the result is allocatable."""
    from transformers.cache_utils import DynamicCache

    from hf_asymkv.calibration.sensitivity import prefill_sensitivity

    cache = DynamicCache(config=llama.config)
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 200, 16, generator=g), torch.randn(1, 2, 200, 16, generator=g)
    cache.update(keys, values, 0)
    cache.update(keys + torch.linspace(0, 40, 16), values, 1)  # layer 1: offsets, as a k_proj bias gives
    sens = prefill_sensitivity(cache, [0, 1])
    check_sensitivity(sens)
    assert sens["tokens"] == 128 and sens["source"] == "prefill"  # whole 128-token blocks
    assert sens["keys"]["int2"][1] < sens["keys"]["int2"][0]  # relative error: the offset is stored exactly-ish
    assert sens["keys"]["int2"][0] > sens["keys"]["int4"][0] > sens["keys"]["int8"][0]
    # the wide channels are part of the round trip (a quarter of the channels with a fifth bit: less error)
    assert sens["keys"]["int4"][0] > sens["keys"]["int4w"][0] > sens["keys"]["int8"][0]
    assert allocate(sens, 100.0, 16) == {0: ("int8", "v8"), 1: ("int8", "v8")}


def test_prefill_sensitivity_needs_one_whole_block(llama):
    from transformers.cache_utils import DynamicCache

    from hf_asymkv.calibration.sensitivity import prefill_sensitivity

    cache = DynamicCache(config=llama.config)
    cache.update(torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16), 0)
    with pytest.raises(ValueError, match="needs a prefill of at least 128 tokens, got 100"):
        prefill_sensitivity(cache, [0])

"""The static cache, eagerly (``AsymKVCache(config, max_cache_len=N)``, :mod:`hf_asymkv.core.static`): the dynamic
cache's tokens and stored blocks with the same settings, left padding, beam search, reset, deepcopy, the memory it
reports, and the errors for what it does not do. Compiled runs are in ``tests/core/test_static_compile.py``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import PROMPT_LEN
from transformers import CompileConfig

from hf_asymkv import PRESETS, AsymKVCache, cache_kwargs
from hf_asymkv.bench.memory import cache_nbytes
from hf_asymkv.core.compat import CROP_TAKES_LENGTH_TO_KEEP
from hf_asymkv.core.static import StaticAsymKVLayer

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.releases]

STEPS = 32
SMALL = dict(key_block_size=8, residual_length=8)  # a flush every 8 tokens: 4 inside 32 steps
ROOM = PROMPT_LEN + STEPS


def _generate(model, inputs, cache, n: int = STEPS, **kwargs) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(inputs, **cache_kwargs(cache), max_new_tokens=n, do_sample=False,
                              disable_compile=True, **kwargs)


def _pair(model, preset: str, max_cache_len: int = ROOM, **settings) -> tuple[AsymKVCache, AsymKVCache]:
    """(dynamic, static) caches of ``preset`` with ``settings`` (the small blocks by default)."""
    settings = settings or SMALL
    return (AsymKVCache.from_preset(preset, model.config, **settings),
            AsymKVCache.from_preset(preset, model.config, max_cache_len=max_cache_len, **settings))


def _static_layers(cache: AsymKVCache) -> list[StaticAsymKVLayer]:
    return [layer for layer in cache.layers if isinstance(layer, StaticAsymKVLayer)]


@pytest.mark.parametrize("preset", list(PRESETS), ids=list(PRESETS))
@pytest.mark.parametrize("model", ["llama", "hybrid"], ids=["llama", "hybrid"], indirect=True)
def test_static_generates_the_dynamic_tokens_and_blocks(model, prompt, preset):
    dynamic, static = _pair(model, preset)
    assert torch.equal(_generate(model, prompt, static), _generate(model, prompt, dynamic))
    assert static.stats() == dynamic.stats() and static.stats()["blocks_quantized"] >= 2 * len(_static_layers(static))


@pytest.mark.parametrize("model", ["llama", "hybrid"], ids=["llama", "hybrid"], indirect=True)
def test_left_padded_batch_equals_dynamic(model, padded_batch):
    ids, mask = padded_batch
    dynamic, static = _pair(model, "balanced")  # 4 exact sinks: the padded row's are the overlay's
    assert torch.equal(_generate(model, ids, static, attention_mask=mask),
                       _generate(model, ids, dynamic, attention_mask=mask))


def test_beam_search_equals_dynamic(llama, prompt):
    dynamic, static = _pair(llama, "compact", max_cache_len=PROMPT_LEN + 16)
    beams = dict(num_beams=3, num_return_sequences=1)
    # generate expands the batch to the beams before the prefill: the static cache is allocated for 3 rows
    assert torch.equal(_generate(llama, prompt, static, 16, **beams), _generate(llama, prompt, dynamic, 16, **beams))


def test_reset_reuses_the_allocation(llama, prompt, batch3):
    _, static = _pair(llama, "balanced")
    _generate(llama, batch3[:1], static)
    addresses = [t.data_ptr() for layer in _static_layers(static) for t in layer.tensors()]
    static.reset()
    assert int(static.get_seq_length()) == 0 and static.stats()["blocks_quantized"] == 0
    again = _generate(llama, prompt, static)
    assert [t.data_ptr() for layer in _static_layers(static) for t in layer.tensors()] == addresses
    assert torch.equal(again, _generate(llama, prompt, _pair(llama, "balanced")[1]))


def test_deepcopy_continues_alike_and_shares_nothing(llama, prompt):
    _, static = _pair(llama, "balanced")
    out = _generate(llama, prompt, static, 8)
    twin = copy.deepcopy(static)
    ours = {t.data_ptr() for layer in _static_layers(static) for t in layer.tensors()}
    assert ours.isdisjoint(t.data_ptr() for layer in _static_layers(twin) for t in layer.tensors())
    first, second = (_generate(llama, out, cache, 8) for cache in (static, twin))
    assert torch.equal(first, second)


def test_memory_footprint_says_allocated_and_used(llama, prompt):
    dynamic, static = _pair(llama, "balanced")
    for cache in (dynamic, static):
        _generate(llama, prompt, cache, 20)
    mine, theirs = static.memory_footprint(), dynamic.memory_footprint()
    stores = [store for layer in _static_layers(static) for store in layer.stores]
    parts = [t for s in stores for t in (s.sinks, s.codes, s.scales, s.zeros, s.window, s.overlay.tokens)]
    small = [t for s in stores for t in (s.overlay.anchors, s.rotation)]
    small += [t for layer in _static_layers(static) for t in (layer.length, layer.blocks_stored, layer.counts)]
    assert mine["bookkeeping"] == sum(t.numel() * t.element_size() for t in small if t is not None)
    assert mine["allocated"] == mine["total"] == sum(t.numel() * t.element_size() for t in parts if t is not None) \
        + mine["bookkeeping"] == cache_nbytes(static)
    assert mine["used"] == theirs["total"] - theirs["unused_capacity"]  # the held tokens' bytes, slack aside
    assert 0 < mine["used"] < mine["allocated"] and "allocated" not in theirs
    assert "max_cache_len=96" in repr(static)


def test_layers_are_compileable_and_generate_would_compile(llama):
    dynamic, static = _pair(llama, "balanced")
    assert static.is_compileable and not dynamic.is_compileable
    config = CompileConfig()
    config._compile_all_devices = True  # transformers' own switch to compile on CPU (it compiles on GPUs by itself)
    generation_config = copy.deepcopy(llama.generation_config)
    generation_config.compile_config = config
    assert llama._valid_auto_compile_criteria(cache_kwargs(static), generation_config)  # the kwarg this release reads
    assert not llama._valid_auto_compile_criteria(cache_kwargs(dynamic), generation_config)


def test_sliding_layers_are_transformers_static_ones(hybrid):
    _, static = _pair(hybrid, "balanced")
    kinds = [type(layer).__name__ for layer in static.layers]
    assert kinds == ["StaticSlidingWindowLayer", "StaticAsymKVLayer"] * 2


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("value", [0, -4, 1.5, True, "64"], ids=["zero", "negative", "float", "bool", "str"])
def test_bad_max_cache_len_raises(llama, value):
    with pytest.raises(ValueError, match=f"max_cache_len must be an int >= 1, got {value!r}"):
        AsymKVCache(llama.config, max_cache_len=value)


def test_appending_past_max_cache_len_raises(llama, prompt):
    _, static = _pair(llama, "balanced", max_cache_len=PROMPT_LEN + 4)
    with pytest.raises(ValueError, match=r"at most max_cache_len=68 tokens: 68 are held, 1 more do not fit"):
        _generate(llama, prompt, static, 8)
    _, static = _pair(llama, "balanced", max_cache_len=PROMPT_LEN - 1)
    with pytest.raises(ValueError, match=r"at most max_cache_len=63 tokens: 0 are held, 64 more do not fit"):
        _generate(llama, prompt, static, 1)


def test_a_larger_batch_than_allocated_raises(llama, batch3):
    _, static = _pair(llama, "balanced")
    llama(input_ids=batch3[:2, :8], **cache_kwargs(static))
    with pytest.raises(ValueError, match="holds a batch of 2 rows, got 3"):
        llama(input_ids=batch3[:, 8:9], **cache_kwargs(static))


def test_crop_within_the_window_only(llama, prompt):
    _, static = _pair(llama, "balanced")
    _generate(llama, prompt, static, 4)  # 67 tokens held: 4 sinks, 6 blocks of 8, 15 in the window
    static.crop(-3)
    assert int(static.get_seq_length()) == 64
    with pytest.raises(ValueError, match="cannot crop a static cache to 51 tokens: tokens 4 to 51 are quantized"):
        static.crop(-13)
    assert int(static.get_seq_length()) == 64  # refused: nothing changed
    refusal = ("cannot crop a static cache to 3 tokens" if CROP_TAKES_LENGTH_TO_KEEP  # < 5.14: the length to keep
               else "crop takes a negative number of tokens to remove")
    with pytest.raises(ValueError, match=refusal):
        static.layers[0].crop(3)


@pytest.mark.parametrize("call, message", [
    (lambda c: c.apply_layer_overrides({0: {"value_bits": 2}}),
     "a static cache .max_cache_len. is allocated for its settings"),
    (lambda c: c.batch_repeat_interleave(2), "keeps its batch of 0 rows; build it for the expanded batch"),
    (lambda c: c.batch_select_indices(torch.tensor([0])), "keeps its batch of 0 rows; it cannot select rows"),
], ids=["layer-overrides", "repeat-interleave", "select-rows"])
def test_what_a_static_cache_does_not_do_raises(llama, call, message):
    with pytest.raises(ValueError, match=message):
        call(_pair(llama, "balanced")[1])


def test_overflow_error_policy_is_refused_with_a_calibrated_range(llama):
    absmax = {i: torch.ones(2, 16) for i in range(2)}
    with pytest.raises(ValueError, match="use overflow_policy 'widen' or 'clip', got 'error'"):
        AsymKVCache(llama.config, key_absmax=absmax, overflow_policy="error", max_cache_len=32)


@pytest.mark.parametrize("policy", ["widen", "clip"], ids=["widen", "clip"])
def test_calibrated_key_range_counts_as_dynamic(llama, prompt, policy):
    absmax = {i: torch.full((2, 16), 0.05) for i in range(2)}  # narrower than the keys: every block overflows
    dynamic, static = (AsymKVCache(llama.config, key_absmax=absmax, overflow_policy=policy, max_cache_len=n, **SMALL)
                       for n in (None, ROOM))
    assert torch.equal(_generate(llama, prompt, static, 12), _generate(llama, prompt, dynamic, 12))
    assert static.stats() == dynamic.stats()


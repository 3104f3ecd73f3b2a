"""A cache that already answered a prompt, handed a new one, says so once (`hf_asymkv.core.reuse`); a prefill in
chunks, decoding, assisted decoding, a crop or reset, and a fresh cache per prompt stay silent."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import FIRST_PLAIN_TOKEN, VOCAB

from hf_asymkv import AsymKVCache, cache_kwargs
from hf_asymkv.core.reuse import CacheReuseWarning

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.releases]


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, prompt, cache, **kwargs) -> tuple[torch.Tensor, list]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=4, do_sample=False, **kwargs)
    return out, [w for w in caught if issubclass(w.category, CacheReuseWarning)]


def test_a_second_prompt_on_a_used_cache_is_warned_once(llama):
    cache = AsymKVCache(llama.config)
    assert _generate(llama, _prompt(20, 0), cache)[1] == []
    _, caught = _generate(llama, _prompt(40, 1), cache)
    assert len(caught) == 1
    assert "already holds 23 tokens from earlier decoding" in str(caught[0].message)
    assert _generate(llama, _prompt(50, 2), cache)[1] == []  # once per cache


@pytest.mark.parametrize("between", ["reset", "crop", "fresh-cache"])
def test_reset_crop_or_a_fresh_cache_is_silent(llama, between):
    cache = AsymKVCache(llama.config)
    out, _ = _generate(llama, _prompt(20, 0), cache)
    if between == "reset":
        cache.reset()
    elif between == "crop":
        cache.crop(-3)  # back to the 20 prompt tokens
    else:
        cache = AsymKVCache(llama.config)
    prompt = torch.cat([out[:, :20], _prompt(10, 3)], dim=1) if between == "crop" else _prompt(30, 3)
    assert _generate(llama, prompt, cache)[1] == []


def test_a_prefill_in_chunks_then_decoding_is_silent(llama):
    cache = AsymKVCache(llama.config)
    prompt = _prompt(48, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheReuseWarning)
        for start in range(0, 48, 16):  # chunked prefill: multi-token updates in a row
            llama(input_ids=prompt[:, start : start + 16], **cache_kwargs(cache), use_cache=True)
        for _ in range(3):
            llama(input_ids=prompt[:, -1:], **cache_kwargs(cache), use_cache=True)


def test_assisted_decoding_is_silent(llama, llama_assistant):
    """Draft verification feeds several tokens after decode steps, under activate_past_recording."""
    assert _generate(llama, _prompt(20, 0), AsymKVCache(llama.config), assistant_model=llama_assistant)[1] == []


def test_an_empty_update_after_decoding_is_silent(llama):
    """A 0-token update (a read of the layer, as tests and tools do) brings no new prompt: no warning (it warned
    before, from tests/core/test_cache_overrides.py, and escaped the suite)."""
    cache = AsymKVCache(llama.config)
    _generate(llama, _prompt(20, 0), cache)
    empty = torch.zeros(1, llama.config.num_key_value_heads, 0, llama.config.head_dim)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheReuseWarning)
        for i in range(len(cache.layers)):
            cache.update(empty, empty, i)

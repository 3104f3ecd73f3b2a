"""Prompt caches on disk (hf_asymkv.core.prompt_cache): a loaded cache continues exactly as the saved one.

Every preset on the three tiny architectures (Llama; Gemma3 with sliding-window layers kept as transformers' own;
Gemma4 with KV-sharing layers that hold nothing), dynamic and static: the same greedy tokens and logits (bit for bit)
as continuing the cache that was saved, the same ``memory_footprint()``, and crop, reset and the fused attention as
before. The refusals are in test_prompt_cache_refusals.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import FIRST_PLAIN_TOKEN, VOCAB

from hf_asymkv import PRESETS, AsymKVCache, cache_kwargs, register_attention
from hf_asymkv.core.attention import ATTN_IMPLEMENTATION
from hf_asymkv.core.prompt_cache import read_prompt_cache_metadata

PREFIX = 300  # > 4 sinks + a 128-token block + a 64-token window: every preset stores quantized blocks
QUESTION = 10
NEW = 6
STATIC_LEN = PREFIX + QUESTION + NEW + 8
ARCHS = ("llama", "hybrid", "shared_kv")
KINDS = ("dynamic", "static")


@pytest.fixture(scope="module")
def ids() -> torch.LongTensor:
    """``[1, PREFIX + QUESTION]``: the document, then a question."""
    g = torch.Generator().manual_seed(53)
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (1, PREFIX + QUESTION), generator=g)


def prefilled(model, ids: torch.Tensor, preset: str = "balanced", kind: str = "dynamic", **settings) -> AsymKVCache:
    cache = AsymKVCache.from_preset(preset, model.config, max_cache_len=STATIC_LEN if kind == "static" else None,
                                    **settings)
    with torch.no_grad():
        model(ids[:, :PREFIX], **cache_kwargs(cache))
    return cache


def round_trip(model, cache: AsymKVCache, ids: torch.Tensor, tmp_path) -> AsymKVCache:
    """Save ``cache`` (with the ids it holds) and load it back for ``ids`` (those ids and the question)."""
    path = cache.save(tmp_path / "prompt.safetensors", input_ids=ids[:, : cache.get_seq_length()])
    return AsymKVCache.load(path, model.config, input_ids=ids)


def greedy_with_logits(model, ids: torch.Tensor, cache, n: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate`` of ``n`` tokens after ``ids`` with ``cache``: ``(sequences, logits [n, B, vocab])``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, **cache_kwargs(cache), max_new_tokens=n, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def assert_same_continuation(model, saved: AsymKVCache, loaded: AsymKVCache, ids: torch.Tensor, **kwargs) -> None:
    assert loaded.memory_footprint() == saved.memory_footprint()
    tokens, logits = greedy_with_logits(model, ids, saved, NEW, **kwargs)
    tokens_loaded, logits_loaded = greedy_with_logits(model, ids, loaded, NEW, **kwargs)
    assert torch.equal(tokens_loaded, tokens)
    assert torch.equal(logits_loaded, logits)
    assert loaded.memory_footprint() == saved.memory_footprint()
    assert loaded.stats() == saved.stats()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("arch", ARCHS)
def test_loaded_cache_continues_as_the_saved_one(request, arch, preset, kind, ids, tmp_path, single_thread):
    model = request.getfixturevalue(arch)
    saved = prefilled(model, ids, preset, kind)
    assert saved.stats()["blocks_quantized"] > 0
    loaded = round_trip(model, saved, ids, tmp_path)
    assert loaded.cache_config == saved.cache_config and loaded.max_cache_len == saved.max_cache_len
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in saved.layers]
    assert_same_continuation(model, saved, loaded, ids)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preset", ["balanced", "compact"])
@pytest.mark.parametrize("arch", ["llama", "hybrid"])
def test_fused_attention_reads_the_loaded_codes(request, arch, preset, kind, ids, tmp_path, single_thread):
    register_attention()
    fused = copy.deepcopy(request.getfixturevalue(arch))
    fused.set_attn_implementation(ATTN_IMPLEMENTATION)
    saved = prefilled(fused, ids, preset, kind)
    loaded = round_trip(fused, saved, ids, tmp_path)
    assert loaded.fused_attention
    assert_same_continuation(fused, saved, loaded, ids)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "hybrid"])
def test_crop_after_loading_as_before(request, arch, kind, ids, tmp_path, single_thread):
    """A crop within the exact window (what a static cache allows), on both caches, then the same continuation. The
    hybrid's sliding-window layers crop only while recording the past (transformers' rule): recorded before the
    prefill, kept in the file."""
    model = request.getfixturevalue(arch)
    saved = AsymKVCache.from_preset("lean", model.config, max_cache_len=STATIC_LEN if kind == "static" else None)
    if arch == "hybrid":
        saved.activate_past_recording()
    with torch.no_grad():
        model(ids[:, :PREFIX], **cache_kwargs(saved))
    loaded = round_trip(model, saved, ids, tmp_path)
    for cache in (saved, loaded):
        cache.crop(-5)
    assert loaded.get_seq_length() == PREFIX - 5
    assert_same_continuation(model, saved, loaded, ids)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "hybrid"])
def test_reset_after_loading_gives_a_fresh_cache(request, arch, kind, ids, tmp_path, single_thread):
    model = request.getfixturevalue(arch)
    loaded = round_trip(model, prefilled(model, ids, "compact", kind), ids, tmp_path)
    loaded.reset()
    fresh = AsymKVCache.from_preset("compact", model.config, max_cache_len=loaded.max_cache_len)
    assert torch.equal(greedy_with_logits(model, ids, loaded, NEW)[0], greedy_with_logits(model, ids, fresh, NEW)[0])


def test_deep_crop_requantizes_as_the_saved_cache_would(llama, ids, tmp_path, single_thread):
    """A crop into quantized blocks returns a block's tokens to the window: the same on a loaded cache."""
    saved = prefilled(llama, ids, "balanced")
    loaded = round_trip(llama, saved, ids, tmp_path)
    for cache in (saved, loaded):
        cache.crop(100 - PREFIX)  # sinks 4 + 96 of the first 128-token block
    assert loaded.stats()["requantized_tokens"] == saved.stats()["requantized_tokens"] > 0
    assert_same_continuation(llama, saved, loaded, ids)


def test_left_padded_batch_keeps_its_sink_overlay(llama, padded_batch, tmp_path, single_thread):
    """Rows' own sinks inside the quantized blocks (a padded row's) and the anchors come back as stored."""
    prompt, mask = padded_batch
    saved = AsymKVCache(llama.config, key_block_size=16, residual_length=16)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate gives them: a padded row starts at 0
    with torch.no_grad():
        llama(prompt, attention_mask=mask, position_ids=positions, **cache_kwargs(saved))
    assert saved.layers[0].key_store.overlay.tokens is not None
    g = torch.Generator().manual_seed(3)
    question = torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (2, 5), generator=g)
    full, full_mask = torch.cat([prompt, question], 1), torch.cat([mask, torch.ones_like(question)], 1)
    path = saved.save(tmp_path / "batch.safetensors", input_ids=prompt)
    loaded = AsymKVCache.load(path, llama.config, input_ids=full)
    assert_same_continuation(llama, saved, loaded, full, attention_mask=full_mask)


def test_pending_tokens_and_deferral_are_kept(llama, ids, tmp_path, single_thread):
    """``keep_latest_exact``: the prefill waits exact in the window; the loaded layers keep it pending too."""
    saved = AsymKVCache(llama.config)
    for layer in saved.layers:
        layer.keep_latest_exact = True
    with torch.no_grad():
        llama(ids[:, :PREFIX], **cache_kwargs(saved))
    assert saved.memory_footprint()["pending_keys"] > 0
    loaded = round_trip(llama, saved, ids, tmp_path)
    assert all(layer.keep_latest_exact and layer.pending_tokens == PREFIX - 4 for layer in loaded.layers)
    assert_same_continuation(llama, saved, loaded, ids)


def test_a_held_update_is_settled_before_saving(llama, ids, tmp_path, single_thread):
    """A forward hook on an attention module (a kvpress press) makes the cache hold each prefill update exact until
    the next one; save quantizes the last held one, as the next update would, in memory and in the file."""
    hook = llama.model.layers[-1].self_attn.register_forward_hook(lambda *args: None)
    try:
        saved = prefilled(llama, ids)
    finally:
        hook.remove()
    assert saved.held_layer is not None and saved.memory_footprint().get("pending_keys")
    loaded = round_trip(llama, saved, ids, tmp_path)
    assert saved.held_layer is None and not saved.memory_footprint().get("pending_keys")
    assert_same_continuation(llama, saved, loaded, ids)


def test_calibrated_key_ranges_are_saved(llama, ids, tmp_path, single_thread):
    g = torch.Generator().manual_seed(8)
    ranges = {i: torch.rand(2, 16, generator=g) + 0.5 for i in range(2)}  # narrow: blocks widen their scale
    saved = prefilled(llama, ids, key_absmax=ranges)
    assert saved.stats()["key_widened_blocks"] > 0
    loaded = round_trip(llama, saved, ids, tmp_path)
    assert all(torch.equal(a.key_absmax, b.key_absmax) for a, b in zip(saved.layers, loaded.layers))
    assert_same_continuation(llama, saved, loaded, ids)


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_key_codes_round_trip(llama, ids, kind, tmp_path, single_thread):
    saved = prefilled(llama, ids, kind=kind, key_format="fp8_e4m3")
    loaded = round_trip(llama, saved, ids, tmp_path)
    assert_same_continuation(llama, saved, loaded, ids)


def test_widened_value_metadata_is_restored(llama, tmp_path, single_thread):
    """Values beyond float16's range switch a store's scales and zeros to float32 (QuantizedBlocks.fit)."""
    cache = AsymKVCache(llama.config, key_block_size=8, residual_length=8, sink_tokens=0)
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g) * 1e6
    cache.update(keys, values, 0)
    assert cache.layers[0].value_store.spec.scale_dtype == torch.float32
    loaded = AsymKVCache.load(cache.save(tmp_path / "wide.safetensors"), llama.config)
    assert loaded.layers[0].value_store.spec.scale_dtype == torch.float32
    assert torch.equal(loaded.layers[0].values, cache.layers[0].values)
    step = torch.randn(1, 2, 1, 16, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(cache.update(step, step, 0), loaded.update(step, step, 0)))


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_cache_round_trips(llama, ids, kind, tmp_path, single_thread):
    saved = AsymKVCache(llama.config, max_cache_len=STATIC_LEN if kind == "static" else None)
    loaded = AsymKVCache.load(saved.save(tmp_path / "empty.safetensors"), llama.config)
    assert loaded.get_seq_length() == 0 and loaded.memory_footprint()["total"] == 0
    assert torch.equal(greedy_with_logits(llama, ids, loaded, NEW)[0], greedy_with_logits(llama, ids, saved, NEW)[0])


def test_file_holds_the_footprint_and_the_metadata(hybrid, ids, tmp_path, single_thread):
    """The metadata says what a reader needs without reading the tensors."""
    saved = prefilled(hybrid, ids)
    path = saved.save(tmp_path / "doc.safetensors", input_ids=ids[:, :PREFIX], metadata={"source": "doc.txt"})
    meta = read_prompt_cache_metadata(path)
    assert (meta["tokens"], meta["batch_size"], meta["max_cache_len"]) == (PREFIX, 1, None)
    assert meta["user"] == {"source": "doc.txt"} and meta["cache_config"] == saved.cache_config.to_dict()
    assert [r["kind"] for r in meta["layers"]] == ["transformers", "dynamic", "transformers", "dynamic"]


@pytest.mark.parametrize("kind", KINDS)
def test_file_tensors_are_the_bytes_held(llama, ids, kind, tmp_path, single_thread):
    """The file's tensor bytes are the footprint's, less unused capacity (none after a one-forward prefill of a
    dynamic cache; a static cache's unfilled slots) and a static cache's bookkeeping (its 0-d length and counters go
    into the metadata)."""
    saved = prefilled(llama, ids, kind=kind)
    path = saved.save(tmp_path / "doc.safetensors")
    footprint = saved.memory_footprint()
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    held = footprint["total"] - footprint["unused_capacity"] - footprint.get("bookkeeping", 0)
    assert path.stat().st_size - header == held
    assert kind == "static" or footprint["unused_capacity"] == 0


def test_save_gives_a_sliding_window_view_its_own_copy(hybrid, ids, tmp_path, single_thread):
    """After one long forward a transformers sliding-window layer's window is a view into that forward's K/V: save
    keeps a copy of the window instead (same values), so memory holds what the file holds."""
    saved = prefilled(hybrid, ids)
    window = saved.layers[0].keys
    assert window.untyped_storage().nbytes() > window.nbytes
    before = saved.memory_footprint()["full_precision_layers"]
    round_trip(hybrid, saved, ids, tmp_path)
    assert torch.equal(saved.layers[0].keys, window)
    assert saved.memory_footprint()["full_precision_layers"] < before


def test_batch_of_three_round_trips(llama, batch3, tmp_path, single_thread):
    saved = AsymKVCache(llama.config, key_block_size=16, residual_length=16)
    with torch.no_grad():
        llama(batch3[:, :48], **cache_kwargs(saved))
    loaded = AsymKVCache.load(saved.save(tmp_path / "b3.safetensors", input_ids=batch3[:, :48]), llama.config,
                              input_ids=batch3)
    assert_same_continuation(llama, saved, loaded, batch3)


def test_continuing_a_loaded_cache_is_not_taken_for_a_new_prompt(llama, ids, tmp_path, single_thread):
    """The question's multi-token update on a loaded cache continues the saved prefix on purpose: no
    CacheReuseWarning (hf_asymkv.core.reuse), as on the cache that was saved."""
    loaded = round_trip(llama, prefilled(llama, ids), ids, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            llama(ids[:, PREFIX:], **cache_kwargs(loaded))
    assert loaded.get_seq_length() == PREFIX + QUESTION


def test_a_loaded_cache_does_not_depend_on_the_file(llama, ids, tmp_path, single_thread):
    """The tensors are read into the cache's own memory: the file rewritten in place after the load (``cp`` over it)
    changes nothing in the loaded cache."""
    saved = prefilled(llama, ids)
    loaded = round_trip(llama, saved, ids, tmp_path)
    path = tmp_path / "prompt.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * (size - size // 2))
    assert_same_continuation(llama, saved, loaded, ids)

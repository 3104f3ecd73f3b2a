"""Prompt-cache files that must not load, and saves that must not leave anything half-written.

Each refusal is a ``ValueError`` whose message names the file and the problem: a file that is not safetensors or is
truncated, not a prompt cache, another format version, another model, settings other than those expected, token ids
that do not continue the saved ones, missing, unexpected or reshaped tensors, lengths that do not add up.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import FIRST_PLAIN_TOKEN, VOCAB
from safetensors import safe_open
from safetensors.torch import save_file

import hf_asymkv.core.prompt_cache as prompt_cache
from hf_asymkv import PRESETS, AsymKVCache, cache_kwargs

PREFIX = 200


@pytest.fixture(scope="module")
def ids() -> torch.LongTensor:
    g = torch.Generator().manual_seed(56)
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (1, PREFIX + 8), generator=g)


@pytest.fixture(scope="module")
def saved_file(llama, ids, tmp_path_factory):
    """A balanced cache of the tiny Llama holding ``ids[:, :PREFIX]`` (blocks, sinks, window), saved with its ids."""
    cache = AsymKVCache(llama.config)
    with torch.no_grad():
        llama(ids[:, :PREFIX], **cache_kwargs(cache))
    return cache.save(tmp_path_factory.mktemp("prompt_cache") / "doc.safetensors", input_ids=ids[:, :PREFIX])


def rewrite(path, edit) -> None:
    """Read ``path``'s tensors and metadata, let ``edit(tensors, metadata)`` change them, write the file back."""
    with safe_open(str(path), "pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors, meta)
    save_file(tensors, str(path), metadata=meta)


def edit_layer_record(field: str, value):
    def edit(tensors, meta):
        layers = json.loads(meta["layers"])
        layers[1][field] = value
        meta["layers"] = json.dumps(layers)
    return edit


def edit_meta(key: str, value: str):
    def edit(tensors, meta):
        meta[key] = value
    return edit


def set_tensor(name: str, make):
    def edit(tensors, meta):
        tensors[name] = make(tensors.get(name))
    return edit


def bump_version(tensors, meta):
    meta["format_version"] = "2"


def drop_layer(tensors, meta):
    meta["layers"] = json.dumps(json.loads(meta["layers"])[:1])


# (id, edit of a good file, the message it gets)
ALTERED = [
    ("another-format-version", bump_version, "format_version '2' is not supported"),
    ("not-a-prompt-cache", edit_meta("format", "hf_asymkv.kv_scales"), "not a prompt-cache file"),
    ("metadata-not-json", edit_meta("layers", "[{"), "metadata 'layers' is not a JSON list"),
    ("bad-token-count", edit_meta("tokens", "-3"), "metadata 'tokens' must be an integer"),
    ("token-count-differs", edit_meta("tokens", str(PREFIX + 1)), "the layers hold 200 tokens, the metadata says 201"),
    ("unknown-setting", edit_meta("cache_config", json.dumps({"config_version": 5, "key_bits": 3})),
     r"unknown AsymKVCache settings \['key_bits'\]"),
    ("layer-missing", drop_layer, "the file holds 1 layers, the model's cache 2"),
    ("missing-tensor", lambda t, m: t.pop("layers.1.key.codes"), "tensor 'layers.1.key.codes' is missing"),
    ("unexpected-tensor", set_tensor("layers.1.extra", lambda t: torch.zeros(3)),
     r"unexpected tensors \['layers.1.extra'\]"),
    ("wrong-shape", set_tensor("layers.1.key.codes", lambda t: t[:, :, :64].contiguous()), r"expected int8 \[1, 2, 128, 16\]"),
    ("wrong-dtype", set_tensor("layers.1.value.scales", lambda t: t.float()), "is float32 .* expected float16"),
    ("wrong-heads", set_tensor("layers.0.key.window", lambda t: t.repeat(1, 2, 1, 1)), r"expected float32 \[1, 2, "),
    ("lengths-do-not-add-up", edit_layer_record("cumulative_length", PREFIX + 1), "do not add up"),
    ("pending-beyond-window", edit_layer_record("pending_tokens", 500), "pending tokens, more than"),
    ("another-layer-kind", edit_layer_record("kind", "static"), "holds a 'static' layer, the cache builds a 'dynamic'"),
    ("bad-record-field", edit_layer_record("record_past", "yes"), "'record_past' must be true or false"),
]


@pytest.mark.parametrize("edit, message", [a[1:] for a in ALTERED], ids=[a[0] for a in ALTERED])
def test_an_altered_file_is_refused(llama, saved_file, tmp_path, edit, message):
    path = tmp_path / "altered.safetensors"
    shutil.copy(saved_file, path)
    rewrite(path, edit)
    with pytest.raises(ValueError, match=message) as info:
        AsymKVCache.load(path, llama.config)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("cut", [1, 4096], ids=["last-byte", "4k"])
def test_a_truncated_file_is_refused(llama, saved_file, tmp_path, cut):
    path = tmp_path / "truncated.safetensors"
    path.write_bytes(saved_file.read_bytes()[:-cut])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        AsymKVCache.load(path, llama.config)


def test_a_foreign_file_is_refused(llama, tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("a shopping list, not a cache\n")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        AsymKVCache.load(path, llama.config)


def test_a_safetensors_file_without_our_metadata_is_refused(llama, tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match=r"not an hf_asymkv prompt-cache file: metadata lacks \['format'"):
        AsymKVCache.load(path, llama.config)


def test_a_missing_file_is_named(llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        AsymKVCache.load(tmp_path / "nowhere.safetensors", llama.config)


def test_another_models_file_is_refused(hybrid, saved_file):
    with pytest.raises(ValueError, match="saved for another model: the fingerprint differs on"):
        AsymKVCache.load(saved_file, hybrid.config)


def test_settings_other_than_expected_are_refused(llama, saved_file):
    AsymKVCache.load(saved_file, llama.config, cache_config=PRESETS["balanced"])  # group sizes left to the model
    with pytest.raises(ValueError, match="not the expected cache_config: key_format='int8' in the file, 'int3' expected"):
        AsymKVCache.load(saved_file, llama.config, cache_config=PRESETS["tight"])


def test_token_ids_that_do_not_continue_the_file_are_refused(llama, saved_file, ids):
    AsymKVCache.load(saved_file, llama.config, input_ids=ids)  # the saved prompt and a question: accepted
    other = ids.clone()
    other[0, 7] = other[0, 7] % (VOCAB - 1) + 1
    with pytest.raises(ValueError, match="input_ids do not continue this prompt cache"):
        AsymKVCache.load(saved_file, llama.config, input_ids=other)


@pytest.mark.parametrize("input_ids, message", [
    (torch.ones(1, PREFIX - 1, dtype=torch.long), "input_ids hold 199 tokens per row, the cache 200"),
    (torch.ones(2, PREFIX, dtype=torch.long), "input_ids have 2 rows, the file holds a batch of 1"),
    (torch.ones(1, PREFIX), "must be a .* integer tensor, got a 2-d torch.float32 tensor"),
], ids=["too-short", "other-batch", "not-ids"])
def test_input_ids_that_cannot_be_checked_are_refused(llama, saved_file, input_ids, message):
    with pytest.raises(ValueError, match=message):
        AsymKVCache.load(saved_file, llama.config, input_ids=input_ids)


def test_input_ids_against_a_file_saved_without_them_are_refused(llama, ids, tmp_path):
    path = AsymKVCache(llama.config).save(tmp_path / "no_ids.safetensors")
    with pytest.raises(ValueError, match="saved without input_ids"):
        AsymKVCache.load(path, llama.config, input_ids=ids)


@pytest.mark.parametrize("kwargs, message", [
    ({"input_ids": torch.ones(1, 5, dtype=torch.long)}, r"input_ids are \[1, 5\], the cache holds \[0, 0\]"),
    ({"metadata": {"source": 3}}, "metadata must map strings to strings"),
], ids=["ids-of-another-length", "metadata-not-strings"])
def test_a_refused_save_writes_nothing(llama, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsymKVCache(llama.config).save(tmp_path / "x.safetensors", **kwargs)
    assert not any(tmp_path.iterdir())


def test_a_failed_write_leaves_nothing_half_written(llama, saved_file, tmp_path, monkeypatch):
    """The write fails half-way: the earlier file at the path is untouched and no temporary file is left."""
    path = tmp_path / "doc.safetensors"
    shutil.copy(saved_file, path)
    before = path.read_bytes()

    def half_then_fail(tensors, tmp, metadata):
        with open(tmp, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prompt_cache, "save_file", half_then_fail)
    with pytest.raises(OSError, match="doc.safetensors"):
        AsymKVCache(llama.config).save(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["doc.safetensors"]


def test_a_layer_holding_state_the_format_does_not_carry_is_refused(hybrid, tmp_path):
    """A transformers layer with tensors beyond its K/V (recurrent states, indexer keys) is not saved half."""
    cache = AsymKVCache(hybrid.config)
    cache.layers[0].conv_states = torch.ones(2)
    with pytest.raises(ValueError, match=r"layer 0: DynamicSlidingWindowLayer holds state .*\(\['conv_states'\]\)"):
        cache.save(tmp_path / "x.safetensors")
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def static_file(llama, ids, tmp_path_factory):
    cache = AsymKVCache(llama.config, max_cache_len=600)  # 4 block slots, 1 filled
    with torch.no_grad():
        llama(ids[:, :PREFIX], **cache_kwargs(cache))
    return cache.save(tmp_path_factory.mktemp("prompt_cache") / "static.safetensors")


STATIC_ALTERED = [
    ("more-blocks-than-slots", edit_layer_record("blocks_stored", 9), "9 blocks stored, the layer has 4 slots"),
    ("beyond-max-cache-len", edit_layer_record("length", 601), "601 tokens held, max_cache_len is 600"),
    ("window-overflow", edit_layer_record("blocks_stored", 0), "196 tokens after the last block, the window holds 192"),
    ("counters", edit_layer_record("counts", [0, 1]), "'counts' must be 5 ints"),
]


@pytest.mark.parametrize("edit, message", [a[1:] for a in STATIC_ALTERED], ids=[a[0] for a in STATIC_ALTERED])
def test_an_altered_static_file_is_refused(llama, static_file, tmp_path, edit, message):
    path = tmp_path / "altered.safetensors"
    shutil.copy(static_file, path)
    rewrite(path, edit)
    with pytest.raises(ValueError, match=message):
        AsymKVCache.load(path, llama.config)


def test_a_transformers_layer_of_another_class_is_refused(hybrid, ids, tmp_path):
    cache = AsymKVCache(hybrid.config)
    with torch.no_grad():
        hybrid(ids[:, :40], **cache_kwargs(cache))
    path = cache.save(tmp_path / "hybrid.safetensors")

    def edit(tensors, meta):
        layers = json.loads(meta["layers"])
        layers[0]["class"] = "DynamicLayer"
        meta["layers"] = json.dumps(layers)

    rewrite(path, edit)
    with pytest.raises(ValueError, match="layer 0: the file holds transformers' 'DynamicLayer' layer, the cache builds "
                                         "a 'DynamicSlidingWindowLayer'"):
        AsymKVCache.load(path, hybrid.config)

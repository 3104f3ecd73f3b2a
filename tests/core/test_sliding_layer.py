"""Quantized sliding-window layers (``AsymKVConfig(quantize_sliding=True)``, :mod:`hf_asymkv.core.sliding_layer`).

The reference for "drops the right blocks and masks the right tokens" is the same cache whose sliding layers drop
nothing (their ``sliding_window`` attribute set beyond the context): it stores the same codes, and the model's own
sliding mask hides the tokens the window has left behind. Both must give the same logits at every step.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_asymkv import AsymKVCache, AsymKVConfig, cache_kwargs
from hf_asymkv.core.sliding_layer import SlidingAsymKVLayer
from hf_asymkv.core.store import QuantizedBlocks

# One thread: with more, SDPA splits the two caches' different key lengths differently, and a last-bit difference
# in a prefill chunk's output can flip a later token's 2-bit value code (a real but irrelevant divergence).
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.releases]  # transformers builds the sliding mask

SETTINGS = dict(key_block_size=4, residual_length=4, sink_tokens=2, quantize_sliding=True)


def sliding_layers(cache) -> list[SlidingAsymKVLayer]:
    return [layer for layer in cache.layers if isinstance(layer, SlidingAsymKVLayer)]


def step_logits(model, cache, ids: torch.Tensor, chunk: int, new_tokens: int) -> list[torch.Tensor]:
    """The prompt ``ids`` ``[1, T]`` in forwards of ``chunk`` tokens, then ``new_tokens`` greedy steps: each
    forward's last logits ``[vocab]``."""
    out = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            out.append(model(ids[:, start:start + chunk], **cache_kwargs(cache)).logits[0, -1])
        for _ in range(new_tokens):
            token = out[-1].argmax().view(1, 1)
            out.append(model(token, **cache_kwargs(cache)).logits[0, -1])
    return out


@pytest.mark.parametrize("preset_bits", [dict(), dict(key_format="int4", key_symmetric=False, value_bits=2)],
                         ids=["int8-int4", "int4-int2"])
@pytest.mark.parametrize("chunk", [64, 7])
def test_dropping_blocks_equals_keeping_them_under_the_sliding_mask(hybrid, prompt, chunk, preset_bits):
    settings = {**SETTINGS, **preset_bits}
    dropping = AsymKVCache(hybrid.config, **settings)
    keeping = AsymKVCache(hybrid.config, **settings)
    for layer in sliding_layers(keeping):
        layer.sliding_window = 10**9  # drops nothing; the model's mask still hides what its window left behind
    ids = torch.cat([prompt, prompt], dim=1)  # 128 tokens: eight windows of 16
    ours = step_logits(hybrid, dropping, ids, chunk, new_tokens=24)
    reference = step_logits(hybrid, keeping, ids, chunk, new_tokens=24)
    for step, (a, b) in enumerate(zip(ours, reference)):
        torch.testing.assert_close(a, b, msg=lambda m, step=step: f"forward {step}: {m}")
    window = hybrid.config.sliding_window
    for layer in sliding_layers(dropping):
        held = layer.cumulative_length - layer.dropped
        assert layer.dropped > 0 and layer.dropped % layer.block_size == 0
        # at most: the window, the block it cuts, and the exact tail waiting to fill a block
        assert held <= window - 1 + 2 * layer.block_size + layer.residual_length + chunk
        assert layer.get_mask_sizes(1) == (held + 1, layer.dropped)
    assert all(layer.dropped == 0 for layer in sliding_layers(keeping))


def test_sliding_layers_are_quantized_only_when_asked(hybrid, prompt):
    exact = AsymKVCache(hybrid.config, **{**SETTINGS, "quantize_sliding": False})
    quantized = AsymKVCache(hybrid.config, **SETTINGS)
    assert not sliding_layers(exact)
    assert [i for i, layer in enumerate(quantized.layers) if isinstance(layer, SlidingAsymKVLayer)] == [0, 2]
    assert all(layer.sink_tokens == 0 for layer in sliding_layers(quantized))  # the full layers keep theirs
    assert quantized.layers[1].sink_tokens == 2
    with torch.no_grad():
        a = hybrid(prompt, **cache_kwargs(exact)).logits
        b = hybrid(prompt, **cache_kwargs(quantized)).logits
        torch.testing.assert_close(a, b)  # a prefill attends the exact K/V it stores
        step = prompt[:, -1:]
        a, b = (hybrid(step, **cache_kwargs(c)).logits for c in (exact, quantized))
    assert not torch.equal(a, b)  # the next step reads the sliding layers' codes
    fp_exact, fp_quantized = exact.memory_footprint(), quantized.memory_footprint()
    # the same full-precision reference (a sliding layer holds its last window - 1 tokens), fewer bytes held
    assert fp_quantized["bf16_equivalent"] == fp_exact["bf16_equivalent"]
    assert fp_exact["full_precision_layers"] > 0 and not fp_quantized.get("full_precision_layers")
    assert "sliding layers quantized" in repr(quantized)


def test_a_sliding_layer_holds_bounded_bytes_at_any_length(hybrid, prompt):
    cache = AsymKVCache(hybrid.config, **SETTINGS)

    def sliding_bytes() -> list[int]:
        return [sum(v for k, v in layer.memory_footprint().items() if k != "unused_capacity")
                for layer in sliding_layers(cache)]

    sizes = []
    with torch.no_grad():
        for _ in range(8):  # 8 x 64 tokens: 32 windows
            hybrid(prompt, **cache_kwargs(cache))
            sizes.append(sliding_bytes())
    assert sizes[2:] == [sizes[2]] * 6  # the same blocks, window and capacity from the third forward on


def test_generate_with_quantized_sliding_layers(hybrid, prompt):
    cache = AsymKVCache(hybrid.config, **SETTINGS)
    out = hybrid.generate(prompt, **cache_kwargs(cache), max_new_tokens=40, do_sample=False)
    assert out.shape[1] == prompt.shape[1] + 40
    assert cache.get_seq_length() == prompt.shape[1] + 39
    assert all(layer.dropped >= prompt.shape[1] + 39 - hybrid.config.sliding_window - 2 * layer.block_size
               - layer.residual_length for layer in sliding_layers(cache))


def test_a_crop_that_needs_a_dropped_token_is_refused_and_changes_nothing(hybrid, prompt):
    cache = AsymKVCache(hybrid.config, **SETTINGS)
    with torch.no_grad():
        hybrid(prompt, **cache_kwargs(cache))
    layer = sliding_layers(cache)[0]
    before = (layer.cumulative_length, layer.dropped, layer.key_store.blocks.length, layer.key_store.window.length)
    deepest = layer.dropped + hybrid.config.sliding_window - 1  # the shortest length whose next query sees no gap
    with pytest.raises(ValueError, match="have been dropped"):
        layer.crop(deepest - 1 - layer.cumulative_length)
    assert (layer.cumulative_length, layer.dropped, layer.key_store.blocks.length,
            layer.key_store.window.length) == before
    layer.crop(deepest - layer.cumulative_length)
    assert layer.cumulative_length == deepest and layer.dropped == before[1]


def test_a_crop_with_past_recording_rolls_back_exactly(hybrid, prompt):
    """Assisted decoding's pattern: record the past, feed candidates, crop the rejected ones; the logits after the
    crop equal those of a cache that never saw the rejected tokens."""
    ids = torch.cat([prompt, prompt], dim=1)
    plain, recorded = (AsymKVCache(hybrid.config, **SETTINGS) for _ in range(2))
    with torch.no_grad():
        hybrid(ids[:, :100], **cache_kwargs(plain))
        hybrid(ids[:, :100], **cache_kwargs(recorded))
        recorded.activate_past_recording()
        hybrid(ids[:, 100:110], **cache_kwargs(recorded))  # ten candidates, of which three are accepted
        recorded.crop(-7)  # (transformers >= 5.14: a negative count of tokens to remove)
        hybrid(ids[:, 100:103], **cache_kwargs(plain))
        a = hybrid(ids[:, 103:104], **cache_kwargs(plain)).logits
        b = hybrid(ids[:, 103:104], **cache_kwargs(recorded)).logits
    torch.testing.assert_close(a, b)


def test_an_interrupted_drop_leaves_the_layer_as_it_was(hybrid, prompt, monkeypatch):
    cache = AsymKVCache(hybrid.config, **SETTINGS)
    with torch.no_grad():
        hybrid(prompt[:, :40], **cache_kwargs(cache))
    layer = sliding_layers(cache)[0]
    state = (layer.cumulative_length, layer.dropped, layer.key_store.blocks.length, layer.value_store.blocks.length)
    calls = []
    real = QuantizedBlocks.drop_front

    def failing(self, n):  # the keys' blocks are dropped, then the values' raise
        calls.append(n)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(self, n)

    monkeypatch.setattr(QuantizedBlocks, "drop_front", failing)
    b, h, _, d = layer.key_store.window.live.shape
    k, v = torch.randn(2, b, h, 8, d).unbind(0)
    with pytest.raises(KeyboardInterrupt):
        layer.update(k, v)
    assert len(calls) == 2
    assert (layer.cumulative_length, layer.dropped, layer.key_store.blocks.length,
            layer.value_store.blocks.length) == state
    monkeypatch.setattr(QuantizedBlocks, "drop_front", real)
    layer.update(k, v)
    assert layer.key_store.blocks.length == layer.value_store.blocks.length


def test_saved_and_loaded_it_continues_exactly(hybrid, prompt, tmp_path):
    ids = torch.cat([prompt, prompt], dim=1)
    cache = AsymKVCache(hybrid.config, **SETTINGS)
    with torch.no_grad():
        hybrid(ids[:, :100], **cache_kwargs(cache))
    assert all(layer.dropped for layer in sliding_layers(cache))
    path = tmp_path / "doc.safetensors"
    cache.save(path, input_ids=ids[:, :100])
    loaded = AsymKVCache.load(path, hybrid.config, input_ids=ids)
    assert [layer.dropped for layer in sliding_layers(loaded)] == [layer.dropped for layer in sliding_layers(cache)]
    assert loaded.memory_footprint() == cache.memory_footprint()
    a = hybrid.generate(ids, **cache_kwargs(cache), max_new_tokens=12, do_sample=False)
    b = hybrid.generate(ids, **cache_kwargs(loaded), max_new_tokens=12, do_sample=False)
    assert torch.equal(a, b)


def test_refusals(hybrid):
    with pytest.raises(ValueError, match="needs a dynamic cache"):
        AsymKVCache(hybrid.config, max_cache_len=64, **SETTINGS)
    with pytest.raises(ValueError, match="quantize_sliding must be True or False"):
        AsymKVConfig(quantize_sliding=1)
    layer_config = AsymKVConfig(key_block_size=4).resolved([32]).layer_config()
    with pytest.raises(ValueError, match="keeps no sinks"):
        SlidingAsymKVLayer(layer_config, 16)
    no_sinks = AsymKVConfig(key_block_size=4, sink_tokens=0).resolved([32]).layer_config()
    for window in (0, True, 16.0):
        with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
            SlidingAsymKVLayer(no_sinks, window)
    layer = SlidingAsymKVLayer(no_sinks, 16)
    k = torch.randn(1, 1, 8, 32)
    with pytest.raises(ValueError, match="pruned K/V"):
        layer.replace_tokens(k, k)


def _with_layer_record(path, index: int, **fields) -> None:
    """Rewrite the prompt-cache file ``path`` with fields of layer ``index``'s record changed."""
    with safe_open(str(path), "pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    layers = json.loads(meta["layers"])
    layers[index].update(fields)
    meta["layers"] = json.dumps(layers)
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("layer, fields, message", [
    (0, dict(dropped=98), "98 dropped tokens, not whole blocks of 4"),
    (0, dict(), r"dropped \d+ \+ sinks 0 \+ quantized \d+ \+ window \d+ tokens do not add up"),
    (1, dict(dropped=4), "4 dropped tokens recorded for a layer that keeps every token"),
    (0, dict(dropped=-4), "'dropped' must be an int >= 0"),
], ids=["partial-block", "does-not-add-up", "full-layer", "negative"])
def test_a_file_whose_dropped_tokens_do_not_fit_is_refused(hybrid, prompt, tmp_path, layer, fields, message):
    cache = AsymKVCache(hybrid.config, **SETTINGS)
    with torch.no_grad():
        hybrid(prompt, **cache_kwargs(cache))
    path = cache.save(tmp_path / "doc.safetensors")
    if not fields:  # one block more than it dropped
        fields = dict(dropped=cache.layers[0].dropped + 4)
    _with_layer_record(path, layer, **fields)
    with pytest.raises(ValueError, match=message):
        AsymKVCache.load(path, hybrid.config)


def test_a_file_saved_with_quantized_sliding_layers_needs_them_at_load(hybrid, prompt, tmp_path):
    cache = AsymKVCache(hybrid.config, **SETTINGS)
    with torch.no_grad():
        hybrid(prompt, **cache_kwargs(cache))
    path = cache.save(tmp_path / "doc.safetensors")
    with pytest.raises(ValueError, match="quantize_sliding=True in the file, False expected"):
        AsymKVCache.load(path, hybrid.config, cache_config=AsymKVConfig(**{**SETTINGS, "quantize_sliding": False}))


def test_a_prefix_state_fills_the_layer_as_its_prefill_would(hybrid, prompt):
    """cache_from_prefix (the evaluations' shared prefill): from a full-precision prefill whose sliding layers kept a
    block more than their window, the same codes and tail as the cache's own prefill; from one that kept only its
    window, a refusal that says what to do."""
    from transformers import DynamicCache

    from hf_asymkv.evals.evaluate import cache_from_prefix, sliding_margin, widen_sliding

    ids = torch.cat([prompt, prompt], dim=1)
    own = AsymKVCache(hybrid.config, **SETTINGS)
    with torch.no_grad():
        hybrid(ids, **cache_kwargs(own))
    fresh = AsymKVCache(hybrid.config, **SETTINGS)
    wide = widen_sliding(DynamicCache(config=hybrid.config), sliding_margin([fresh]))
    narrow = DynamicCache(config=hybrid.config)
    with torch.no_grad():
        for prefilled in (wide, narrow):
            hybrid(ids, **cache_kwargs(prefilled))
    filled = cache_from_prefix(fresh, wide)
    for a, b in zip(sliding_layers(own), sliding_layers(filled)):
        assert (a.cumulative_length, a.dropped) == (b.cumulative_length, b.dropped)
        for name, buf in a.buffers().items():
            other = b.buffers()[name]
            assert (buf.data is None) == (other.data is None), name
            assert buf.data is None or torch.equal(buf.live, other.live), name
    with pytest.raises(ValueError, match=r"kept its last 15 of 128 tokens.*widen_sliding"):
        cache_from_prefix(AsymKVCache(hybrid.config, **SETTINGS), narrow)
    layer = sliding_layers(fresh)[0]
    with pytest.raises(ValueError, match="needs an empty layer"):
        layer.start_at(8)
    with pytest.raises(ValueError, match="multiple of the block size 4"):
        SlidingAsymKVLayer(AsymKVConfig(key_block_size=4, sink_tokens=0).resolved([32]).layer_config(), 16).start_at(6)

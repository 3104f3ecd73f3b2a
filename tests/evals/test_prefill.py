"""The shared full-precision prefill in chunks: the one-forward K/V and logits (to float32 rounding), and a sliding
layer that attends its window plus the chunk, never the whole prompt."""

from __future__ import annotations

import pytest
import torch
from conftest import FIRST_PLAIN_TOKEN, SLIDING_WINDOW, VOCAB
from helpers import tiered
from transformers import DynamicCache

from hf_asymkv.evals.prefill import prefill

pytestmark = pytest.mark.usefixtures("single_thread")

LENGTH = 200


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (1, LENGTH), generator=g)


@pytest.mark.parametrize("chunk", tiered([1, 5, 64, 199], {"inside-window", "across-window", "all-but-one"},
                                   "one token per forward, 200 forwards (the case the earlier suite ran); fast twin, "
                                   "chunks of 5, 64 and 199: tests/evals/test_prefill.py::"
                                   "test_chunked_prefill_equals_one_forward",
                                   ids=["one-token", "inside-window", "across-window", "all-but-one"]))
def test_chunked_prefill_equals_one_forward(model, ids, chunk):
    whole, chunked = DynamicCache(config=model.config), DynamicCache(config=model.config)
    expected = prefill(model, ids, whole)
    got = prefill(model, ids, chunked, chunk)
    torch.testing.assert_close(got, expected)  # float32 tolerance: products of other shapes sum in another order
    for a, b in zip(chunked.layers, whole.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


@pytest.mark.parametrize(("chunk", "longest"), [(32, SLIDING_WINDOW - 1 + 32), (None, LENGTH)],
                         ids=["chunked", "one-forward"])
def test_sliding_layers_attend_their_window_plus_the_chunk(hybrid, ids, chunk, longest):
    """The key length a sliding layer's update hands the attention (which sizes its mask): at most window - 1 + chunk
    in chunks; the whole prompt in one forward."""
    cache = DynamicCache(config=hybrid.config)
    seen: dict[int, int] = {}
    update = cache.update

    def record(keys, values, layer_idx, *args, **kwargs):
        k, v = update(keys, values, layer_idx, *args, **kwargs)
        seen[layer_idx] = max(seen.get(layer_idx, 0), k.shape[-2])
        return k, v

    cache.update = record
    prefill(hybrid, ids, cache, chunk)
    sliding = [i for i, kind in enumerate(hybrid.config.layer_types) if kind == "sliding_attention"]
    assert max(seen[i] for i in sliding) == longest
    assert all(seen[i] == LENGTH for i in range(len(seen)) if i not in sliding)


@pytest.mark.parametrize(("shape", "chunk", "message"), [((1, 0), None, "T >= 1"), ((1, 4), -1, "chunk must be")],
                         ids=["empty", "negative"])
def test_bad_prefills_are_refused(llama, shape, chunk, message):
    with pytest.raises(ValueError, match=message):
        prefill(llama, torch.full(shape, FIRST_PLAIN_TOKEN), DynamicCache(config=llama.config), chunk)


def test_attention_damage_is_the_same_after_a_chunked_shared_prefill(hybrid):
    from helpers import char_tokenizer

    from hf_asymkv.evals.attention import run_attention

    def damage(chunk):
        rows = run_attention(hybrid, char_tokenizer(), ["dynamic", "asymkv-max"], 600, samples=1, queries=16,
                             show_progress=False, shared_chunk=chunk)
        return rows[1].kl + rows[1].topk["8"]

    assert damage(100) == pytest.approx(damage(None), rel=1e-3, abs=1e-6)

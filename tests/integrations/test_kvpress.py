"""AsymKVCache under NVIDIA kvpress presses (kvpress 0.5, transformers 5.0-5.2): ``with press(model)``, ``generate``
and the ``kv-press-text-generation`` pipeline. Skipped where kvpress is not installed (the main suite's newest
transformers is past kvpress's pin); ``.ci/run`` step 4 runs this file in a venv with kvpress, with
``HF_ASYMKV_REQUIRE_KVPRESS=1``: there a kvpress that does not import fails instead of skipping."""

from __future__ import annotations

import copy
import json
import os
import warnings

import pytest
import torch

from hf_asymkv.evals.presses import KVPRESS_INSTALL, require_kvpress

REQUIRE = os.environ.get("HF_ASYMKV_REQUIRE_KVPRESS", "0")
if REQUIRE not in ("0", "1"):
    raise ValueError(f"HF_ASYMKV_REQUIRE_KVPRESS must be '0' (skip these tests without kvpress) or '1' (fail "
                     f"without it: .ci/run step 4), got {REQUIRE!r}")
# .ci/run step 4 sets it to 1, so that a venv where kvpress does not import fails there instead of skipping
kvpress = require_kvpress() if REQUIRE == "1" else pytest.importorskip(
    "kvpress", reason=f"kvpress is not installed: {KVPRESS_INSTALL} (.ci/run step 4 runs these tests)")

from transformers import DynamicCache  # noqa: E402

from hf_asymkv import AsymKVCache, register_attention  # noqa: E402
from hf_asymkv.bench.memory import cache_nbytes  # noqa: E402
from hf_asymkv.core.quant import sqnr_db  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

CONTEXT, QUESTION = 200, 8
SMALL = dict(key_block_size=16, residual_length=16)  # quantizes most of the kept context
PRESSES = {
    "knorm": lambda: kvpress.KnormPress(0.5),
    "streaming_llm": lambda: kvpress.StreamingLLMPress(0.5),
    "snapkv": lambda: kvpress.SnapKVPress(0.5),
    "expected_attention": lambda: kvpress.ExpectedAttentionPress(0.5),
    "tova": lambda: kvpress.TOVAPress(0.5),
    "adakv_head_wise": lambda: kvpress.AdaKVPress(kvpress.SnapKVPress(0.5)),
    "composed": lambda: kvpress.ComposedPress([kvpress.KnormPress(0.25), kvpress.StreamingLLMPress(0.25)]),
    "key_rerotation": lambda: kvpress.KeyRerotationPress(kvpress.KnormPress(0.5)),
    "chunk": lambda: kvpress.ChunkPress(kvpress.KnormPress(0.5), chunk_length=64),
}


def _ids(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, CONTEXT), generator=g), torch.randint(3, 256, (1, QUESTION), generator=g)


def _stored(layer) -> dict[str, torch.Tensor]:
    return {name: buf.live for name, buf in layer.buffers().items() if buf.data is not None}


@torch.no_grad()
def _pressed(model, cache, press, context: torch.Tensor):
    """The context through the model under ``press`` (as kvpress's pipeline prefills)."""
    with press(model):
        model.model(input_ids=context, past_key_values=cache)
    return cache


@torch.no_grad()
def _answer(model, cache, question: torch.Tensor, steps: int = 12) -> tuple[list[int], torch.Tensor]:
    """The question at the context's positions, then greedy steps (kvpress's pipeline's decoding)."""
    pos = torch.arange(CONTEXT, CONTEXT + QUESTION)[None]
    logits = [model(input_ids=question, past_key_values=cache, position_ids=pos).logits[0, -1]]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps):
        step = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                     position_ids=torch.tensor([[CONTEXT + QUESTION + i]]))
        logits.append(step.logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("press", list(PRESSES.values()), ids=list(PRESSES))
def test_a_press_with_balanced_and_a_wide_window_equals_the_press_on_dynamic_cache(llama, press):
    """The composition adds nothing but quantization: with nothing quantized, tokens and logits are the press's."""
    context, question = _ids()
    reference = _pressed(llama, DynamicCache(), press(), context)
    ours = _pressed(llama, AsymKVCache.from_preset("balanced", llama.config, residual_length=4096), press(), context)
    assert [ours.get_seq_length(i) for i in range(2)] == [reference.get_seq_length(i) for i in range(2)]
    tokens, logits = _answer(llama, ours, question)
    ref_tokens, ref_logits = _answer(llama, reference, question)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)


@pytest.mark.parametrize("press", ["knorm", "expected_attention", "streaming_llm", "adakv_head_wise"])
def test_generate_under_a_press_with_balanced_and_a_wide_window_equals_dynamic_cache(llama, press):
    """``with press(model): model.generate(...)``: the press prunes generate's prefill (AdaKV masks instead);
    tokens and the lengths held are the press's on a DynamicCache."""
    context, question = _ids()
    prompt = torch.cat([context, question], dim=1)

    def generate(cache) -> tuple[list[int], int]:
        with torch.no_grad(), PRESSES[press]()(llama):
            out = llama.generate(prompt, past_key_values=cache, max_new_tokens=12, min_new_tokens=12,
                                 do_sample=False, pad_token_id=0)
        return out[0, prompt.shape[1]:].tolist(), cache.get_seq_length()

    tokens, held = generate(AsymKVCache.from_preset("balanced", llama.config, residual_length=4096))
    assert (tokens, held) == generate(DynamicCache())
    unpruned = prompt.shape[1] - 1 + 12  # generate stores all but its last token
    assert held == unpruned if press == "adakv_head_wise" else held < unpruned


@torch.no_grad()
def test_a_head_wise_press_masks_keys_on_a_quantized_cache(llama):
    """AdaKV under sdpa on a cache that quantized what it kept: attention gets our dense K, which kvpress masks.
    The question's logits equal those of a DynamicCache holding that dense K/V, read after the press, under the
    same masks (on the modules); without the masks they differ (so the masking is what the comparison sees)."""
    context, question = _ids()
    ours = _pressed(llama, AsymKVCache(llama.config, key_block_size=16, residual_length=16), PRESSES["adakv_head_wise"](),
                    context)
    ours.settle()  # the last layer's pressed prefill, held for the press, is quantized now (stats() only reads)
    assert ours.stats()["tokens_quantized"] > 0
    dense = DynamicCache()
    for i, layer in enumerate(ours.layers):
        dense.update(layer.keys.clone(), layer.values.clone(), i)
    pos = torch.arange(CONTEXT, CONTEXT + QUESTION)[None]
    mine = llama(input_ids=question, past_key_values=ours, position_ids=pos).logits
    reference = llama(input_ids=question, past_key_values=copy.deepcopy(dense), position_ids=pos).logits
    assert sqnr_db(reference, mine) > 60
    masks = [layer.self_attn.masked_key_indices for layer in llama.model.layers]
    assert all(m is not None for m in masks)
    for layer in llama.model.layers:
        layer.self_attn.masked_key_indices = None
    unmasked = llama(input_ids=question, past_key_values=dense, position_ids=pos).logits
    assert sqnr_db(reference, unmasked) < 40


@pytest.mark.parametrize("press", ["knorm", "snapkv", "streaming_llm", "composed"])
def test_a_press_on_asymkv_stores_the_kept_tokens_quantized_once(llama, press):
    """Pressing on our cache stores exactly what our cache stores when handed the tokens the press keeps on a
    DynamicCache: the same codes (quantized once, from the exact prefill) and the same bytes (no dense copy left)."""
    context, _ = _ids()
    ours = _pressed(llama, AsymKVCache(llama.config, **SMALL), PRESSES[press](), context)
    pruned = _pressed(llama, DynamicCache(), PRESSES[press](), context)
    replay = AsymKVCache(llama.config, **SMALL)
    for i, layer in enumerate(pruned.layers):
        replay.update(layer.keys, layer.values, i)
    ours.settle()
    replay.settle()
    assert ours.stats()["tokens_quantized"] == replay.stats()["tokens_quantized"] > 0
    for mine, theirs in zip(ours.layers, replay.layers):
        assert _stored(mine).keys() == _stored(theirs).keys()
        assert all(torch.equal(t, _stored(theirs)[name]) for name, t in _stored(mine).items())
    assert cache_nbytes(ours) == cache_nbytes(replay) and ours.memory_footprint() == replay.memory_footprint()


def test_a_decoding_press_is_refused_once_blocks_are_stored(llama):
    context, question = _ids()
    press = kvpress.DecodingPress(base_press=kvpress.KnormPress(), compression_interval=2, target_size=64)
    cache = AsymKVCache(llama.config, **SMALL)
    with pytest.raises(ValueError, match=r"quantize those tokens a second time\. .*DecodingPress"):
        with press(llama):
            _answer(llama, _pressed(llama, cache, kvpress.KnormPress(0.0), context), question, steps=4)


def test_a_head_wise_press_with_the_fused_attention_is_refused(llama):
    """AdaKV masks keys by writing into the dense K attention gets; ``asymkv_sdpa`` hands codes: refused by name."""
    model = copy.deepcopy(llama)
    model.set_attn_implementation(register_attention())
    context, question = _ids()
    cache = _pressed(model, AsymKVCache(model.config, **SMALL), PRESSES["adakv_head_wise"](), context)
    with pytest.raises(ValueError, match=r"head-wise presses \(kvpress's AdaKVPress.*Use attn_implementation='sdpa'"):
        _answer(model, cache, question)


@pytest.fixture(scope="module")
def default_model():
    from hf_asymkv.models import load_model

    return load_model()


@pytest.mark.slow(reason="kvpress's pipeline on the default model; fast twin: "
                         "tests/integrations/test_kvpress.py::test_a_press_with_balanced_and_a_wide_window_equals_the_press_on_dynamic_cache")
@pytest.mark.parametrize("press", [lambda: kvpress.KnormPress(0.5), lambda: kvpress.AdaKVPress(kvpress.SnapKVPress(0.5))],
                         ids=["knorm", "adakv_head_wise"])
def test_the_pipeline_answers_several_questions_on_our_cache(default_model, press):
    """``kv-press-text-generation`` with ``cache=AsymKVCache(...)``: a wide window answers as DynamicCache does;
    ``compact`` runs the multi-question loop (slicing the cache back after each answer) without a reuse warning
    and ends holding the compressed context's length, as DynamicCache does."""
    from transformers import pipeline

    model, tokenizer = default_model
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    context = " ".join(f"The code for room {i} is {1000 + 37 * i}." for i in range(40))
    questions = ["What is the code for room 7?", "What is the code for room 31?"]

    def ask(cache):
        return pipe(context, questions=questions, press=press(), cache=cache, max_new_tokens=10)

    reference = DynamicCache()
    assert ask(AsymKVCache(model.config, residual_length=4096)) == ask(reference)
    compact = AsymKVCache.from_preset("compact", model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        answers = ask(compact)["answers"]
    assert len(answers) == 2 and compact.stats()["tokens_quantized"] > 0
    assert compact.get_seq_length() == reference.get_seq_length()  # the context after the press (AdaKV: all of it)


@pytest.mark.slow(reason="`eval press` on the default model; fast twin: "
                         "tests/evals/test_press_eval.py::test_the_summary_adds_bytes_per_length_exact_share_and_flips")
def test_eval_press_writes_its_table(tmp_path, default_model, monkeypatch):
    """``hf-asymkv eval press`` on one short prompt: every configuration, bytes against a bf16 DynamicCache; with
    ``--window 96`` the same configurations, named so, more bytes held exact."""
    import hf_asymkv.models as models
    from hf_asymkv.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: default_model)

    def rows(*extra: str) -> dict[str, dict]:
        out = tmp_path / str(len(extra))
        assert main(["eval", "press", "--lengths", "512", "--depths", "0.5", "--tasks", "single", "--presses",
                     "KnormPress", "--presets", "compact", "--threads", "1", "--quiet", "--out", str(out),
                     *extra]) == 0
        assert "Command: `hf-asymkv eval press" in (out / "press.md").read_text()
        return {r["run"]: r for r in json.loads((out / "press.json").read_text())["summary"]}

    own = rows()
    assert list(own) == ["full", "compact", "KnormPress", "KnormPress x compact"]
    # an fp32 model here: the press alone holds half the context in fp32, which is the whole context in bf16
    assert own["KnormPress"]["x_smaller"] == pytest.approx(2 * own["full"]["x_smaller"], rel=0.01)
    assert own["KnormPress x compact"]["x_smaller"] > 1.5 * own["KnormPress"]["x_smaller"]
    assert own["KnormPress x compact"]["lost_gained_vs_press"] is not None
    assert own["full"]["exact_share"] == 1.0 > own["KnormPress x compact"]["exact_share"] > 0
    # The window holds r + ((n - r) mod 64) of n tokens with 64-token blocks: below compact's own 32 a narrower window
    # can hold the very same tokens at a given length (here ~250 kept tokens leave 60 exact either way), while a
    # window of 96 always holds more; so the option is checked with a wider window.
    wide = rows("--window", "96")
    assert list(wide) == ["full", "compact, window 96", "KnormPress", "KnormPress x compact, window 96"]
    assert wide["KnormPress x compact, window 96"]["exact_share"] > own["KnormPress x compact"]["exact_share"]
    assert wide["KnormPress x compact, window 96"]["x_smaller"] < own["KnormPress x compact"]["x_smaller"]

"""``generate`` with ``HF_ASYMKV_ATTENTION_BACKEND=triton`` (the kernel under the interpreter) gives the tokens of
the dense reference path (decode the cache, then SDPA) in every decoding mode, on the tiny Llama."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiered

from hf_asymkv import AsymKVCache, cache_kwargs, register_attention
from hf_asymkv.core.attention import ATTN_IMPLEMENTATION
from hf_asymkv.core.presets import PRESETS
from hf_asymkv.kernels import decode
from hf_asymkv.kernels.backend import ENV_VAR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # the generate matrix lives beside the cache tests
from test_cache import MODES  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

# test_cache's small window with 64-token blocks (one kernel tile each; the kernel serves multiples of 16): the
# interpreter is slow, and every mode still reads quantized blocks for 20 steps or more
SMALL = dict(residual_length=8, key_block_size=64)
TRITON_MODES = ["greedy", "sample", "beam", "padded_batch", "assisted", "continue", "deepcopy", "batch_select"]


@pytest.fixture
def triton_calls(monkeypatch) -> list:
    """Force the Triton backend and count its calls."""
    calls, original = [], decode.launch_decode_attention
    monkeypatch.setattr(decode, "launch_decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setenv(ENV_VAR, "triton")
    return calls


@pytest.fixture(scope="module")
def fused_llama(llama):
    register_attention()
    model = copy.deepcopy(llama)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


@pytest.mark.parametrize("mode", tiered(TRITON_MODES, {"greedy", "padded_batch"}, "generate under Triton's interpreter "
                                        "(~10-30 s per mode); fast twins: greedy and the left-padded batch here, every "
                                        "mode with the torch backend: "
                                        "tests/core/test_attention.py::test_fused_generate_matrix_matches_dense"))
def test_generate_matrix_matches_dense(llama, fused_llama, llama_assistant, prompt, batch3, padded_batch, mode,
                                       triton_calls):
    ctx = {"prompt": prompt, "batch3": batch3, "padded_batch": padded_batch, "assistant": llama_assistant}
    dense = MODES[mode](llama, lambda: AsymKVCache(llama.config, **SMALL), ctx)
    got = MODES[mode](fused_llama, lambda: AsymKVCache(fused_llama.config, **SMALL), ctx)
    assert triton_calls and all(c.stats()["tokens_quantized"] > 0 for c in got.caches)
    assert torch.equal(got.sequences, dense.sequences)
    for a, b in got.must_match:
        assert torch.equal(a, b)


@pytest.mark.parametrize("preset", tiered(list(PRESETS), {"compact"}, "each preset's greedy run under Triton's "
                                          "interpreter; fast twin: "
                                          "tests/kernels/test_generate.py::test_presets_greedy_matches_dense"))
def test_presets_greedy_matches_dense(llama, fused_llama, prompt, preset, triton_calls):
    def run(model):  # 32-token blocks: the prompt leaves one quantized block for every step
        cache = AsymKVCache.from_preset(preset, model.config, residual_length=8, key_block_size=32)
        return model.generate(prompt, **cache_kwargs(cache), max_new_tokens=8, do_sample=False)

    assert torch.equal(run(fused_llama), run(llama))
    assert triton_calls


@pytest.mark.parametrize("name", ["hybrid", "shared_kv"])
def test_other_tiny_models_greedy_matches_dense(request, name, prompt, triton_calls):
    """Gemma3 (sliding-window layers stay dense and take SDPA) and Gemma4 (KV-sharing layers read another layer's
    codes, head_dim 32 on the full-attention layers)."""
    model = request.getfixturevalue(name)
    register_attention()
    fused = copy.deepcopy(model)
    fused.set_attn_implementation(ATTN_IMPLEMENTATION)

    def run(m):
        cache = AsymKVCache(m.config, residual_length=8, key_block_size=32)
        return m.generate(prompt, **cache_kwargs(cache), max_new_tokens=10, do_sample=False)

    assert torch.equal(run(fused), run(model))
    assert triton_calls


@pytest.mark.parametrize("preset", ["balanced", "compact"])
def test_head_dim_256_greedy_matches_dense(prompt, preset, triton_calls):
    """Gemma-3's head shape (head_dim 256, one KV head for 4 query heads) on a tiny random Llama: the values' two
    128-channel scale groups take the fast path's two products."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=1, vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=256, initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    register_attention()
    fused = copy.deepcopy(model)
    fused.set_attn_implementation(ATTN_IMPLEMENTATION)

    def run(m):
        cache = AsymKVCache.from_preset(preset, m.config, residual_length=8, key_block_size=32)
        return m.generate(prompt, **cache_kwargs(cache), max_new_tokens=8, do_sample=False)

    assert torch.equal(run(fused), run(model))
    assert triton_calls

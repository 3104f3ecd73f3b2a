"""The static cache compiled with inductor on CPU, two ways: through ``generate``'s own compilation (the path
transformers takes for a ``StaticCache`` on a GPU; ``_compile_all_devices`` enables it on CPU: one-token steps
compiled, the prefill eager) and as transformers' recipe for a ``StaticCache`` compiles it, ``model.forward``
itself, prefill included (a multi-token update that quantizes blocks inside the graph). Both with
``fullgraph=True`` (a graph break raises), one graph for every decode step across block flushes, no recompilation
for a new cache, and the eager static cache's and the dynamic cache's tokens.

Few and small on purpose: each compilation takes tens of seconds on CI's CPUs. The default model is compiled with its
first 2 layers (its shapes and weights, one preset): all 30 took 14.5 minutes to compile on a busy 2-core machine,
with the same result (one graph, tokens equal to eager static and dynamic for 32 steps, compact, 8-token blocks). The hybrid model is not compiled here: its sliding layers are transformers'
``StaticSlidingWindowLayer``, which recompiles at every step under ``dynamic=False`` in transformers 5.25 (a
``StaticCache`` does the same), whatever our layers do.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import FIRST_PLAIN_TOKEN
from helpers import check_whole_forward
from torch._dynamo.utils import counters
from transformers import CompileConfig, LlamaConfig

from hf_asymkv import AsymKVCache, cache_kwargs

STEPS = 32
SMALL = dict(key_block_size=8, residual_length=8)  # a flush every 8 tokens: 4 inside 32 steps


def _compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")  # reduce-overhead is CUDA graphs
    config._compile_all_devices = True  # transformers' switch for compiling on CPU
    return config


def _generate(model, prompt, cache, compiled: bool) -> torch.Tensor:
    kwargs = {"compile_config": _compile_config()} if compiled else {"disable_compile": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(prompt, **cache_kwargs(cache), max_new_tokens=STEPS, do_sample=False, **kwargs)


def _check_compiled_run(model, prompt, preset: str) -> None:
    """Compiled, eager static and dynamic tokens equal; one graph for all steps; none for a second cache."""
    def static():
        return AsymKVCache.from_preset(preset, model.config, max_cache_len=prompt.shape[1] + STEPS, **SMALL)

    dynamic = _generate(model, prompt, AsymKVCache.from_preset(preset, model.config, **SMALL), compiled=False)
    eager = _generate(model, prompt, static(), compiled=False)
    torch._dynamo.reset()
    counters.clear()
    cache = static()
    compiled = _generate(model, prompt, cache, compiled=True)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    # the prefill flushes once per layer: the others ran inside the compiled steps
    assert cache.stats()["flushes"] >= 3 * len(cache.layers)
    counters.clear()
    again = _generate(model, prompt, static(), compiled=True)
    assert not counters["stats"]["unique_graphs"]  # a new cache of the same shape reuses the graph
    assert torch.equal(compiled, eager) and torch.equal(compiled, dynamic) and torch.equal(again, compiled)


def test_whole_forward_compiled_equals_eager(llama, prompt):
    """Blocks quantized inside the compiled prefill (40 tokens: 3 blocks of 8 per layer) and inside the compiled steps,
    40 greedy steps (every preset: tests/compile/test_whole_forward.py, run once rather than for every release)."""
    check_whole_forward(llama, prompt[:, :40], "balanced", 40, **SMALL)


def test_whole_forward_compiled_prefill_without_blocks(llama, prompt):
    """The issue's case: a prompt shorter than the sinks + window (nothing quantized in the prefill), default block
    sizes; the decode steps then quantize the first block."""
    check_whole_forward(llama, prompt[:, :12], "balanced", 40, key_block_size=16, residual_length=16)


def test_compiled_decode_equals_eager_without_recompiling(llama, prompt):
    _check_compiled_run(llama, prompt[:, :40], "balanced")


def test_fused_attention_compiled_decode_equals_eager(llama, prompt):
    """``attn_implementation="asymkv_sdpa"``: the static layers hand their codes to the attention
    (:mod:`hf_asymkv.core.static_attention`), and the compiled step reads them in the graph: one graph, no break,
    the eager static and the dynamic (fused) caches' tokens."""
    import copy

    from hf_asymkv import register_attention

    register_attention()
    fused = copy.deepcopy(llama)
    for name in ("_compiled_call", "_last_compile_config"):  # a copy would keep the compiled call of `llama` (sdpa)
        fused.__dict__.pop(name, None)
    fused.set_attn_implementation("asymkv_sdpa")
    assert AsymKVCache(fused.config, max_cache_len=8).fused_attention
    _check_compiled_run(fused, prompt[:, :40], "compact")


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "asymkv_sdpa"])
def test_default_model_compiled_decode_equals_eager(attention):
    from hf_asymkv import register_attention
    from hf_asymkv.models import load_model

    register_attention()
    model, _ = load_model()
    model.set_attn_implementation(attention)  # asymkv_sdpa: the compiled step attends over the codes
    model.model.layers = model.model.layers[:2]  # see the module docstring
    model.config.num_hidden_layers = 2
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:2]
    model.generation_config.eos_token_id = None  # 32 steps whatever the model says
    prompt = torch.randint(FIRST_PLAIN_TOKEN, 2000, (1, 40), generator=torch.Generator().manual_seed(0))
    _check_compiled_run(model, prompt, "compact")


@pytest.mark.parametrize("preset", ["balanced", "compact", "max"])
def test_graph_read_out_equals_eager_with_left_padding(preset):
    """Inside a graph a static layer composes its read-out without in-place writes (``StaticTensorStore._compose``);
    it must hand the eager read-out bit for bit: a left-padded batch (row 1's sinks live in the overlay), 24 steps
    across flushes, traced by dynamo and functionalized (``aot_eager``: no code generation, so it is fast)."""
    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    eager, graph = (AsymKVCache.from_preset(preset, config, max_cache_len=72, key_block_size=8, residual_length=8)
                    for _ in range(2))
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2, 2, 40 + 24, 16, generator=g) for _ in range(2))
    positions = torch.stack([torch.arange(40), (torch.arange(40) - 9).clamp(min=0)])  # row 1: 9 pads on the left
    for cache in (eager, graph):  # the layer's own update: Cache.update takes position ids from transformers 5.24
        cache.layers[0].update(keys[:, :, :40], values[:, :, :40], kwargs={"position_ids": positions})
    step = torch.compile(graph.layers[0].update, backend="aot_eager", fullgraph=True)
    for t in range(40, 64):
        kv = keys[:, :, t : t + 1], values[:, :, t : t + 1]
        pos = torch.tensor([[t], [t - 9]])
        expected = eager.layers[0].update(*kv, kwargs={"position_ids": pos})
        got = step(*kv, kwargs={"position_ids": pos})
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"step {t}"
    assert graph.layers[0].stats == eager.layers[0].stats and eager.layers[0].stats["blocks_quantized"] >= 3

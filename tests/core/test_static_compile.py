"""The static cache compiled with inductor on CPU, two ways: through ``generate``'s own compilation (the path
transformers takes for a ``StaticCache`` on a GPU; ``_compile_all_devices`` enables it on CPU: one-token steps
compiled, the prefill eager) and as transformers' recipe for a ``StaticCache`` compiles it, ``model.forward``
itself, prefill included (a multi-token update that quantizes blocks inside the graph). Both with
``fullgraph=True`` (a graph break raises), one graph for every decode step across block flushes, no recompilation
for a new cache, and the eager static cache's and the dynamic cache's tokens.

Few and small on purpose: CI runs tests/core for four transformers releases, and a cold inductor compile takes tens of
seconds on its two cores, so these compile the one-layer tiny Llama, one preset each. Every preset, a prompt that
quantizes nothing in the prefill, and the default model are compiled in tests/compile (newest release only). The hybrid
model is not compiled here: its sliding layers are transformers' ``StaticSlidingWindowLayer``, which recompiles at every
step under ``dynamic=False`` in transformers 5.25 (a ``StaticCache`` does the same), whatever our layers do.
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_generate_compile, check_whole_forward
from transformers import LlamaConfig

from hf_asymkv import AsymKVCache

pytestmark = pytest.mark.releases  # depends on transformers' behaviour: CI reruns it on older releases

STEPS = 32
SMALL = dict(key_block_size=8, residual_length=8)  # a flush every 8 tokens: 4 inside 32 steps


def test_generate_step_traces_one_graph_and_equals_eager(llama_one_layer, prompt):
    """``generate``'s own compile traced by dynamo alone (``backend="eager"``: no code generation), ``fullgraph=True``:
    one graph for every step across flushes, none for a new cache, the eager static and dynamic caches' tokens. What a
    transformers release can break (its forward's tracing, its cache calls); the fast tier's one compile (dynamo's
    tracing of the tiny model alone costs ~10 s of CPU); inductor's code generation runs in the slow tier."""
    check_generate_compile(llama_one_layer, prompt[:, :40], "balanced", STEPS, backend="eager", **SMALL)


def _fused(model):
    """A copy of ``model`` on ``attn_implementation="asymkv_sdpa"`` without any compiled call a copy would keep."""
    import copy

    from hf_asymkv import register_attention

    register_attention()
    fused = copy.deepcopy(model)
    for name in ("_compiled_call", "_last_compile_config"):  # a copy would keep the compiled call (sdpa)
        fused.__dict__.pop(name, None)
    fused.set_attn_implementation("asymkv_sdpa")
    return fused


@pytest.mark.slow(reason="a cold inductor compile; fast twin, the same graphs traced by dynamo without code "
                         "generation: "
                         "tests/core/test_static_compile.py::test_generate_step_traces_one_graph_and_equals_eager")
def test_whole_forward_compiled_equals_eager(llama_one_layer, prompt):
    """Blocks quantized inside the compiled prefill (40 tokens: 3 blocks of 8 per layer) and inside the compiled steps,
    40 greedy steps (every preset: tests/compile/test_whole_forward.py, run once rather than for every release)."""
    check_whole_forward(llama_one_layer, prompt[:, :40], "balanced", 40, **SMALL)


@pytest.mark.slow(reason="a cold inductor compile of generate's step; fast twin, traced without code generation: "
                         "tests/core/test_static_compile.py::test_generate_step_traces_one_graph_and_equals_eager")
def test_compiled_decode_equals_eager_without_recompiling(llama_one_layer, prompt):
    check_generate_compile(llama_one_layer, prompt[:, :40], "balanced", STEPS, **SMALL)


@pytest.mark.slow(reason="a cold inductor compile of the fused step; fast twin, traced without code generation: "
                         "tests/core/test_static_compile.py::test_generate_step_traces_one_graph_and_equals_eager")
def test_fused_attention_compiled_decode_equals_eager(llama_one_layer, prompt):
    """``attn_implementation="asymkv_sdpa"``: the static layers hand their codes to the attention
    (:mod:`hf_asymkv.core.static_attention`), and the compiled step reads them in the graph: one graph, no break,
    the eager static and the dynamic (fused) caches' tokens."""
    fused = _fused(llama_one_layer)
    assert AsymKVCache(fused.config, max_cache_len=8).fused_attention
    check_generate_compile(fused, prompt[:, :40], "compact", STEPS, **SMALL)


@pytest.mark.slow(reason="aot_eager functionalization of 24 steps (tens of seconds); fast twin, the same read-out "
                         "traced by dynamo: "
                         "tests/core/test_static_compile.py::test_generate_step_traces_one_graph_and_equals_eager")
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

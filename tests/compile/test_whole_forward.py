"""transformers' recipe for a compiled static cache, prefill included: ``model.forward = torch.compile(model.forward,
fullgraph=True, dynamic=False)``, for every preset and on the real default model (issue 38).

``generate``'s own compile (one-token steps, tests/core/test_static_compile.py) never compiles a multi-token update;
this recipe does, and it gave wrong logits (0.4 on the tiny Llama, 19.7 on the 30-layer default model) until
:meth:`~hf_asymkv.core.static_store.StaticTensorStore.joined` stopped scattering a prefill's tokens within the buffer
inductor had computed them into. Kept out of tests/core, which CI runs for four transformers releases: each compile
costs seconds to minutes on two cores (tests/core keeps one preset). The tiny model here has one layer (the bug is in
one layer's update; inductor's time grows with the graph); the default model is compiled with 1 and all 30.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import check_whole_forward, first_layers, manual_greedy, relative_error
from torch._dynamo.utils import counters

from hf_asymkv import PRESETS, AsymKVCache, cache_kwargs, register_attention
from hf_asymkv.models import ModelNotAvailableError, load_model

pytestmark = pytest.mark.releases  # depends on transformers' behaviour: CI reruns it on older releases

SMALL = dict(key_block_size=8, residual_length=8)  # blocks quantized inside a 40-token prefill and every 8 steps
STEPS = 40
LOCKER = "The locker code for the blue door is 4417. Repeat the locker code for the blue door:"


@pytest.mark.slow(reason="cold inductor compiles of the whole forward (tens of seconds each); fast twin, the same "
                         "graphs traced by dynamo without code generation: "
                         "tests/core/test_static_compile.py::test_generate_step_traces_one_graph_and_equals_eager")
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset(llama_one_layer, prompt, preset):
    check_whole_forward(llama_one_layer, prompt[:, :40], preset, STEPS, **SMALL)


@pytest.mark.slow(reason="cold inductor compiles of the whole forward (tens of seconds each); fast twin, the same "
                         "graphs traced by dynamo without code generation: "
                         "tests/core/test_static_compile.py::test_generate_step_traces_one_graph_and_equals_eager")
def test_prefill_without_blocks(llama_one_layer, prompt):
    """The issue's case: a prompt shorter than the sinks + window (nothing quantized in the prefill), default block
    sizes; the decode steps then quantize the first block."""
    check_whole_forward(llama_one_layer, prompt[:, :12], "balanced", STEPS, key_block_size=16, residual_length=16)


@pytest.mark.slow(reason="cold inductor compiles of the whole forward (tens of seconds each); fast twin, the same "
                         "graphs traced by dynamo without code generation: "
                         "tests/core/test_static_compile.py::test_generate_step_traces_one_graph_and_equals_eager")
def test_fused_attention(llama_one_layer, prompt):
    """``attn_implementation="asymkv_sdpa"``: the prefill (40 query tokens) takes SDPA over the dense read-out inside
    the graph, the steps read the codes (``max``: wide key channels and 1-bit values, the most parts)."""
    register_attention()
    fused = copy.deepcopy(llama_one_layer)
    fused.set_attn_implementation("asymkv_sdpa")
    check_whole_forward(fused, prompt[:, :40], "max", STEPS, **SMALL)


@pytest.fixture(scope="module")
def default_model():
    try:
        return load_model()
    except ModelNotAvailableError as exc:  # CI installs it; a bare checkout may not have it
        pytest.skip(str(exc))


def _locker_prompt(tokenizer) -> torch.Tensor:
    messages = [{"role": "user", "content": LOCKER}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


@pytest.mark.slow(reason="a cold inductor compile of the default model's layer shapes; fast twin: "
                         "tests/core/test_static.py::test_layers_are_compileable_and_generate_would_compile")
def test_default_model_one_layer(default_model):
    """The default model's shapes (head_dim 64, 3 KV heads of 9 query heads), one layer, ``max`` (the preset with the
    most parts: wide key channels, 1-bit values). Every preset compiles the same code on the tiny Llama above; a
    cold compile costs 40 s or more per preset on two cores."""
    model, _ = default_model
    g = torch.Generator().manual_seed(0)
    check_whole_forward(first_layers(model, 1), torch.randint(3, 2000, (1, 40), generator=g), "max", STEPS, **SMALL)


@pytest.mark.slow(reason="compiles all 30 layers of the default model; fast twin: "
                         "tests/core/test_static.py::test_static_generates_the_dynamic_tokens_and_blocks")
def test_default_model_all_layers_answers_as_eager(default_model):
    """The issue's case as a user meets it: all 30 layers, ``balanced`` as shipped, ``max_cache_len=128``, the locker
    prompt. Eager answers "4417."; the compiled prefill must give its logits and its 40 tokens."""
    model, tokenizer = default_model
    ids = _locker_prompt(tokenizer)

    def cache():
        return AsymKVCache.from_preset("balanced", model.config, max_cache_len=128)

    eager_first, eager_tokens = manual_greedy(model.forward, ids, cache(), STEPS)
    assert "4417" in tokenizer.decode(eager_tokens[:16])
    torch._dynamo.reset()
    first, tokens = manual_greedy(torch.compile(model.forward, fullgraph=True, dynamic=False), ids, cache(), STEPS)
    assert relative_error(first, eager_first) <= 1e-4
    assert tokens == eager_tokens


def _readme_compile_snippet() -> str:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    return re.search(r"## Compile: a static cache\n.*?```python\n(.*?)```", readme, re.S).group(1)


@pytest.mark.slow(reason="cold inductor compiles of the whole forward (tens of seconds each); fast twin, the same "
                         "graphs traced by dynamo without code generation: "
                         "tests/core/test_static_compile.py::test_generate_step_traces_one_graph_and_equals_eager")
def test_the_readme_recipe(llama_one_layer, prompt):
    """The README's compile section as written (``model``, ``inputs`` given): the whole forward compiled into two
    graphs, then generate: the eager static cache's tokens, and none more graphs for the next cache."""
    model = copy.deepcopy(llama_one_layer)
    inputs = {"input_ids": prompt[:, :40]}
    eager_cache = AsymKVCache.from_preset("balanced", model.config, max_cache_len=40 + 256)
    eager = model.generate(**inputs, **cache_kwargs(eager_cache), max_new_tokens=256, disable_compile=True)
    torch._dynamo.reset()
    counters.clear()
    namespace = {"model": model, "inputs": inputs, "torch": torch, "AsymKVCache": AsymKVCache,
                 "cache_kwargs": cache_kwargs}
    exec(compile(_readme_compile_snippet(), "README.md compile", "exec"), namespace)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    assert torch.equal(namespace["out"], eager) and namespace["cache"].stats()["blocks_quantized"] > 0
    counters.clear()
    exec(compile(_readme_compile_snippet(), "README.md compile", "exec"), namespace)
    assert not counters["stats"]["unique_graphs"] and torch.equal(namespace["out"], eager)

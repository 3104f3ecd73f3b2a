"""The static attention as an operator (``hf_asymkv::static_attention``, :mod:`hf_asymkv.core.static_op`): its torch
implementation equals the traced torch function bit for bit; its schema and fake pass ``torch.library.opcheck``; a
compiled static step with ``fullgraph=True`` calls it (one node in the graph, no break) and generates the eager
tokens; ``HF_ASYMKV_STATIC_ATTENTION`` picks the form and refuses other values."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import manual_greedy
from test_static_attention import CONFIGS, PADS, PROMPT, _mask
from transformers import LlamaConfig

from hf_asymkv import AsymKVCache, AsymKVConfig, register_attention
from hf_asymkv.core.static_attention import StaticQuantizedKV, static_fused_attention
from hf_asymkv.core.static_op import ENV_VAR, static_attention, static_attention_args, use_operator

pytestmark = pytest.mark.usefixtures("single_thread")


def _steps(name: str | AsymKVConfig, n_rep: int = 2, steps: int = 12, q_len: int = 1):
    """A left-padded static layer (``CONFIGS[name]``, or a config) through ``steps`` updates of ``q_len`` tokens:
    ``(query, key, value, mask)`` per step."""
    heads, d = 2, 16
    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=heads * n_rep,
                         num_key_value_heads=heads, head_dim=d)
    max_len = PROMPT + steps * q_len
    cache = AsymKVCache(config, CONFIGS[name] if isinstance(name, str) else name, max_cache_len=max_len)
    layer = cache.layers[0]
    layer.return_views = True
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2, heads, max_len, d, generator=g) * 2 for _ in range(2))
    queries = torch.randn(2, heads * n_rep, max_len, d, generator=g)
    positions = torch.stack([torch.arange(PROMPT), (torch.arange(PROMPT) - PADS).clamp(min=0)])
    layer.update(keys[:, :, :PROMPT], values[:, :, :PROMPT], kwargs={"position_ids": positions})
    for start in range(PROMPT, max_len, q_len):
        span = slice(start, start + q_len)
        pos = torch.stack([torch.arange(start, start + q_len), torch.arange(start, start + q_len) - PADS])
        key, value = layer.update(keys[:, :, span], values[:, :, span], kwargs={"position_ids": pos})
        yield queries[:, :, span], key, value, _mask(start, q_len, max_len)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_operator_equals_the_torch_function(name):
    for q, key, value, mask in _steps(name):
        assert isinstance(key, StaticQuantizedKV)
        expected = static_fused_attention(q, key, value, mask, 0.25)
        assert torch.equal(static_attention(*static_attention_args(q, key, value, mask, 0.25)), expected)


@pytest.mark.slow(reason="torch.library.opcheck's compile checks of the operator; fast twin: "
                         "tests/core/test_static_op.py::test_the_operator_equals_the_torch_function")
@pytest.mark.parametrize("name", ["balanced", "int1-values", "compact"])
def test_opcheck(name):
    """Schema, fake (shapes and dtypes), no aliasing of inputs, and dispatch, as torch checks a custom operator.
    (Not with fp8 codes: opcheck's schema check multiplies the inputs, which CPU float8 tensors refuse; the equality
    test above covers them.)"""
    q, key, value, mask = list(_steps(name, steps=9))[-1]
    torch.library.opcheck(static_attention, static_attention_args(q, key, value, mask, 0.25))


def test_the_form_is_chosen_by_the_environment(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert not use_operator(cpu) and use_operator(cuda)
    monkeypatch.setenv(ENV_VAR, "op")
    assert use_operator(cpu)
    monkeypatch.setenv(ENV_VAR, "inline")
    assert not use_operator(cuda)
    monkeypatch.setenv(ENV_VAR, "kernel")
    with pytest.raises(ValueError, match=r"HF_ASYMKV_STATIC_ATTENTION='kernel' is not a static attention form; "
                                         r"allowed: \['auto', 'op', 'inline'\]"):
        use_operator(cpu)


@pytest.mark.slow(reason="an inductor compile of a decode step; fast twin: "
                         "tests/core/test_static_op.py::test_the_operator_equals_the_torch_function")
def test_a_compiled_step_calls_the_operator(llama, prompt, monkeypatch):
    """``fullgraph=True`` through the operator: the decode step's graph holds one call per layer, the prefill's none
    (40 query tokens take SDPA over the dense read-out); greedy tokens equal the eager static and dynamic caches'.
    Traced and run by a recording backend (no code generation: the graph is the point here; inductor runs the
    same graph in tests/core/test_static_compile.py)."""
    monkeypatch.setenv(ENV_VAR, "op")
    register_attention()
    fused = copy.deepcopy(llama)
    fused.set_attn_implementation("asymkv_sdpa")
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def run(forward) -> list[int]:
        cache = AsymKVCache.from_preset("compact", fused.config, max_cache_len=72, key_block_size=8,
                                        residual_length=8)
        return manual_greedy(forward, prompt[:, :40], cache, 24)[1]

    eager = run(fused.forward)
    dynamic = manual_greedy(fused.forward, prompt[:, :40], AsymKVCache.from_preset(
        "compact", fused.config, key_block_size=8, residual_length=8), 24)[1]
    torch._dynamo.reset()
    compiled = run(torch.compile(fused.forward, backend=record, fullgraph=True, dynamic=False))
    assert compiled == eager == dynamic
    assert len(graphs) == 2  # the prefill and the step
    assert [code.count("hf_asymkv.static_attention") for code in graphs] == [0, len(fused.model.layers)]


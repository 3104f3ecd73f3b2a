"""``generate``'s own compile of a static cache (one-token steps, prefill eager) on the default model's first 2 layers
(its shapes and weights): with SDPA over the dense read-out and with the fused attention over the codes. All 30 layers
took 14.5 minutes to compile on a busy 2-core machine, with the same result (one graph, tokens equal to eager static and
dynamic for 32 steps, compact, 8-token blocks). The tiny model's cases run in tests/core/test_static_compile.py."""

from __future__ import annotations

import pytest
import torch
from conftest import FIRST_PLAIN_TOKEN
from helpers import check_generate_compile, first_layers

pytestmark = pytest.mark.releases  # depends on transformers' behaviour: CI reruns it on older releases

STEPS = 32


@pytest.mark.slow(reason="generate's compile on the default model's first 2 layers; fast twin: "
                         "tests/core/test_static.py::test_layers_are_compileable_and_generate_would_compile")
@pytest.mark.parametrize("attention", ["sdpa", "asymkv_sdpa"])
def test_default_model_compiled_decode_equals_eager(attention):
    from hf_asymkv import register_attention
    from hf_asymkv.models import load_model

    register_attention()
    model = first_layers(load_model()[0], 2)
    model.set_attn_implementation(attention)  # asymkv_sdpa: the compiled step attends over the codes
    model.generation_config.eos_token_id = None  # 32 steps whatever the model says
    prompt = torch.randint(FIRST_PLAIN_TOKEN, 2000, (1, 40), generator=torch.Generator().manual_seed(0))
    check_generate_compile(model, prompt, "compact", STEPS, key_block_size=8, residual_length=8)

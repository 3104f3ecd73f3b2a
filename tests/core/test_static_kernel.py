"""The CUDA implementation of ``hf_asymkv::static_attention`` (:mod:`hf_asymkv.core.static_kernel`): registered for
CUDA; run on CPU tensors under Triton's interpreter, it equals the torch implementation across flushes of a
left-padded batch (sinks, the padded row's exact sinks, block slots, window) for the presets' formats; calls the
kernel does not serve take the torch implementation, or fail under ``HF_ASYMKV_ATTENTION_BACKEND=triton``."""

from __future__ import annotations

import pytest
import torch
from helpers import tiered
from test_static_op import _steps

from hf_asymkv import AsymKVConfig
from hf_asymkv.core.quant import sqnr_db
from hf_asymkv.core.static_attention import static_fused_attention
from hf_asymkv.core.static_op import static_attention, static_attention_args, static_attention_triton
from hf_asymkv.kernels.backend import ENV_VAR as BACKEND_VAR

pytest.importorskip("triton")  # the kernel runs under Triton's interpreter (tests/conftest.py selects it)
pytestmark = pytest.mark.usefixtures("single_thread")

BLOCKS = dict(key_block_size=16, residual_length=16)  # the kernel's tiles are 16 tokens at least
# Both sides read the same codes; the kernel multiplies them as fp16 operands (as the GPU does: issue 37's
# conversion by bit tricks), so the difference is that rounding, held to tests/kernels/test_decode.py's float32 bound
FLOAT32_DB = 60.0
CONFIGS = {
    "balanced": AsymKVConfig(**BLOCKS),
    "compact": AsymKVConfig(key_format="int4", key_symmetric=False, value_bits=3, **BLOCKS),
    "wide-keys-1-bit-values": AsymKVConfig(key_format="int3", key_symmetric=False, key_wide_fraction=0.25,
                                           value_bits=1, **BLOCKS),
    "fp8-keys-grouped-values": AsymKVConfig(key_format="fp8_e4m3", value_group_size=8, value_rotation=False,
                                            **BLOCKS),
    "no-sinks": AsymKVConfig(sink_tokens=0, **BLOCKS),
    # lean's keys: 32-token blocks, two per tile (a stop half way through one: triton_codes._two_block_scores)
    "lean": AsymKVConfig(key_format="int4", key_symmetric=False, key_block_size=32, residual_length=16),
}


def _some_steps(config: AsymKVConfig, steps: int, q_len: int = 1, every: int = 8):
    """Every ``every``-th step of :func:`test_static_op._steps` (2 KV heads of 16 channels, 2 query heads each, a
    left-padded row), and the last one: each kernel call costs under the interpreter."""
    for i, step in enumerate(_steps(config, steps=steps, q_len=q_len)):
        if i % every == 0 or i == steps - 1:
            yield step


def test_the_cuda_implementation_is_registered():
    assert torch._C._dispatch_has_kernel_for_dispatch_key(static_attention._qualname, "CUDA")


@pytest.mark.parametrize("name", tiered(list(CONFIGS), {"compact"}, "every other format under Triton's interpreter "
                                        "(~5-30 s each); fast twin: tests/core/test_static_kernel.py::"
                                        "test_the_kernel_equals_the_torch_implementation"))
def test_the_kernel_equals_the_torch_implementation(name, monkeypatch):
    """Forced to the kernel (an unserved call would raise): steps before, across and after two block flushes."""
    monkeypatch.setenv(BACKEND_VAR, "triton")
    for q, key, value, mask in _some_steps(CONFIGS[name], steps=24):
        expected = static_fused_attention(q, key, value, mask, 0.25)
        got = static_attention_triton(*static_attention_args(q, key, value, mask, 0.25))
        assert got.shape == expected.shape and sqnr_db(expected, got) >= FLOAT32_DB


@pytest.mark.slow(reason="the static kernel under Triton's interpreter; fast twin: "
                         "tests/core/test_static_kernel.py::test_the_kernel_equals_the_torch_implementation")
@pytest.mark.parametrize("name", ["balanced", "lean"])
def test_slots_past_the_filled_length_are_not_read(name, monkeypatch):
    """Issue 38: the kernel stops at the stored blocks (the 0-d boundary, read on the device), not at the preallocated
    slots. The scales of every slot past the filled length are made NaN after the expected output is computed: a
    kernel that read them would return NaN (a NaN score is not hidden by the mask). ``lean``'s tiles hold two 32-token
    blocks: 32 filled tokens end a tile half way."""
    monkeypatch.setenv(BACKEND_VAR, "triton")
    checked = []
    for q, key, value, mask in _some_steps(CONFIGS[name], steps=40 if name == "balanced" else 80, every=4):
        filled = int(key.boundary) - key.store.sink_count
        if not 0 < filled < key.store.codes.shape[2]:
            continue
        expected = static_fused_attention(q, key, value, mask, 0.25)
        saved = [(store, store.scales.clone()) for store in (key.store, value.store)]
        try:
            for store, _ in saved:
                store.scales[:, :, filled // store.spec.token_group :] = float("nan")
            got = static_attention_triton(*static_attention_args(q, key, value, mask, 0.25))
        finally:
            for store, scales in saved:
                store.scales.copy_(scales)
        assert torch.isfinite(got).all() and sqnr_db(expected, got) >= FLOAT32_DB
        checked.append(filled)
    assert len(checked) >= 2 and (name != "lean" or 32 in checked)


@pytest.mark.slow(reason="the static kernel under Triton's interpreter; fast twin: "
                         "tests/core/test_static_kernel.py::test_the_kernel_equals_the_torch_implementation")
def test_several_query_tokens_and_no_mask(monkeypatch):
    """Three query tokens per step (a speculative step), causal from the filled length when no mask is given."""
    monkeypatch.setenv(BACKEND_VAR, "triton")
    for q, key, value, _ in _some_steps(CONFIGS["balanced"], steps=8, q_len=3, every=3):
        expected = static_fused_attention(q, key, value, None, 0.25)
        got = static_attention_triton(*static_attention_args(q, key, value, None, 0.25))
        assert got.shape == expected.shape and sqnr_db(expected, got) >= FLOAT32_DB


def test_unserved_calls_take_the_torch_implementation(monkeypatch):
    """Rotated keys: the kernel does not read them. ``auto`` runs the torch implementation (bit for bit), ``triton``
    says why it cannot, ``torch`` never builds the kernel's regions."""
    config = AsymKVConfig(key_format="int4", key_granularity="token", key_rotation=True, **BLOCKS)
    q, key, value, mask = list(_steps(config, steps=4))[-1]
    args = static_attention_args(q, key, value, mask, 0.25)
    expected = static_fused_attention(q, key, value, mask, 0.25)
    for backend in ("auto", "torch"):
        monkeypatch.setenv(BACKEND_VAR, backend)
        assert torch.equal(static_attention_triton(*args), expected)
    monkeypatch.setenv(BACKEND_VAR, "triton")
    with pytest.raises(ValueError, match="cannot serve this attention call: rotated keys"):
        static_attention_triton(*args)

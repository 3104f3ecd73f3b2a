"""scripts/studies/key_codes.py (issue 39): the learned codes' pieces on small tensors and the tiny Llama, and its
options checked before any model is loaded."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hf_asymkv import cache_kwargs

STUDIES = Path(__file__).resolve().parents[1] / "scripts" / "studies"


@pytest.fixture(scope="module")
def study():
    """The study as a module registered under its name (its dataclasses look their module up in sys.modules)."""
    spec = importlib.util.spec_from_file_location("key_codes", STUDIES / "key_codes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["key_codes"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["key_codes"]


@pytest.fixture(scope="module")
def fit(study):
    return sys.modules["key_codes_fit"]  # imported by the study from scripts/studies


def test_unrope_inverts_the_models_rotary_embedding(fit, llama):
    tables = fit.rope_tables(llama, 128)
    cos, sin = tables[0]
    k = torch.randn(2, 128, 16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(fit.unrope(fit.unrope(k, cos, sin), cos, -sin), k, atol=1e-5)
    assert not torch.allclose(fit.unrope(k, cos, sin), k, atol=1e-2)


@pytest.mark.parametrize("identity, meta_bits", [(False, 32), (True, 32), (False, 16)],
                         ids=["klt", "identity", "klt-16-bit-scales"])
def test_a_transform_code_spends_its_budget_and_errs_less_with_more_bits(fit, identity, meta_bits):
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(2, 8, 8, generator=gen) * torch.tensor([4.0, 2, 1, 1, 0.5, 0.2, 0.1, 0.05])[:, None]
    x = torch.randn(2, 640, 8, generator=gen) @ mix + 3  # [Hk, N, D]: correlated channels of unequal size
    moment = torch.eye(8).expand(2, 8, 8).clone()
    errors = []
    for budget in (2.0, 4.0):
        code = fit.FittedTransform(*fit.fit_components(x, moment, budget, identity, meta_bits=meta_bits),
                                   (torch.ones(640, 8),) * 2)
        assert code.bits() <= budget + 1e-6 and (code.reference is None) == (meta_bits == 32)
        assert torch.allclose(code.basis @ code.inverse, torch.eye(8).expand(2, 8, 8), atol=1e-4)
        errors.append((code.encode_decode(x, 0) - x).pow(2).mean())
    assert errors[1] < errors[0] / 2


def test_16_bit_scales_cost_little_error_at_the_same_width(fit):
    z = torch.randn(2, 640, 8, generator=torch.Generator().manual_seed(1)) * 5 + 2
    widths, means = torch.full((2, 8), 3.0), z.mean(1)
    blocks = z.reshape(2, 10, 64, 8)
    reference = (blocks.amax(2) - blocks.amin(2)).median(1).values
    full, short = ((fit.round_blocks(z, widths, means, r) - z).pow(2).mean() for r in (None, reference))
    assert full < short < 1.2 * full


def test_block_metadata_other_than_32_or_16_bits_is_refused(fit):
    with pytest.raises(ValueError, match="meta_bits=24: 32 .* or 16 allowed"):
        fit.fit_components(torch.randn(1, 64, 4), torch.eye(4)[None], 2.0, meta_bits=24)
    with pytest.raises(ValueError, match="meta_bits=8: 32 .* or 16 allowed"):
        fit.fit_token_code(fit.LayerCalibration(values=torch.randn(1, 64, 4)), 2, 4, 8)


def test_the_coded_cache_codes_each_key_block_at_its_position(study, llama, prompt):
    calls = []

    def zero(x, start):
        calls.append((start, x.shape[2]))
        return torch.zeros_like(x)

    cache = study.coded_cache(llama.config, "tight", lambda i: zero if i == 0 else None)
    with torch.no_grad():
        llama(prompt.repeat(1, 4), **cache_kwargs(cache), use_cache=True)  # 256 tokens
        for token in prompt[:, :64].T:  # then one at a time: blocks are quantized as the window moves on
            llama(token[None], **cache_kwargs(cache), use_cache=True)
    blocks = cache.layers[0].key_store.blocks
    assert len(calls) == 2 and blocks.length == 256  # the prefill's blocks in one call, then one more block
    assert [start for start, _ in calls] == [4 + sum(m for _, m in calls[:i]) for i in range(len(calls))]  # after
    assert sum(m for _, m in calls) == blocks.length  # the 4 exact sinks, each block once, at its own position
    assert blocks.decode(0, blocks.length, torch.float32).abs().max() == 0  # what the coder returned is stored
    assert cache.layers[1].key_store.blocks.decode(0, blocks.length, torch.float32).abs().max() > 0


@pytest.mark.parametrize("option, value, allowed", [("--designs", "p2-6,nope", "p2-6"),
                                                    ("--references", "hf-fp9", "hf-fp8")], ids=["design", "reference"])
def test_an_unknown_name_is_refused_before_the_model_loads(study, monkeypatch, capsys, tmp_path, option, value,
                                                            allowed):
    monkeypatch.setattr(sys, "argv", ["key_codes.py", option, value, "--out", str(tmp_path / "t.md")])
    with pytest.raises(SystemExit) as exit_info:
        study.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{option}: {value.split(',')[-1]} unknown; allowed:" in err and allowed in err


@pytest.mark.parametrize("meta_bits", [32, 16], ids=["float16-scales", "16-bit-scales"])
def test_the_token_value_code_rounds_each_token_group_as_int2(fit, meta_bits):
    v = torch.randn(2, 128, 64, generator=torch.Generator().manual_seed(2)) * 3  # [Hk, N, D]
    code = fit.fit_token_code(fit.LayerCalibration(values=v), 2, 64, meta_bits)
    error = (code.encode_decode(v, 0) - v).pow(2).mean() / v.pow(2).mean()
    assert 0.18 < error < (0.21 if meta_bits == 32 else 0.23)  # min-max int2 over 64 Gaussians: about 0.2
    assert code.static_bytes() == (0 if meta_bits == 32 else 2 * 2)

"""The outlier stress model on tiny random models: outputs unchanged to rounding (with and without projection biases,
GQA), the requested outliers really in the keys, formats that split per tensor hurt by them while per-channel keys
are not, bad layers / heads / ratios / specs / models refused with a message, and `--stress-outliers` on the eval
commands (labelled output, checks before the weights load)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import _build, llama_config, save_tiny_model
from helpers import LOCAL_TEXT, char_tokenizer
from transformers import LlamaForCausalLM

from hf_asymkv.cli import main
from hf_asymkv.core.quant import sqnr_db
from hf_asymkv.evals.long_decode import run_long_decode
from hf_asymkv.evals.stress import (
    OUTLIER_PRESETS,
    add_key_outliers,
    key_pair_ranges,
    layer_ratios,
    parse_outlier_spec,
    scale_key_pair,
    stress_model,
)

pytestmark = pytest.mark.usefixtures("single_thread")

TEXT = LOCAL_TEXT


@pytest.fixture(scope="module")
def biased():
    """The tiny Llama with q/k/v/o projection biases (as Qwen2 has on q/k/v), random non-zero biases."""
    config = llama_config()
    config.attention_bias = True
    model = _build(LlamaForCausalLM, config, seed=1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.bias.copy_(torch.randn(proj.bias.shape, generator=g) * 0.5)
    return model


@torch.no_grad()
def logits(model, prompt):
    return model(prompt).logits


@pytest.mark.parametrize("which", ["llama", "biased"], ids=["no-bias", "qk-bias"])
def test_outliers_keep_the_outputs_and_are_in_the_keys(request, prompt, which):
    model = copy.deepcopy(request.getfixturevalue(which))
    before, k_before = logits(model, prompt), model.model.layers[0].self_attn.k_proj.weight.clone()
    ratios_before = key_pair_ranges(model, prompt)
    applied = add_key_outliers(model, prompt, {0: 150, -1: 200})
    # outputs equal to rounding: ~120 dB in float32 (a wrong query head or a missed bias would be ~0 dB)
    assert sqnr_db(before, logits(model, prompt)) > 100
    assert not torch.equal(k_before, model.model.layers[0].self_attn.k_proj.weight)
    assert [(a.layer, a.kv_head) for a in applied] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for a, ranges in zip(applied, [key_pair_ranges(model, prompt)[a.layer][a.kv_head] for a in applied]):
        target = 150 if a.layer == 0 else 200
        assert a.ratio_after == pytest.approx(target) and a.scale > 1
        assert float(ranges.max() / ranges.median()) == pytest.approx(target, rel=1e-4)
        assert int(ranges.argmax()) == a.pair == int(ratios_before[a.layer][a.kv_head].argmax())


def test_a_pair_already_beyond_its_ratio_is_left_alone(llama, prompt):
    model = copy.deepcopy(llama)
    applied = add_key_outliers(model, prompt, {"*": 1.0})
    assert all(a.scale == 1.0 and a.ratio_after == a.ratio_before for a in applied)
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, llama.model.layers[1].self_attn.q_proj.weight)


@pytest.mark.slow(reason="every scheme on the stress model end to end; fast twin: "
                         "tests/evals/test_stress.py::test_outliers_keep_the_outputs_and_are_in_the_keys")
def test_per_tensor_keys_suffer_from_the_outliers_and_per_channel_keys_do_not(llama):
    """The point of the stress model: one scale for all channels is set by the outlier and leaves the others
    coarse; a scale per channel is not moved (up to its bf16 rounding)."""
    tok, schemes = char_tokenizer(), ["dynamic", "int8-per-tensor", "asymkv"]
    stressed = copy.deepcopy(llama)
    stress_model(stressed, tok, "all", measure_tokens=200)
    base, hit = ({r.scheme: r.kl_mean for r in run_long_decode(m, tok, schemes, TEXT, 300, 24, show_progress=False)}
                 for m in (llama, stressed))
    assert hit["int8-per-tensor"] > 100 * base["int8-per-tensor"]  # measured: ~1800x
    assert hit["asymkv"] == pytest.approx(base["asymkv"], rel=0.05)  # measured: equal to 4 digits


@pytest.mark.parametrize(("args", "message"), [
    ((2, 0, 0, 10.0), "layer must be an int in [0, 1], got 2"),
    ((0, 2, 0, 10.0), "kv_head must be an int in [0, 1], got 2"),
    ((0, 0, 8, 10.0), "pair must be an int in [0, 7], got 8"),
    ((0, 0, 0, 0.0), "scale must be a finite number > 0, got 0.0"),
    ((0, 0, 0, float("inf")), "scale must be a finite number > 0, got inf"),
], ids=["layer", "kv-head", "pair", "zero-scale", "inf-scale"])
def test_scale_key_pair_refuses_bad_arguments(llama, args, message):
    with pytest.raises(ValueError) as info:
        scale_key_pair(copy.deepcopy(llama), *args)
    assert message in str(info.value)


@pytest.mark.parametrize(("spec", "message"), [
    ({5: 150.0}, "layer 5 is not a layer of this model (layers 0..1, or -1 for the last)"),
    ({0: 0.5}, "outlier ratio of layer 0 must be a finite number >= 1, got 0.5"),
    ({0: 10.0, -2: 20.0}, "layer 0 is named twice"),
], ids=["out-of-range", "ratio-below-1", "named-twice"])
def test_layer_ratios_refuse_bad_specs(spec, message):
    with pytest.raises(ValueError) as info:
        layer_ratios(spec, 2)
    assert message in str(info.value)


def test_layer_ratios_and_presets():
    assert layer_ratios(OUTLIER_PRESETS["qwen"], 4) == {0: 150.0, 1: 10.0, 2: 10.0, 3: 150.0}
    assert parse_outlier_spec("qwen") == OUTLIER_PRESETS["qwen"]
    assert parse_outlier_spec("0:150, -1:150, *:10") == {0: 150.0, -1: 150.0, "*": 10.0}


@pytest.mark.parametrize("text", ["qwn", "0:x", "0=150", ","], ids=["unknown-preset", "bad-ratio", "no-colon", "empty"])
def test_bad_outlier_specs_are_refused(text):
    with pytest.raises(ValueError) as info:
        parse_outlier_spec(text)
    assert "--stress-outliers: " in str(info.value) and repr(text) in str(info.value)


def test_models_with_a_per_head_norm_on_keys_are_refused(hybrid, prompt):
    with pytest.raises(ValueError) as info:
        add_key_outliers(copy.deepcopy(hybrid), prompt, {0: 150})
    assert "layer 0: Gemma3Attention normalizes q/k per head (q_norm/k_norm)" in str(info.value)


# ------------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("stress_cli") / "llama")


@pytest.mark.slow(reason="every scheme on the stress model end to end; fast twin: "
                         "tests/evals/test_stress.py::test_outliers_keep_the_outputs_and_are_in_the_keys")
def test_stress_outliers_label_every_output(folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["eval", "attention", "--model", str(folder), "--stress-outliers", "0:150,*:10", "--length", "600",
                 "--samples", "1", "--queries", "16", "--schemes", "int8-per-tensor", "--quiet", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("**STRESS CASE: ")
    meta = json.loads((out / "attention.json").read_text())["meta"]
    assert meta["stress_outliers"]["spec"] == "0:150,*:10" and meta["stress_outliers"]["ratios"] == {"0": 150.0,
                                                                                                      "*": 10.0}
    # each applied pair's ratio is measured again after the scaling: the target up to float rounding (9.999999999999998
    # on one CPU), as test_outliers_keep_the_outputs_and_are_in_the_keys compares it
    applied = meta["stress_outliers"]["applied"]
    assert {a["layer"] for a in applied} == {0, 1}
    assert all(a["ratio_after"] == pytest.approx({0: 150.0, 1: 10.0}[a["layer"]]) for a in applied)
    md = (out / "attention.md").read_text().splitlines()
    assert md[0].startswith("Command: `hf-asymkv eval attention") and md[2].startswith("**STRESS CASE: ")


@pytest.mark.parametrize(("spec", "message"), [
    ("qwn", "argument --stress-outliers: expected a preset (qwen, all) or LAYER:RATIO pairs"),
    ("7:100", "layer 7 is not a layer of this model (layers 0..1"),
], ids=["bad-spec", "layer-out-of-range"])
def test_bad_stress_outliers_exit_2_before_any_work(folder, tmp_path, capsys, spec, message):
    command = ["eval", "long-decode", "--model", str(folder), "--stress-outliers", spec, "--prompt-length", "100",
               "--steps", "8", "--quiet", "--out", str(tmp_path / "out")]
    try:
        code = main(command)
    except SystemExit as exc:  # refused by argparse
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

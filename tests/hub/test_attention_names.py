"""KV scale names follow the checkpoint's own attention modules (`hf_asymkv.hub.attention_names`): a tiny Llama,
GPT-NeoX and a multimodal Llava checkpoint are exported and loaded back with transformers, and every scale
lands on its layer's attention module; a layer that cannot be named is refused with the names found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import llama_config
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    CLIPVisionConfig,
    GPTNeoXConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

import hf_asymkv.hub.attention_names as attention_names
from hf_asymkv.core.scales import KVScales, config_fingerprint
from hf_asymkv.hub.attention_names import attention_prefixes
from hf_asymkv.hub.serving import SCALES_SHARD, export_serving_checkpoint
from hf_asymkv.hub.vllm import read_vllm_scales

pytest.importorskip("compressed_tensors")  # transformers needs it to load the exported config


def _gpt_neox():
    return GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=512)


def _llava():
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=16)  # its encoder has layers.{0,1}.self_attn too
    return LlavaConfig(text_config=llama_config(), vision_config=vision, image_token_index=255)


# (id, config, model class to build, Auto class to load with, the names the export must use for layer i)
CHECKPOINTS = [
    ("llama", llama_config, AutoModelForCausalLM, AutoModelForCausalLM, "model.layers.{i}.self_attn"),
    ("gpt-neox", _gpt_neox, AutoModelForCausalLM, AutoModelForCausalLM, "gpt_neox.layers.{i}.attention"),
    # transformers saves Llava under its original names and renames them on load
    ("llava", _llava, LlavaForConditionalGeneration, AutoModelForImageTextToText,
     "language_model.model.layers.{i}.self_attn"),
]


def _save(folder: Path, make_config, cls) -> Path:
    torch.manual_seed(0)
    config = make_config()
    model = cls.from_config(config) if cls is AutoModelForCausalLM else cls(config)
    model.save_pretrained(folder)
    return folder


def _scales(config) -> KVScales:
    fp = config_fingerprint(config)
    g = torch.Generator().manual_seed(0)
    layers = range(fp["num_hidden_layers"])
    k = {i: torch.rand(fp["num_key_value_heads"], fp["head_dim"], generator=g) + 0.1 for i in layers}
    v = {i: torch.rand(fp["num_key_value_heads"], generator=g) + 0.1 for i in layers}
    return KVScales(k, v, {"fingerprint": json.dumps(fp)})


@pytest.mark.parametrize("make_config, cls, auto, pattern", [c[1:] for c in CHECKPOINTS],
                         ids=[c[0] for c in CHECKPOINTS])
def test_every_scale_lands_on_its_layers_attention_module(tmp_path, make_config, cls, auto, pattern):
    ckpt = _save(tmp_path / "ckpt", make_config, cls)
    out = export_serving_checkpoint(ckpt, _scales(make_config()), tmp_path / "serve")
    with safe_open(str(out / SCALES_SHARD), framework="pt") as f:
        written = set(f.keys())
    assert written == {f"{pattern.format(i=i)}.{kind}_scale" for i in range(2) for kind in "kv"}

    served, info = auto.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # transformers keeps the scales as unexpected keys (compressed-tensors 0.20 attaches none on 5.24+) or as
    # parameters; either way, under the names of the loaded model, each must name its layer's attention module
    parameters = {n for n, _ in served.named_parameters() if n.endswith(("k_scale", "v_scale"))}
    loaded = parameters | set(info["unexpected_keys"])
    assert len(loaded) == 4 and all(n.endswith(("k_scale", "v_scale")) for n in info["unexpected_keys"])
    for name in loaded:
        module = served.get_submodule(name.rsplit(".", 1)[0])
        assert type(module).__name__.endswith("Attention") and f".{module.layer_idx}." in name, name
    assert sorted(read_vllm_scales(out, served.config).k_channel_absmax) == [0, 1]  # and they read back


def test_a_layer_without_an_attention_module_is_refused_with_the_names_found():
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"layer 1: no attention module.*found in the weights: "
                                         r"\['model.layers.0.self_attn'\]"):
        attention_prefixes(llama_config(), names, [0, 1])


def test_two_equally_good_candidates_are_refused():
    names = [f"{root}.layers.{i}.self_attn.{p}_proj.weight" for root in ("a", "b") for i in (0, 1) for p in "qkvo"]
    with pytest.raises(ValueError, match=r"layer 0: ambiguous: a.layers.0.self_attn, b.layers.0.self_attn"):
        attention_prefixes(llama_config(), names, [0, 1])


def test_without_a_transformers_class_the_k_proj_names_are_used(monkeypatch):
    monkeypatch.setattr(attention_names, "attention_modules", lambda config: None)
    names = [f"backbone.blocks.{i}.attn.{p}_proj.weight" for i in (0, 1) for p in "qkv"]
    assert attention_prefixes(llama_config(), names, [0, 1]) == {0: "backbone.blocks.0.attn",
                                                                  1: "backbone.blocks.1.attn"}
    with pytest.raises(ValueError, match=r"from k_proj.weight names .*layer 2: no attention module"):
        attention_prefixes(llama_config(), names, [0, 1, 2])

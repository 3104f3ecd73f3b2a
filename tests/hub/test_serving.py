"""Serving checkpoint (`hf_asymkv.hub.serving`, `export-vllm --model`): the folder holds the source weights
unchanged plus the KV scales in their own listed shard; compressed-tensors validates its ``quantization_config``
and gives its KV parameters the shapes we write; transformers loads it and generates the source model's tokens;
SGLang's JSON; per-head ranges survive; every refusal names its problem; llm-compressor's own output imports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import llama_config
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from hf_asymkv.cli import main
from hf_asymkv.core.scales import FP8_E4M3_MAX, KVScales, config_fingerprint
from hf_asymkv.hub.serving import EXPORT_MARKER, SCALES_SHARD, export_serving_checkpoint
from hf_asymkv.hub.sglang import SGLANG_FILE
from hf_asymkv.hub.vllm import kv_scale_tensors, read_vllm_scales

compressed_tensors = pytest.importorskip("compressed_tensors")  # in the `test` extra: CI always runs these

FIXTURE = Path(__file__).parent / "fixtures" / "llmcompressor_smollm2_kv"
TOKENIZER_FILES = {"tokenizer_config.json": "{}", "special_tokens_map.json": "{}"}  # linked like any other file


def make_scales(config=None, seed: int = 0, layers=None) -> KVScales:
    """Random ranges ``k [kv_heads, head_dim]``, ``v [kv_heads]`` for every layer of ``config``."""
    config = config or llama_config()
    fp = config_fingerprint(config)
    g = torch.Generator().manual_seed(seed)
    layers = range(fp["num_hidden_layers"]) if layers is None else layers
    k = {i: torch.rand(fp["num_key_value_heads"], fp["head_dim"], generator=g) * 5 + 0.1 for i in layers}
    v = {i: torch.rand(fp["num_key_value_heads"], generator=g) * 3 + 0.1 for i in layers}
    return KVScales(k, v, {"fingerprint": json.dumps(fp), "model_id": "org/tiny-llama"})


def save_checkpoint(folder: Path, sharded: bool, config=None) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config or llama_config())
    model.save_pretrained(folder, max_shard_size="40KB" if sharded else "5GB")
    for name, text in TOKENIZER_FILES.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module", params=[False, True], ids=["single-file", "sharded"])
def checkpoint(request, tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def greedy(model) -> list[int]:
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    return model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()


# ------------------------------------------------------------------------------------------ the folder
@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_export_is_a_complete_checkpoint(tmp_path, checkpoint, strategy):
    before = snapshot(checkpoint)
    scales = make_scales()
    out = export_serving_checkpoint(checkpoint, scales, tmp_path / "serve", strategy=strategy)
    assert snapshot(checkpoint) == before  # the source is never written
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    source_shards = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    served_shards = sorted(set(weight_map.values()) - {SCALES_SHARD})
    assert len(served_shards) == len(source_shards)
    total = 0
    for served, source in zip(served_shards, source_shards):
        assert (out / served).read_bytes() == (checkpoint / source).read_bytes()  # same bytes, maybe renamed
        tensors = read_tensors(out / served)
        assert {n for n, s in weight_map.items() if s == served} == set(tensors)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    added = read_tensors(out / SCALES_SHARD)
    assert added.keys() == {n for n, s in weight_map.items() if s == SCALES_SHARD}
    total += sum(t.numel() * t.element_size() for t in added.values())
    assert index["metadata"]["total_size"] == total
    expected = kv_scale_tensors(scales, strategy)
    assert added.keys() == expected.keys() == {f"model.layers.{i}.self_attn.{kind}_scale" for i in range(2)
                                               for kind in "kv"}
    for name, t in added.items():
        assert t.dtype == torch.float32 and torch.equal(t, expected[name])
        assert tuple(t.shape) == ((1,) if strategy == "tensor" else (2, 1, 1))
    for name in TOKENIZER_FILES:
        assert (out / name).read_text() == (checkpoint / name).read_text()
    assert {p.name for p in out.iterdir()} >= {"config.json", "README.md", SGLANG_FILE, EXPORT_MARKER,
                                               "generation_config.json"}
    readme = (out / "README.md").read_text()
    assert "--kv-cache-dtype fp8" in readme and "sglang.launch_server" in readme and strategy in readme
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_compressed_tensors_accepts_the_config_and_our_shapes(tmp_path, checkpoint, strategy):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams

    out = export_serving_checkpoint(checkpoint, make_scales(), tmp_path / "serve", strategy=strategy)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.quant_method == "compressed-tensors" and parsed.config_groups == {}
    assert parsed.kv_cache_scheme.strategy == strategy and parsed.kv_cache_scheme.num_bits == 8
    assert parsed.kv_cache_scheme.type == "float" and parsed.kv_cache_scheme.symmetric
    # the parameter compressed-tensors allocates for an attention module's k_scale has our tensor's shape
    module = torch.nn.Module()
    fp = config_fingerprint(llama_config())
    initialize_qparams(module, "k", parsed.kv_cache_scheme, observed_shape=(fp["num_key_value_heads"], None,
                                                                             fp["head_dim"]),
                       observed_dtype=torch.float32, force_zero_point=False)
    ours = read_tensors(out / SCALES_SHARD)["model.layers.0.self_attn.k_scale"]
    assert module.k_scale.shape == ours.shape


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_transformers_loads_it_and_generates_the_same_tokens(tmp_path, checkpoint, strategy):
    scales = make_scales()
    out = export_serving_checkpoint(checkpoint, scales, tmp_path / "serve", strategy=strategy)
    source = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    served, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(served.config.quantization_config).__name__ == "CompressedTensorsConfig"
    assert not info["missing_keys"] and not info["mismatched_keys"]
    for (name, a), (_, b) in zip(source.state_dict().items(), served.state_dict().items()):
        assert torch.equal(a, b), name
    assert greedy(served.eval()) == greedy(source)
    ours = kv_scale_tensors(scales, strategy)
    attached = {n: p for n, p in served.named_parameters() if n.endswith(("k_scale", "v_scale"))}
    if attached:  # compressed-tensors recognized the attention modules: the values it holds are ours
        assert attached.keys() == ours.keys()
        for name, p in attached.items():
            assert torch.allclose(p.float().reshape(-1), ours[name].reshape(-1))
    else:  # compressed-tensors <= 0.20 looks for a `past_key_values` argument; transformers >= 5.24 names it
        assert set(info["unexpected_keys"]) == set(ours)  # `cache`, so the scales stay unused extra keys


def test_per_head_export_keeps_each_heads_range(tmp_path, checkpoint):
    scales = make_scales()
    scales.k_channel_absmax[1] = torch.ones(2, 16)
    scales.k_channel_absmax[1][1] *= 10  # head 0 spans 1, head 1 spans 10
    scales.v_head_absmax[1] = torch.tensor([1.0, 10.0])
    out = export_serving_checkpoint(checkpoint, scales, tmp_path / "heads", strategy="attn_head")
    added = read_tensors(out / SCALES_SHARD)
    for kind in "kv":
        assert added[f"model.layers.1.self_attn.{kind}_scale"].reshape(-1).tolist() == pytest.approx(
            [1 / FP8_E4M3_MAX, 10 / FP8_E4M3_MAX])
    back = read_vllm_scales(out, llama_config())  # our reader takes per-head scales back per head
    assert back.v_head_absmax[1].tolist() == pytest.approx([1.0, 10.0])
    assert back.k_channel_absmax[1][:, 0].tolist() == pytest.approx([1.0, 10.0])
    assert back.metadata["source"] == "vllm-per-head"
    flat = export_serving_checkpoint(checkpoint, scales, tmp_path / "flat", strategy="tensor")
    assert read_tensors(flat / SCALES_SHARD)["model.layers.1.self_attn.k_scale"].tolist() == pytest.approx(
        [10 / FP8_E4M3_MAX])


@pytest.mark.parametrize("tp_size", [1, 2])
def test_sglang_json(tmp_path, checkpoint, tp_size):
    scales = make_scales()
    out = export_serving_checkpoint(checkpoint, scales, tmp_path / "serve", tp_size=tp_size)
    doc = json.loads((out / SGLANG_FILE).read_text())
    assert doc["model_type"] == "llama" and doc["kv_cache"]["dtype"] == "float8_e4m3fn"
    ranks = doc["kv_cache"]["scaling_factor"]
    assert list(ranks) == [str(r) for r in range(tp_size)]
    for layers in ranks.values():
        assert list(layers) == ["0", "1"]  # every layer, as the loader checks
        for i, value in layers.items():  # one multiplier for K and V: it must cover both ranges
            assert value == pytest.approx(max(scales.k_scale(int(i)), scales.v_scale(int(i))))


def test_merges_into_an_existing_compressed_tensors_config(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    ckpt = save_checkpoint(tmp_path / "ckpt", sharded=False)
    config = json.loads((ckpt / "config.json").read_text())
    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                             "symmetric": True, "dynamic": False}}}
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "quantization_status": "compressed", "config_groups": groups,
                                     "ignore": ["lm_head"]}
    (ckpt / "config.json").write_text(json.dumps(config))
    out = export_serving_checkpoint(ckpt, make_scales(), tmp_path / "serve", strategy="attn_head")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"] == groups and qc["ignore"] == ["lm_head"] and qc["format"] == "float-quantized"
    assert QuantizationConfig.model_validate(qc).kv_cache_scheme.strategy == "attn_head"


# ------------------------------------------------------------------------------------------ refusals
def _other(**changes):
    config = llama_config()
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("case, message", [
    ("layers", r"fingerprint 'num_hidden_layers' is 3 in the scales file but 2 in the model"),
    ("kv-heads", r"fingerprint 'num_key_value_heads' is 1 in the scales file but 2 in the model"),
    ("architecture", r"fingerprint 'model_type' is 'mistral' in the scales file but 'llama' in the model"),
    ("missing-layer", r"the scales have no ranges for layers \[1\]"),
    ("has-kv-scales", r"already holds KV scales \(model.layers.0.self_attn.k_scale"),
    ("other-quant", r"has a 'gptq' quantization_config"),
    ("ct-rejects", "compressed-tensors rejects the quantization_config"),
    ("no-weights", r"no model.safetensors or model.safetensors.index.json"),
    ("corrupt-weights", r"model.safetensors: not a readable safetensors file"),
    ("no-config", r"not a checkpoint folder \(no config.json\)"),
    ("strategy", r"strategy must be one of \['tensor', 'attn_head'\], got 'channel'"),
    ("tp-size", "tp_size must be a positive integer, got 0"),
    ("out-not-empty", "exists and is not empty"),
], ids=lambda x: x if " " not in x and "\\" not in x else "")
def test_refusals_name_the_problem(tmp_path, case, message):
    from safetensors.torch import save_file

    ckpt = save_checkpoint(tmp_path / "ckpt", sharded=False)
    scales, kwargs = make_scales(), {}
    if case == "layers":
        scales = make_scales(_other(num_hidden_layers=3))
    elif case == "kv-heads":
        scales = make_scales(_other(num_key_value_heads=1))
    elif case == "architecture":
        from transformers import MistralConfig

        scales = make_scales(MistralConfig(**{k: v for k, v in llama_config().to_dict().items()
                                              if k not in ("model_type", "architectures")}))
    elif case == "missing-layer":
        scales = make_scales(layers=[0])
    elif case == "has-kv-scales":
        save_file({"model.layers.0.self_attn.k_scale": torch.ones(1)}, str(ckpt / "extra.safetensors"))
        index = {"metadata": {}, "weight_map": {"model.layers.0.self_attn.k_scale": "extra.safetensors",
                                                **{n: "model.safetensors" for n in read_tensors(ckpt / "model.safetensors")}}}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    elif case in ("other-quant", "ct-rejects"):
        config = json.loads((ckpt / "config.json").read_text())
        config["quantization_config"] = ({"quant_method": "gptq", "bits": 4} if case == "other-quant" else
                                         {"quant_method": "compressed-tensors", "config_groups": {"g": 42}})
        (ckpt / "config.json").write_text(json.dumps(config))
    elif case == "no-weights":
        (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    elif case == "corrupt-weights":
        (ckpt / "model.safetensors").write_bytes(b"\x00" * 10)
    elif case == "no-config":
        (ckpt / "config.json").unlink()
    elif case == "strategy":
        kwargs["strategy"] = "channel"
    elif case == "tp-size":
        kwargs["tp_size"] = 0
    elif case == "out-not-empty":
        (tmp_path / "serve").mkdir()
        (tmp_path / "serve" / "x").write_text("x")
    before = snapshot(ckpt)
    with pytest.raises(ValueError, match=message):
        export_serving_checkpoint(ckpt, scales, tmp_path / "serve", **kwargs)
    assert snapshot(ckpt) == before
    assert not (tmp_path / "serve").exists() or case == "out-not-empty"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_failure_leaves_nothing_and_overwrite_replaces_an_export(tmp_path, monkeypatch):
    import hf_asymkv.hub.serving as serving

    ckpt = save_checkpoint(tmp_path / "ckpt", sharded=True)
    out = export_serving_checkpoint(ckpt, make_scales(seed=0), tmp_path / "serve")
    export_serving_checkpoint(ckpt, make_scales(seed=1), out, overwrite=True)
    assert read_tensors(out / SCALES_SHARD)["model.layers.0.self_attn.k_scale"].item() == pytest.approx(
        make_scales(seed=1).k_scale(0))
    monkeypatch.setattr(serving, "_readme", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        export_serving_checkpoint(ckpt, make_scales(seed=2), tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "serve"]


def test_written_files_get_the_usual_permissions_and_narrow_links_are_noted(tmp_path, capsys):
    """safetensors writes 0600: the scales shard must not stay so; linked weights share the source's mode, which
    the CLI says."""
    from hf_asymkv.core.fileio import usual_mode

    ckpt = save_checkpoint(tmp_path / "ckpt", sharded=False)
    (ckpt / "model.safetensors").chmod(0o600)
    scales = make_scales().save(tmp_path / "kv_scales.safetensors")
    assert main(["export-vllm", "--scales", str(scales), "--model", str(ckpt), "--out", str(tmp_path / "serve")]) == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "serve").iterdir()}
    assert modes.pop("model-00001-of-00001.safetensors") == 0o600
    assert set(modes.values()) == {usual_mode()}, modes
    assert "note: model-00001-of-00001.safetensors keep the permissions of the checkpoint's files" in \
        capsys.readouterr().err
    assert main(["export-vllm", "--scales", str(scales), "--out", str(tmp_path / "only")]) == 0
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "only").iterdir()} == {usual_mode()}


def test_weights_are_hard_links_when_the_file_system_allows(tmp_path):
    ckpt = save_checkpoint(tmp_path / "ckpt", sharded=True)
    out = export_serving_checkpoint(ckpt, make_scales(), tmp_path / "serve")
    marker = json.loads((out / EXPORT_MARKER).read_text())
    linked = [name for name, how in marker["files"].items() if how == "linked"]
    assert linked and all(os.path.samefile(out / name, ckpt / name) for name in linked)


# ------------------------------------------------------------------------------------------ CLI
def test_cli_export_with_model(tmp_path, capsys):
    ckpt = save_checkpoint(tmp_path / "ckpt", sharded=False)
    scales = make_scales().save(tmp_path / "kv_scales.safetensors")
    out = tmp_path / "serve"
    argv = ["export-vllm", "--scales", str(scales), "--model", str(ckpt), "--out", str(out), "--strategy", "attn_head",
            "--tp-size", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"vllm serve {out} --kv-cache-dtype fp8" in printed
    assert json.loads((out / EXPORT_MARKER).read_text())["strategy"] == "attn_head"
    assert list(json.loads((out / SGLANG_FILE).read_text())["kv_cache"]["scaling_factor"]) == ["0", "1"]


@pytest.mark.parametrize("case, message", [
    ("gguf", "a GGUF file cannot carry the scales"),
    ("strategy-without-model", "--strategy attn_head and --tp-size need --model"),
    ("strategy-with-import", "--strategy and --tp-size shape an export"),
    ("fingerprint", "fingerprint 'num_hidden_layers' is 3"),
], ids=["gguf", "strategy-without-model", "strategy-with-import", "fingerprint"])
def test_cli_export_refusals_exit_2(tmp_path, capsys, case, message):
    ckpt = save_checkpoint(tmp_path / "ckpt", sharded=False)
    scales = make_scales(_other(num_hidden_layers=3) if case == "fingerprint" else None)
    path = scales.save(tmp_path / "kv_scales.safetensors")
    argv = ["export-vllm", "--scales", str(path), "--model", str(ckpt), "--out", str(tmp_path / "serve")]
    if case == "gguf":
        argv[4] = str(tmp_path / "model.gguf")
        (tmp_path / "model.gguf").write_bytes(b"GGUF")
    elif case == "strategy-without-model":
        argv = argv[:3] + ["--out", str(tmp_path / "serve"), "--strategy", "attn_head"]
    elif case == "strategy-with-import":
        argv = ["export-vllm", "--from-checkpoint", str(ckpt), "--out", str(tmp_path / "x.safetensors"),
                "--strategy", "tensor"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "serve").exists()


# ------------------------------------------------------------------------------------------ llm-compressor
def test_llmcompressor_fixture_imports_and_exports_back_the_same_tensors(tmp_path, capsys):
    """scripts/studies/llmcompressor_kv_fixture.py made the fixture: llm-compressor's config and kv scales for SmolLM2."""
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((FIXTURE / "config.json").read_text())
    parsed = QuantizationConfig.model_validate(config["quantization_config"])
    assert parsed.kv_cache_scheme.strategy == "tensor" and parsed.config_groups == {}
    out = tmp_path / "imported.safetensors"
    assert main(["export-vllm", "--from-checkpoint", str(FIXTURE), "--out", str(out)]) == 0
    assert "30 layers; per-tensor (imported)" in capsys.readouterr().out
    theirs = read_tensors(FIXTURE / "kv_scales.safetensors")
    ours = kv_scale_tensors(KVScales.load(out), "tensor")  # what export-vllm --model would write again
    assert ours.keys() == theirs.keys() and len(ours) == 2 * config["num_hidden_layers"]
    for name, t in theirs.items():
        assert ours[name].shape == t.shape == (1,) and torch.allclose(ours[name], t.float(), rtol=1e-6), name
    # and our quantization_config for it equals llm-compressor's in every field vLLM reads
    from hf_asymkv.hub.serving import merged_quantization_config

    mine = QuantizationConfig.model_validate(merged_quantization_config(None, "tensor"))
    assert mine.kv_cache_scheme == parsed.kv_cache_scheme and mine.format == parsed.format
    assert mine.quantization_status == parsed.quantization_status

"""vLLM interchange (`hf_asymkv.hub.vllm`): the export holds exactly vLLM's per-tensor FP8 scale tensors (names,
0-dim float32, ``amax / 448``), the ``kv_cache_scheme`` snippet and a how-to; the reader accepts llm-compressor /
vLLM / ModelOpt / older compressed-tensors names in single or sharded files, round-trips our export, and names
the file or layer of every malformed input; the ``export-vllm`` CLI in both directions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import llama_config
from helpers import cli_exit_code
from safetensors import safe_open
from safetensors.torch import save_file

from hf_asymkv.cli import main
from hf_asymkv.core.scales import FP8_E4M3_MAX, KVScales, config_fingerprint
from hf_asymkv.hub.vllm import KV_CACHE_SCHEME, export_vllm, read_vllm_scales

LAYERS, HEADS, HEAD_DIM = 2, 2, 16


def make_scales(seed: int = 0) -> KVScales:
    g = torch.Generator().manual_seed(seed)
    k = {i: torch.rand(HEADS, HEAD_DIM, generator=g) * 5 + 0.1 for i in range(LAYERS)}
    v = {i: torch.rand(HEADS, generator=g) * 3 + 0.1 for i in range(LAYERS)}
    meta = {"fingerprint": json.dumps(config_fingerprint(llama_config())), "model_id": "org/tiny-llama"}
    return KVScales(k, v, meta)


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def _listing(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    llama_config().save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("as_path", [False, True], ids=["object", "file"])
def test_export_has_only_vllm_per_tensor_scales(tmp_path, as_path):
    scales = make_scales()
    source = scales.save(tmp_path / "ours.safetensors") if as_path else scales
    out = export_vllm(source, tmp_path / "vllm")
    assert _listing(out) == {"kv_scales.safetensors", "kv_cache_scheme.json", "README.md"}
    tensors, meta = read(out / "kv_scales.safetensors")
    assert set(tensors) == {f"model.layers.{i}.self_attn.{kind}_scale" for i in range(LAYERS) for kind in "kv"}
    for i in range(LAYERS):
        k, v = tensors[f"model.layers.{i}.self_attn.k_scale"], tensors[f"model.layers.{i}.self_attn.v_scale"]
        for t in (k, v):
            assert t.dtype == torch.float32 and t.dim() == 0
        assert k.item() == pytest.approx(float(scales.k_channel_absmax[i].max()) / FP8_E4M3_MAX, rel=1e-6)
        assert v.item() == pytest.approx(float(scales.v_head_absmax[i].max()) / FP8_E4M3_MAX, rel=1e-6)
    assert meta["format"] == "pt"  # what transformers expects of a checkpoint shard the tensors are merged into
    assert json.loads((out / "kv_cache_scheme.json").read_text()) == KV_CACHE_SCHEME == {
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                            "symmetric": True}}
    readme = (out / "README.md").read_text()
    assert "vllm serve CHECKPOINT --kv-cache-dtype fp8_e4m3" in readme
    assert "one per-tensor scale for K and one for V per layer" in readme and "quantization_config" in readme
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_export_checks_the_model_when_given(tmp_path):
    other = llama_config()
    other.num_hidden_layers = 1
    with pytest.raises(ValueError, match="model has 1 layers"):
        export_vllm(make_scales(), tmp_path / "vllm", config=other)
    assert not (tmp_path / "vllm").exists()


def test_export_refuses_a_non_empty_folder_and_replaces_an_earlier_export(tmp_path):
    out = export_vllm(make_scales(0), tmp_path / "vllm")
    with pytest.raises(ValueError, match="exists and is not empty"):
        export_vllm(make_scales(1), out)
    export_vllm(make_scales(1), out, overwrite=True)
    tensors, _ = read(out / "kv_scales.safetensors")
    assert tensors["model.layers.0.self_attn.k_scale"].item() == pytest.approx(make_scales(1).k_scale(0), rel=1e-6)
    foreign = tmp_path / "checkpoint"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match="refusing to replace"):
        export_vllm(make_scales(), foreign, overwrite=True)
    assert _listing(foreign) == {"model.safetensors"}


def test_export_failure_leaves_nothing(tmp_path, monkeypatch):
    import hf_asymkv.hub.vllm as vllm_mod

    monkeypatch.setattr(vllm_mod, "_readme", lambda scales: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        export_vllm(make_scales(), tmp_path / "vllm")
    assert _listing(tmp_path) == set()


# ------------------------------------------------------------------------------------------------ reader
def test_reader_round_trips_our_export(tmp_path):
    scales = make_scales()
    out = export_vllm(scales, tmp_path / "vllm")
    back = read_vllm_scales(out, llama_config(), model_id="org/tiny-llama")
    assert sorted(back.k_channel_absmax) == list(range(LAYERS))
    for i in range(LAYERS):
        assert back.k_channel_absmax[i].shape == (HEADS, HEAD_DIM) and back.v_head_absmax[i].shape == (HEADS,)
        assert torch.allclose(back.k_channel_absmax[i], scales.k_channel_absmax[i].max().expand(HEADS, HEAD_DIM),
                              rtol=1e-6)
        assert torch.allclose(back.v_head_absmax[i], scales.v_head_absmax[i].max().expand(HEADS), rtol=1e-6)
        assert back.k_scale(i) == pytest.approx(scales.k_scale(i), rel=1e-6)
    assert back.metadata["source"] == "vllm-per-tensor" and back.metadata["model_id"] == "org/tiny-llama"
    assert back.fingerprint == config_fingerprint(llama_config())
    loaded = KVScales.load(back.save(tmp_path / "ours.safetensors"), llama_config())  # a valid scales file
    assert loaded.metadata["statistic"] == "per-tensor (imported)"
    again = export_vllm(loaded, tmp_path / "vllm2")
    first, second = read(out / "kv_scales.safetensors")[0], read(again / "kv_scales.safetensors")[0]
    assert all(second[n].item() == pytest.approx(first[n].item(), rel=1e-6) for n in first)


NAMES = {
    "llm-compressor": "model.layers.{i}.self_attn.{kind}_scale",
    "vllm-attn": "model.layers.{i}.self_attn.attn.{kind}_scale",
    "old-output-scale": "model.layers.{i}.self_attn.{kind}_proj.output_scale",
    "modelopt": "model.layers.{i}.self_attn.{kind}_proj.{kind}_scale",
    "multimodal": "model.language_model.layers.{i}.self_attn.{kind}_scale",
}


@pytest.mark.parametrize("style", list(NAMES), ids=list(NAMES))
@pytest.mark.parametrize("shape, dtype", [((), torch.float32), ((1,), torch.bfloat16)],
                         ids=["0dim-f32", "1elem-bf16"])
def test_reader_accepts_checkpoint_styles_in_sharded_files(tmp_path, style, shape, dtype):
    values = {(0, "k"): 0.02, (0, "v"): 0.005, (1, "k"): 0.03125, (1, "v"): 0.0078125}
    shards = [{}, {}]
    for (i, kind), value in values.items():
        shards[i][NAMES[style].format(i=i, kind=kind)] = torch.full(shape, value, dtype=dtype)
        shards[i][f"model.layers.{i}.self_attn.{kind}_proj.weight"] = torch.randn(32, 64)  # ignored
    for n, shard in enumerate(shards):
        save_file(shard, str(tmp_path / f"model-0000{n + 1}-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    scales = read_vllm_scales(tmp_path, llama_config())
    for (i, kind), value in values.items():
        t = scales.k_channel_absmax[i] if kind == "k" else scales.v_head_absmax[i]
        expected = float(torch.tensor(value, dtype=dtype)) * FP8_E4M3_MAX
        assert torch.allclose(t, torch.full_like(t, expected), rtol=1e-6)
    assert json.loads(scales.metadata["source_files"]) == ["model-00001-of-00002.safetensors",
                                                           "model-00002-of-00002.safetensors"]


def _checkpoint(tmp_path: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    save_file(tensors, str(tmp_path / name))
    return tmp_path


def _full(i_values: dict[str, float]) -> dict[str, torch.Tensor]:
    return {f"model.layers.{name}": torch.tensor(v) for name, v in i_values.items()}


GOOD = {"0.self_attn.k_scale": 0.02, "0.self_attn.v_scale": 0.01, "1.self_attn.k_scale": 0.02,
        "1.self_attn.v_scale": 0.01}


@pytest.mark.parametrize("case, message", [
    ("no-files", r"no \.safetensors files in this folder"),
    ("no-scales", "no per-tensor KV scales found"),
    ("missing-layer", r"incomplete KV scales \(2 missing\): layer 1: no k_scale; layer 1: no v_scale"),
    ("missing-v", r"incomplete KV scales \(1 missing\): layer 0: no v_scale"),
    ("zero", r"model.safetensors: model.layers.0.self_attn.k_scale \(layer 0\): k_scale must be finite and > 0"),
    ("negative", r"\(layer 1\): v_scale must be finite and > 0, got -0.5"),
    ("nan", r"\(layer 0\): k_scale must be finite and > 0, got nan"),
    ("inf", r"\(layer 1\): k_scale must be finite and > 0, got inf"),
    ("per-head", r"\(layer 0\): k_scale: expected a per-tensor scale \(shape \[\] or \[1\]\) or one per KV head "
                 r"\(\[2\] or \[2, 1, 1\]\), got shape \[3\]"),
    ("beyond", r"scales for layers \[5\], but the model has 2 layers"),
    ("conflict", "layer 1: conflicting k_scale values"),
    ("corrupt", "model.safetensors: not a readable safetensors file"),
    ("two-prefixes", "several module prefixes"),
], ids=["no-files", "no-scales", "missing-layer", "missing-v", "zero", "negative", "nan", "inf", "per-head", "beyond",
        "conflict", "corrupt", "two-prefixes"])
def test_reader_names_the_problem(tmp_path, case, message):
    tensors = _full(GOOD)
    if case == "no-files":
        (tmp_path / "config.json").write_text("{}")
    elif case == "corrupt":
        (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    else:
        if case == "no-scales":
            tensors = {"model.layers.0.self_attn.k_proj.weight": torch.ones(2, 2)}
        elif case == "missing-layer":
            tensors = _full({k: v for k, v in GOOD.items() if k.startswith("0.")})
        elif case == "missing-v":
            del tensors["model.layers.0.self_attn.v_scale"]
        elif case in ("zero", "nan"):
            tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0 if case == "zero" else float("nan"))
        elif case == "negative":
            tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(-0.5)
        elif case == "inf":
            tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(float("inf"))
        elif case == "per-head":
            tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.02, 0.03, 0.04])  # 3 != 2 kv heads
        elif case == "beyond":
            tensors |= _full({"5.self_attn.k_scale": 0.02, "5.self_attn.v_scale": 0.01})
        elif case == "conflict":
            save_file({"model.layers.1.self_attn.attn.k_scale": torch.tensor(0.5)},
                      str(tmp_path / "extra.safetensors"))
        elif case == "two-prefixes":
            tensors |= {"model.language_model.layers.0.self_attn.k_scale": torch.tensor(0.02)}
        _checkpoint(tmp_path, tensors)
    with pytest.raises(ValueError, match=message):
        read_vllm_scales(tmp_path, llama_config())


def test_reader_single_file_and_missing_path(tmp_path):
    path = _checkpoint(tmp_path, _full(GOOD)) / "model.safetensors"
    assert sorted(read_vllm_scales(path, llama_config()).k_channel_absmax) == [0, 1]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_vllm_scales(tmp_path / "nope", llama_config())


def test_duplicate_equal_scales_under_two_names_are_fine(tmp_path):
    tensors = _full(GOOD) | {"model.layers.0.self_attn.k_proj.output_scale": torch.tensor(0.02)}
    assert read_vllm_scales(_checkpoint(tmp_path, tensors), llama_config()).k_scale(0) == pytest.approx(0.02)


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_export_and_import(tmp_path, model_dir, capsys):
    ours = make_scales().save(tmp_path / "kv_scales.safetensors")
    assert main(["export-vllm", "--scales", str(ours), "--out", str(tmp_path / "vllm")]) == 0  # scales only
    assert "kv_cache_scheme.json" in capsys.readouterr().out
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "vllm" / "kv_scales.safetensors").rename(ckpt / "model.safetensors")
    out = tmp_path / "imported.safetensors"
    assert main(["export-vllm", "--from-checkpoint", str(ckpt), "--model", str(model_dir), "--out", str(out)]) == 0
    assert "2 layers" in capsys.readouterr().out
    back = KVScales.load(out, llama_config())
    assert back.k_scale(1) == pytest.approx(make_scales().k_scale(1), rel=1e-6)
    # --model may be left out when the checkpoint has its own config.json
    llama_config().save_pretrained(ckpt)
    assert main(["export-vllm", "--from-checkpoint", str(ckpt), "--out", str(out), "--overwrite"]) == 0


@pytest.mark.parametrize("case, message", [
    ("missing-scales", "error: --scales: no such file or folder: '.*nope.safetensors'"),
    ("not-our-file", "not an hf_asymkv scales file"),
    ("wrong-model", "fingerprint 'num_hidden_layers' is 2 in the scales file but 1 in the model"),
    ("non-empty-out", "exists and is not empty"),
    ("ckpt-missing", "error: --from-checkpoint: no such file or folder: '.*nowhere'"),
    ("ckpt-no-model", "--from-checkpoint needs --model"),
    ("ckpt-out-exists", "exists; pass --overwrite"),
    ("ckpt-no-scales", "no per-tensor KV scales found"),
], ids=["missing-scales", "not-our-file", "wrong-model", "non-empty-out", "ckpt-missing", "ckpt-no-model",
        "ckpt-out-exists", "ckpt-no-scales"])
def test_cli_export_bad_input_exits_2(tmp_path, model_dir, capsys, case, message):
    ours = make_scales().save(tmp_path / "kv_scales.safetensors")
    (tmp_path / "ckpt").mkdir()
    ckpt = _checkpoint(tmp_path / "ckpt", _full(GOOD))
    out = tmp_path / "out"
    argv = ["export-vllm", "--scales", str(ours), "--out", str(out)]
    if case == "missing-scales":
        argv[2] = str(tmp_path / "nope.safetensors")
    elif case == "not-our-file":
        argv[2] = str(ckpt / "model.safetensors")
    elif case == "wrong-model":
        one = tmp_path / "one-layer"
        cfg = llama_config()
        cfg.num_hidden_layers = 1
        cfg.save_pretrained(one)
        argv += ["--model", str(one)]
    elif case == "non-empty-out":
        out.mkdir()
        (out / "x").write_text("x")
    else:
        argv = ["export-vllm", "--from-checkpoint", str(ckpt), "--model", str(model_dir), "--out", str(out)]
        if case == "ckpt-missing":
            argv[2] = str(tmp_path / "nowhere")
        elif case == "ckpt-no-model":
            del argv[3:5]
        elif case == "ckpt-out-exists":
            out.write_text("x")
        elif case == "ckpt-no-scales":
            (ckpt / "model.safetensors").unlink()
            save_file({"lm_head.weight": torch.ones(2, 2)}, str(ckpt / "model.safetensors"))
    assert cli_exit_code(argv) == 2
    err = capsys.readouterr().err
    assert "error: " in err and re.search(message, err), err
    if case not in ("non-empty-out", "ckpt-out-exists"):
        assert not out.exists()


def test_cli_export_needs_exactly_one_source(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["export-vllm", "--out", str(tmp_path / "x")])
    assert info.value.code == 2
    assert "one of the arguments --scales --from-checkpoint is required" in capsys.readouterr().err


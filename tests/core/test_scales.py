"""`KVScales` and the ``kv_scales.safetensors`` file: round trip, vLLM-compatible names, atomic writes, and a
``ValueError`` naming the cause for every malformed or foreign file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import _COMMON, llama_config
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig

import hf_asymkv.core.scales as scales_mod
from hf_asymkv.core.scales import FP8_E4M3_MAX, SCALES_FORMAT, SCALES_FORMAT_VERSION, KVScales, config_fingerprint

LAYERS, HEADS, HEAD_DIM = 2, 2, 16
PREFIX = "model.layers.{}.self_attn."


def make_scales(config=None, seed: int = 0, layers: int = LAYERS, heads: int = HEADS, head_dim: int = HEAD_DIM,
                **meta) -> KVScales:
    """Random positive ranges, with the fingerprint of ``config`` (the tiny Llama by default)."""
    g = torch.Generator().manual_seed(seed)
    k = {i: torch.rand(heads, head_dim, generator=g) * 5 + 0.1 for i in range(layers)}
    v = {i: torch.rand(heads, generator=g) * 3 + 0.1 for i in range(layers)}
    fp = config_fingerprint(config or llama_config())
    return KVScales(k, v, {"fingerprint": json.dumps(fp), "model_id": "tiny-llama", "statistic": "absmax", **meta})


def read_raw(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


@pytest.fixture
def good(tmp_path) -> Path:
    return make_scales().save(tmp_path / "kv_scales.safetensors")


# ------------------------------------------------------------------------------------------------ round trip
def test_round_trip_keeps_tensors_and_metadata(tmp_path):
    scales = make_scales(data="wiki.txt", num_samples="4")
    path = scales.save(tmp_path / "sub" / "kv.safetensors")  # missing folders are created
    assert path == tmp_path / "sub" / "kv.safetensors"
    for arg in (path, str(path)):
        loaded = KVScales.load(arg, config=llama_config())
        assert sorted(loaded.k_channel_absmax) == sorted(loaded.v_head_absmax) == list(range(LAYERS))
        for i in range(LAYERS):
            assert torch.equal(loaded.k_channel_absmax[i], scales.k_channel_absmax[i])
            assert torch.equal(loaded.v_head_absmax[i], scales.v_head_absmax[i])
        assert {k: loaded.metadata[k] for k in scales.metadata} == scales.metadata
        assert loaded.metadata["format"] == SCALES_FORMAT and loaded.metadata["format_version"] == SCALES_FORMAT_VERSION
        assert loaded.fingerprint == config_fingerprint(llama_config())


def test_file_layout_has_vllm_scalars(good):
    tensors, meta = read_raw(good)
    scales = make_scales()
    expected_names = {PREFIX.format(i) + leaf for i in range(LAYERS)
                      for leaf in ("k_scale", "v_scale", "k_channel_absmax", "v_head_absmax")}
    assert set(tensors) == expected_names
    assert all(t.dtype == torch.float32 for t in tensors.values())
    for i in range(LAYERS):
        p = PREFIX.format(i)
        k_scale, v_scale = tensors[p + "k_scale"], tensors[p + "v_scale"]
        assert k_scale.dim() == 0 and v_scale.dim() == 0
        assert k_scale.item() == pytest.approx(scales.k_channel_absmax[i].max().item() / FP8_E4M3_MAX, rel=1e-6)
        assert v_scale.item() == pytest.approx(scales.v_head_absmax[i].max().item() / FP8_E4M3_MAX, rel=1e-6)
        assert k_scale.item() == pytest.approx(scales.k_scale(i), rel=1e-6)
        assert tensors[p + "k_channel_absmax"].shape == (HEADS, HEAD_DIM)
        assert tensors[p + "v_head_absmax"].shape == (HEADS,)
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["format"] == SCALES_FORMAT


def test_metadata_cannot_override_the_format_stamp(tmp_path):
    scales = make_scales(format="something-else", format_version="0")
    _, meta = read_raw(scales.save(tmp_path / "kv.safetensors"))
    assert meta["format"] == SCALES_FORMAT and meta["format_version"] == SCALES_FORMAT_VERSION


def test_loaded_scales_save_again_identically(good, tmp_path):
    again = KVScales.load(good).save(tmp_path / "again.safetensors")
    (t1, m1), (t2, m2) = read_raw(good), read_raw(again)
    assert m1 == m2 and t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)


# ------------------------------------------------------------------------------------------------ atomic writes
class _Boom(Exception):
    pass


def _half_writer(exc_type):
    def write(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 100)  # half a file, then the failure
        raise exc_type("disk full")
    return write


def _folder_listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("exc_type", [_Boom, KeyboardInterrupt, OSError], ids=["error", "interrupt", "oserror"])
def test_failed_write_leaves_nothing(tmp_path, monkeypatch, exc_type):
    monkeypatch.setattr(scales_mod, "save_file", _half_writer(exc_type))
    dest = tmp_path / "kv.safetensors"
    with pytest.raises(exc_type):
        make_scales().save(dest)
    assert not dest.exists()
    assert _folder_listing(tmp_path) == []  # no temp file left behind


@pytest.mark.parametrize("exc_type", [_Boom, KeyboardInterrupt], ids=["error", "interrupt"])
def test_failed_write_keeps_existing_file_intact(good, monkeypatch, exc_type):
    before = good.read_bytes()
    monkeypatch.setattr(scales_mod, "save_file", _half_writer(exc_type))
    with pytest.raises(exc_type):
        make_scales(seed=1).save(good)
    assert good.read_bytes() == before
    assert _folder_listing(good.parent) == [good.name]
    KVScales.load(good, config=llama_config())


def test_invalid_scales_are_refused_before_writing(tmp_path):
    scales = make_scales()
    scales.k_channel_absmax[1][0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"layer 1: k_channel_absmax has NaN"):
        scales.save(tmp_path / "kv.safetensors")
    assert _folder_listing(tmp_path) == []


def test_successful_overwrite_replaces_the_file(good):
    new = make_scales(seed=3)
    new.save(good)
    loaded = KVScales.load(good)
    assert torch.equal(loaded.k_channel_absmax[0], new.k_channel_absmax[0])
    assert _folder_listing(good.parent) == [good.name]


# ------------------------------------------------------------------------------------------------ malformed files
def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a valid file through ``edit(tensors, metadata)`` (mutating in place)."""
    tensors, meta = read_raw(src)
    edit(tensors, meta)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst), metadata=meta)
    return dst


def _set(layer: int, leaf: str, value):
    def edit(tensors, meta):
        name = PREFIX.format(layer) + leaf
        if callable(value):
            tensors[name] = value(tensors[name])
        else:
            tensors[name] = value
    return edit


def _poke(layer: int, leaf: str, value: float):
    def change(t):
        t = t.clone()
        t.view(-1)[0] = value
        return t
    return _set(layer, leaf, change)


def _drop(*names):
    def edit(tensors, meta):
        for n in names:
            del tensors[n]
    return edit


def _meta(**changes):
    def edit(tensors, meta):
        for k, v in changes.items():
            if v is None:
                meta.pop(k, None)
            else:
                meta[k] = v
    return edit


def _bytes(make):
    def build(good: Path, dst: Path) -> Path:
        dst.write_bytes(make(good))
        return dst
    return build


def _edited(edit):
    return lambda good, dst: _rewrite(good, dst, edit)


def _foreign(good: Path, dst: Path) -> Path:
    save_file({"model.embed_tokens.weight": torch.randn(4, 4)}, str(dst))
    return dst


def _foreign_with_metadata(good: Path, dst: Path) -> Path:
    save_file({"weight": torch.randn(4, 4)}, str(dst), metadata={"format": "pt"})
    return dst


def _empty_tensors(good: Path, dst: Path) -> Path:
    _, meta = read_raw(good)
    save_file({}, str(dst), metadata=meta)
    return dst


MALFORMED = [
    # (id, build(good, dst) -> path, regex the message must match)
    ("truncated", _bytes(lambda g: g.read_bytes()[: len(g.read_bytes()) // 2]), r"not a readable safetensors"),
    ("truncated-tail", _bytes(lambda g: g.read_bytes()[:-8]), r"not a readable safetensors"),
    ("random-bytes", _bytes(lambda g: torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(0))
                            .to(torch.uint8).numpy().tobytes()), r"not a readable safetensors"),
    ("text-file", _bytes(lambda g: b"layer,k_scale\n0,0.01\n1,0.02\n" * 20), r"not a readable safetensors"),
    ("empty-file", _bytes(lambda g: b""), r"not a readable safetensors"),
    ("foreign-safetensors", _foreign, r"not an hf_asymkv scales file, metadata lacks \['format', 'format_version'"),
    ("foreign-with-format", _foreign_with_metadata, r"not an hf_asymkv scales file"),
    ("wrong-format-name", _edited(_meta(format="vllm.kv_cache")), r"format is 'vllm.kv_cache', expected"),
    ("no-fingerprint", _edited(_meta(fingerprint=None)), r"metadata lacks \['fingerprint'\]"),
    ("bad-fingerprint", _edited(_meta(fingerprint="{not json")), r"'fingerprint' is not a JSON object"),
    ("unknown-version", _edited(_meta(format_version="2")), r"format_version '2' is not supported.*upgrade"),
    ("no-tensors", _empty_tensors, r"no per-layer k_channel_absmax"),
    ("missing-v_head_absmax", _edited(_drop(PREFIX.format(1) + "v_head_absmax")),
     r"missing tensors \['model\.layers\.1\.self_attn\.v_head_absmax'\]"),
    ("missing-k_channel_absmax", _edited(_drop(PREFIX.format(0) + "k_channel_absmax")),
     r"missing tensors \['model\.layers\.0\.self_attn\.k_channel_absmax'\]"),
    ("missing-k_scale", _edited(_drop(PREFIX.format(0) + "k_scale")),
     r"missing tensors \['model\.layers\.0\.self_attn\.k_scale'\]"),
    ("only-vllm-scalars-for-a-layer", _edited(_drop(PREFIX.format(1) + "k_channel_absmax",
                                                    PREFIX.format(1) + "v_head_absmax")),
     r"missing tensors \['model\.layers\.1\.self_attn\.k_channel_absmax', 'model\.layers\.1\.self_attn\.v_head"),
    ("stray-tensor", _edited(lambda t, m: t.update({"lm_head.weight": torch.ones(2)})), r"unexpected tensor 'lm_head"),
    ("unknown-leaf", _edited(_set(0, "q_scale", torch.tensor(1.0))), r"unexpected tensor .*q_scale"),
    *[(f"{value}-in-{leaf}", _edited(_poke(1, leaf, float(value))), rf"layer 1: {leaf} has NaN or inf")
      for leaf in ("k_channel_absmax", "v_head_absmax") for value in ("nan", "inf", "-inf")],
    *[(f"{name}-in-{leaf}", _edited(_poke(0, leaf, value)), rf"layer 0: {leaf} has zero or negative values")
      for leaf in ("k_channel_absmax", "v_head_absmax") for name, value in (("zero", 0.0), ("negative", -1.0))],
    ("k-1d", _edited(_set(0, "k_channel_absmax", torch.ones(HEADS * HEAD_DIM))),
     r"layer 0: k_channel_absmax must be \[kv_heads, head_dim\].*got \(32,\)"),
    ("k-3d", _edited(_set(0, "k_channel_absmax", torch.ones(1, HEADS, HEAD_DIM))), r"must be \[kv_heads, head_dim\]"),
    ("v-2d", _edited(_set(1, "v_head_absmax", torch.ones(HEADS, 1))), r"layer 1: .*got \(2, 16\) and \(2, 1\)"),
    ("v-wrong-heads", _edited(_set(1, "v_head_absmax", torch.ones(HEADS + 1))), r"layer 1: .*and \(3,\)"),
    ("k-empty", _edited(_set(0, "k_channel_absmax", torch.ones(HEADS, 0))), r"layer 0: k_channel_absmax must be"),
    ("k_scale-not-scalar", _edited(_set(0, "k_scale", lambda t: t.reshape(1))), r"k_scale must be a scalar"),
    ("k_scale-inconsistent", _edited(_set(1, "k_scale", lambda t: t * 2)), r"k_scale is .*edited inconsistently"),
    ("v_scale-nan", _edited(_set(0, "v_scale", torch.tensor(float("nan")))), r"v_scale is nan"),
]


@pytest.mark.parametrize("build, pattern", [pytest.param(b, p, id=i) for i, b, p in MALFORMED])
def test_malformed_file_raises_value_error_naming_the_cause(good, tmp_path, build, pattern):
    bad = build(good, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match=pattern) as info:
        KVScales.load(bad)
    assert str(bad) in str(info.value)  # every problem names the file


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors.*does not exist"):
        KVScales.load(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError, match="does not exist"):  # a folder is not a scales file
        KVScales.load(tmp_path)


# ------------------------------------------------------------------------------------------------ another model's file
def _llama(**overrides) -> LlamaConfig:
    common = {**_COMMON, "num_hidden_layers": LAYERS, **overrides}
    rope_theta = common.pop("rope_theta", None)
    config = LlamaConfig(**common)
    if rope_theta is not None:
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    return config


# (id, config of the model that wrote the file, tensor shape of its file, regex)
FOREIGN = [
    ("more-layers-in-file", _llama(num_hidden_layers=3), dict(layers=3), r"scales name layers \[2\] but the model has 2"),
    ("fewer-layers-in-file", _llama(num_hidden_layers=1), dict(layers=1),
     r"fingerprint mismatch on 'num_hidden_layers': file has 1, model has 2"),
    ("kv-heads", _llama(num_key_value_heads=4), dict(heads=4),
     r"layer 0: k_channel_absmax is \(4, 16\), the model needs \[2, 16\].*another model"),
    ("head-dim", _llama(head_dim=32), dict(head_dim=32), r"k_channel_absmax is \(2, 32\), the model needs \[2, 16\]"),
    ("rope-theta", _llama(rope_theta=500000.0), {}, r"fingerprint mismatch on 'rope'.*500000.*10000"),
]


@pytest.mark.parametrize("writer_config, shape, pattern", [pytest.param(c, s, p, id=i) for i, c, s, p in FOREIGN])
def test_another_models_file_is_refused_with_config(tmp_path, writer_config, shape, pattern):
    path = make_scales(writer_config, **shape).save(tmp_path / "other.safetensors")
    KVScales.load(path)  # a valid file in itself
    with pytest.raises(ValueError, match=pattern) as info:
        KVScales.load(path, config=llama_config())
    assert str(path) in str(info.value)
    if "fingerprint" in pattern:
        assert "tiny-llama" in str(info.value)  # names the model the file was calibrated for


def test_fingerprint_is_checked_on_a_kvscales_object_too():
    with pytest.raises(ValueError, match=r"fingerprint mismatch on 'rope'"):
        make_scales(_llama(rope_theta=500000.0)).validate(llama_config())
    make_scales().validate(llama_config())


def test_empty_or_mismatched_layer_sets_are_invalid():
    with pytest.raises(ValueError, match="no layers"):
        KVScales({}, {}).validate()
    scales = make_scales()
    del scales.v_head_absmax[1]
    with pytest.raises(ValueError, match=r"K and V ranges cover different layers: \[0, 1\] vs \[0\]"):
        scales.validate()

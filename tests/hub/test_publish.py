"""Publishing scales (`hf_asymkv.hub.publish`): the folder and its model card, atomic writes, loading back with
`AsymKVCache.from_pretrained` (same generations as the scales file), and the Hub paths with a mocked
`huggingface_hub` (the Hub is never contacted: `HfApi` and `snapshot_download` are replaced by recorders)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from conftest import llama_config
from helpers import cli_exit_code, greedy_with_logits

import hf_asymkv.hub.model_card as model_card_mod
import hf_asymkv.hub.publish as publish_mod
from hf_asymkv import PRESETS, AsymKVCache, AsymKVConfig
from hf_asymkv.calibration.calibrate import calibrate_model, scales_from_stats
from hf_asymkv.cli import main
from hf_asymkv.core.pretrained import CONFIG_FILE, SCALES_FILE, load_published
from hf_asymkv.core.scales import KVScales, config_fingerprint
from hf_asymkv.hub.publish import DEFAULT_CONFIG, publish, push_to_hub
from hf_asymkv.models import DEFAULT_MODEL, load_config

pytestmark = pytest.mark.usefixtures("single_thread")

SMALL = dict(residual_length=8, key_block_size=8)  # quantizes after a handful of tokens
REPO = "someone/tiny-llama-asymkv"


_greedy = greedy_with_logits


def _listing(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _front_matter(card: str) -> dict:
    lines = card.splitlines()
    assert lines[0] == "---", "the card must start with YAML front matter"
    end = lines.index("---", 1)
    return yaml.safe_load("\n".join(lines[1:end]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Llama's config as a local model folder (publish reads the config only)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    llama_config().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def scales(llama) -> KVScales:
    """Real ranges of the tiny Llama: two 48-token samples, calibrate-style metadata."""
    g = torch.Generator().manual_seed(3)
    samples = [torch.randint(3, 256, (1, 48), generator=g) for _ in range(2)]
    stats = calibrate_model(llama, samples, chunk_size=16, progress=False)
    meta = {"model_id": "tiny-llama", "data": "wiki_sample.txt", "num_samples": 2, "sample_lengths": "[48, 48]"}
    return scales_from_stats(stats, llama.config, metadata=meta)


@pytest.fixture
def scales_file(scales, tmp_path) -> Path:
    return scales.save(tmp_path / "kv_scales.safetensors")


@pytest.fixture
def published(model_dir, scales_file, tmp_path) -> Path:
    return publish(str(model_dir), scales_file, tmp_path / "pub", settings=SMALL, base_model="org/tiny-llama")


class HubRecorder:
    """Stands in for `huggingface_hub.HfApi`: records calls; ``fail`` = {"create_repo"|"upload_folder": exc}."""

    calls: list = []
    fail: dict = {}

    def __init__(self, token=None):
        HubRecorder.calls.append(("HfApi", {"token": token}))

    def create_repo(self, repo_id, **kwargs):
        HubRecorder.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        if "create_repo" in HubRecorder.fail:
            raise HubRecorder.fail["create_repo"]
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        HubRecorder.calls.append(("upload_folder", {**kwargs, "files": sorted(
            str(p.relative_to(kwargs["folder_path"])) for p in Path(kwargs["folder_path"]).rglob("*"))}))
        if "upload_folder" in HubRecorder.fail:
            raise HubRecorder.fail["upload_folder"]
        return "commit-info"


@pytest.fixture
def hub(monkeypatch):
    HubRecorder.calls, HubRecorder.fail = [], {}
    monkeypatch.setattr(huggingface_hub, "HfApi", HubRecorder)
    return HubRecorder


# ------------------------------------------------------------------------------------------------ round trip
def test_published_folder_layout(published, scales_file):
    assert _listing(published) == {SCALES_FILE, CONFIG_FILE, "README.md"}
    assert (published / SCALES_FILE).read_bytes() == scales_file.read_bytes()  # a byte-for-byte copy
    cfg = json.loads((published / CONFIG_FILE).read_text())
    assert cfg["format"] == "hf_asymkv.published" and cfg["format_version"] == "1"
    assert cfg["settings"] == DEFAULT_CONFIG.replace(**SMALL).to_dict()
    assert cfg["scales_file"] == SCALES_FILE and cfg["base_model"] == "org/tiny-llama"
    assert cfg["hf_asymkv_version"] == __import__("hf_asymkv").__version__
    assert not [p for p in published.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_from_pretrained_generates_exactly_like_the_scales_file(llama, prompt, published, scales_file):
    cache = AsymKVCache.from_pretrained(published, config=llama.config)
    reference = AsymKVCache(llama.config, DEFAULT_CONFIG, scales=scales_file, **SMALL)
    assert cache.settings == reference.settings
    seq, logits = _greedy(llama, prompt, cache)
    ref_seq, ref_logits = _greedy(llama, prompt, reference)
    assert torch.equal(seq, ref_seq) and torch.equal(logits, ref_logits)
    assert cache.stats()["tokens_quantized"] > 0  # the small window made it quantize
    for i, k in cache.scales.k_channel_absmax.items():
        assert torch.equal(k, reference.scales.k_channel_absmax[i])


@pytest.mark.parametrize("overrides", [{"residual_length": 16}, {"value_bits": 2, "sink_tokens": 4},
                                       {"key_format": "fp8_e4m3", "key_block_size": 32}],
                         ids=["window", "bits+sinks", "key-format+block"])
def test_overrides_win_over_published_settings(llama, published, overrides):
    cache = AsymKVCache.from_pretrained(str(published), llama.config, **overrides)
    head_dim = llama.config.head_dim  # group sizes left open in the publication are resolved for the model
    assert cache.cache_config == DEFAULT_CONFIG.replace(**{**SMALL, **overrides}).resolved([head_dim])


@pytest.mark.parametrize("kwarg", ["scales", "key_absmax"], ids=["scales", "key_absmax"])
def test_from_pretrained_refuses_other_ranges(llama, published, kwarg):
    with pytest.raises(ValueError, match=f"do not pass {kwarg}="):
        AsymKVCache.from_pretrained(published, config=llama.config, **{kwarg: {}})


def test_from_pretrained_checks_the_model(published):
    other = llama_config()
    other.num_key_value_heads = 4
    with pytest.raises(ValueError, match=r"k_channel_absmax is \(2, 16\), the model needs \[4, 16\]"):
        AsymKVCache.from_pretrained(published, config=other)


# ------------------------------------------------------------------------------------------------ refusals / atomicity
def _foreign(kind: str, scales: KVScales) -> KVScales:
    if kind == "fingerprint":  # same shapes, but calibrated on another architecture's config
        fp = {**config_fingerprint(llama_config()), "model_type": "mistral"}
        return KVScales(dict(scales.k_channel_absmax), dict(scales.v_head_absmax),
                        {**scales.metadata, "fingerprint": json.dumps(fp), "model_id": "other/model"})
    k = {**scales.k_channel_absmax, 2: scales.k_channel_absmax[0].clone()}  # a third layer the model lacks
    v = {**scales.v_head_absmax, 2: scales.v_head_absmax[0].clone()}
    return KVScales(k, v, dict(scales.metadata))


@pytest.mark.parametrize("kind, message", [("fingerprint", "fingerprint mismatch on 'model_type'"),
                                           ("layers", r"scales name layers \[2\] but the model has 2 layers")],
                         ids=["fingerprint", "layer-count"])
def test_publish_refuses_another_models_scales(model_dir, scales, tmp_path, kind, message):
    path = _foreign(kind, scales).save(tmp_path / "other.safetensors")
    before = _listing(tmp_path)
    with pytest.raises(ValueError, match=message):
        publish(str(model_dir), path, tmp_path / "pub")
    assert _listing(tmp_path) == before  # no output folder, no temp folder


@pytest.mark.parametrize("where", ["copy", "self-check"])
def test_failure_midway_leaves_nothing(model_dir, scales_file, tmp_path, monkeypatch, where):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    if where == "copy":
        monkeypatch.setattr(publish_mod.shutil, "copyfile", boom)
    else:
        monkeypatch.setattr(publish_mod, "load_published", boom)
    before = _listing(tmp_path)
    with pytest.raises(RuntimeError, match="disk full"):
        publish(str(model_dir), scales_file, tmp_path / "pub")
    assert _listing(tmp_path) == before


def test_failed_overwrite_keeps_the_old_folder(published, model_dir, scales_file, monkeypatch):
    old = {p.name: p.read_bytes() for p in published.iterdir()}
    monkeypatch.setattr(publish_mod, "load_published", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        publish(str(model_dir), scales_file, published, overwrite=True, settings={"residual_length": 64})
    assert {p.name: p.read_bytes() for p in published.iterdir()} == old
    assert not [p for p in published.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("existing, overwrite, message", [
    ("publish", False, "exists and is not empty"),
    ("foreign", False, "exists and is not empty"),
    ("foreign", True, "refusing to replace .* holds no asymkv_config.json"),
    ("file", True, "exists and is not a folder"),
], ids=["publish-no-overwrite", "foreign", "foreign-overwrite", "file"])
def test_existing_output_is_refused(model_dir, scales_file, published, tmp_path, existing, overwrite, message):
    target = published
    if existing == "foreign":
        target = tmp_path / "mine"
        target.mkdir()
        (target / "notes.txt").write_text("keep me")
    elif existing == "file":
        target = tmp_path / "a_file"
        target.write_text("x")
    before = {p.name: p.read_bytes() for p in target.iterdir()} if target.is_dir() else target.read_bytes()
    with pytest.raises(ValueError, match=message):
        publish(str(model_dir), scales_file, target, overwrite=overwrite)
    after = {p.name: p.read_bytes() for p in target.iterdir()} if target.is_dir() else target.read_bytes()
    assert after == before


def test_overwrite_replaces_an_earlier_publish_and_empty_folder_is_fine(model_dir, scales_file, published, tmp_path):
    publish(str(model_dir), scales_file, published, overwrite=True, settings={"residual_length": 64})
    assert json.loads((published / CONFIG_FILE).read_text())["settings"]["residual_length"] == 64
    empty = tmp_path / "empty"
    empty.mkdir()
    assert SCALES_FILE in _listing(publish(str(model_dir), scales_file, empty))


@pytest.mark.parametrize("settings, message", [
    ({"bogus": 1}, r"unknown AsymKVCache settings \['bogus'\]"),
    ({"value_bits": 7}, "value_bits must be one of"),
    ({"key_granularity": "token"}, "calibrated key ranges .* need key_granularity='channel'"),
    ({"key_format": "int4", "key_symmetric": False}, "calibrated key ranges .* key_symmetric=True"),
    ({"key_rotation": True}, "calibrated key ranges .* key_rotation=False"),
    ({"residual_length": [8]}, "must be a JSON scalar"),
], ids=["unknown-key", "bad-value", "incompatible", "asymmetric-keys", "rotated-keys", "not-scalar"])
def test_publish_refuses_bad_settings(model_dir, scales_file, tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        publish(str(model_dir), scales_file, tmp_path / "pub", settings=settings)
    assert not (tmp_path / "pub").exists()


# ------------------------------------------------------------------------------------------------ model card
def test_card_without_eval(published, scales):
    card = (published / "README.md").read_text()
    front = _front_matter(card)
    assert front["base_model"] == "org/tiny-llama"
    assert front["library_name"] == "hf-asymkv"
    assert {"kv-cache", "quantization", "hf-asymkv", "llama"} <= set(front["tags"])
    assert "license" not in front  # not known for a local folder without a card
    assert huggingface_hub.ModelCard(card).data.base_model == "org/tiny-llama"  # the Hub's own parser agrees
    assert "AsymKVCache.from_pretrained(\"pub\", config=model.config)" in card
    assert "model.generate(**inputs, **cache_kwargs(cache)" in card
    assert "No evaluation was attached" in card and "eval/" not in card
    for fact in ("wiki_sample.txt", "2 x 48 tokens", "| Key range statistic | absmax |", "| Samples | 2 |",
                 f"| hf-asymkv version (calibration) | {scales.metadata['tool_version']} |"):
        assert fact in card
    for i in sorted(scales.k_channel_absmax):
        assert f"| {i} | {float(scales.k_channel_absmax[i].max()):.4g} |" in card
        assert f"{scales.k_scale(i):.4e} | {scales.v_scale(i):.4e} |" in card
    assert "{{" not in card and "}}" not in card
    assert ("keys are stored int8 per channel, values int4 per token (rotated by an orthonormal Hadamard matrix), and "
            "the newest 8 tokens and the first 4 tokens stay exact") in card


MD_TABLE = "| scheme | needle acc @4k |\n|---|---:|\n| dynamic | 0.97 |\n| asymkv | 0.96 |\n"
JSON_ROWS = {"meta": {"model": "tiny"}, "rows": [{"scheme": "dynamic", "kl": 0.0}, {"scheme": "asymkv", "kl": 0.0123}]}


@pytest.mark.parametrize("layout", ["folder-md", "folder-md+json", "single-json", "json-not-a-table"])
def test_card_quotes_eval_results_verbatim(model_dir, scales_file, tmp_path, layout):
    results = tmp_path / "results"
    results.mkdir()
    if layout.startswith("folder"):
        (results / "needle.md").write_text(MD_TABLE)
        (results / "plot.png").write_bytes(b"\x89PNG")  # ignored
        if layout.endswith("json"):
            (results / "attention.json").write_text(json.dumps(JSON_ROWS))
        source = results
    elif layout == "single-json":
        source = results / "attention.json"
        source.write_text(json.dumps(JSON_ROWS))
    else:
        source = results / "summary.json"
        source.write_text(json.dumps({"accuracy": {"4k": 0.97}}, indent=1))
    out = publish(str(model_dir), scales_file, tmp_path / "pub", eval_results=source, repo_id=REPO)
    card = (out / "README.md").read_text()
    assert "No evaluation was attached" not in card
    assert f'AsymKVCache.from_pretrained("{REPO}", config=model.config)' in card
    if "md" in layout:
        assert MD_TABLE.strip() in card and "Source: `eval/needle.md`" in card
        assert (out / "eval" / "needle.md").read_text() == MD_TABLE
    if layout in ("folder-md+json", "single-json"):
        assert "| scheme | kl |" in card and "| asymkv | 0.0123 |" in card and "- `model`: tiny" in card
        assert "Source: `eval/attention.json`" in card
    if layout == "json-not-a-table":
        assert source.read_text().strip() in card
    assert not (out / "eval" / "plot.png").exists()
    assert _listing(out) == {SCALES_FILE, CONFIG_FILE, "README.md", "eval"}


@pytest.mark.parametrize("kind, message", [("missing", "does not exist"), ("empty-folder", "holds no .md or .json"),
                                           ("bad-json", "is not valid JSON"), ("empty-file", "is empty"),
                                           ("csv", "expected a folder, a .md table or a .json file")],
                         ids=["missing", "empty-folder", "bad-json", "empty-file", "csv"])
def test_bad_eval_results(model_dir, scales_file, tmp_path, kind, message):
    source = tmp_path / "res"
    if kind == "empty-folder":
        source.mkdir()
    elif kind == "bad-json":
        source = tmp_path / "res.json"
        source.write_text("{not json")
    elif kind == "empty-file":
        source = tmp_path / "res.md"
        source.write_text("\n")
    elif kind == "csv":
        source = tmp_path / "res.csv"
        source.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=message):
        publish(str(model_dir), scales_file, tmp_path / "pub", eval_results=source)
    assert not (tmp_path / "pub").exists()


def test_template_file_and_builtin_copy_agree():
    path = Path(__file__).resolve().parents[2] / "model_cards" / "TEMPLATE.md"
    assert path.read_text(encoding="utf-8") == model_card_mod._BUILTIN_TEMPLATE


def test_template_placeholders_are_checked():
    assert model_card_mod.render_template("a {{x}} b", {"x": "{{y}}"}) == "a {{y}} b"  # inserted text not rescanned
    with pytest.raises(ValueError, match=r"placeholders without values: \['nope'\]"):
        model_card_mod.render_template("{{ nope }}", {})


def test_default_model_alias_uses_the_cached_folder_and_known_hub_id(monkeypatch, model_dir, scales, tmp_path):
    import hf_asymkv.models as models

    monkeypatch.setattr(models, "default_model_path", lambda: model_dir)
    assert load_config(DEFAULT_MODEL).num_hidden_layers == 2
    path = KVScales(dict(scales.k_channel_absmax), dict(scales.v_head_absmax),
                    {**scales.metadata, "model_id": DEFAULT_MODEL}).save(tmp_path / "kv.safetensors")
    card = (publish(DEFAULT_MODEL, path, tmp_path / "pub") / "README.md").read_text()
    front = _front_matter(card)
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["license"] == "apache-2.0"


def test_gguf_model_loads_its_config_from_the_file(monkeypatch, tmp_path):
    import transformers

    calls = []
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: calls.append((a, k)) or llama_config())
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    load_config(str(gguf))
    assert calls == [((str(tmp_path),), {"gguf_file": "m.Q4.gguf"})]
    with pytest.raises(ValueError, match="GGUF file .* does not exist"):
        load_config(str(tmp_path / "missing.gguf"))


def test_unloadable_model_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load the config of model"):
        load_config(str(tmp_path / "no-such-model-folder"))  # a path, never sent to the Hub


# ------------------------------------------------------------------------------------------------ load_published
def _edit_config(folder: Path, change) -> None:
    path = folder / CONFIG_FILE
    if change is None:
        path.unlink()
    elif isinstance(change, str):
        path.write_text(change)
    else:
        cfg = json.loads(path.read_text())
        change(cfg)
        path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("change, message", [
    (None, "no asymkv_config.json"),
    ("{oops", "asymkv_config.json is not valid JSON"),
    ("[1, 2]", "must hold a JSON object, got list"),
    (lambda c: c.update(format="something.else"), "format is 'something.else'"),
    (lambda c: c.update(format_version="2"), "format_version '2' is not supported"),
    (lambda c: c["settings"].update(window=8), r"unknown AsymKVCache settings \['window'\]"),
    (lambda c: c.update(settings=[1]), "settings must be a JSON object"),
    (lambda c: c["settings"].update(residual_length={"a": 1}), "must be a JSON scalar"),
    (lambda c: c.update(scales_file="../kv_scales.safetensors"), "scales_file must be a file name"),
    (lambda c: c.update(scales_file="other.safetensors"), "the scales file 'other.safetensors' .* is missing"),
], ids=["missing", "bad-json", "not-object", "format", "version", "unknown-setting", "settings-type",
        "setting-value-type", "path-traversal", "missing-scales"])
def test_load_published_names_the_problem(published, change, message):
    _edit_config(published, change)
    with pytest.raises(ValueError, match=message):
        load_published(published, llama_config())


def test_load_published_names_a_broken_scales_file(published):
    (published / SCALES_FILE).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_published(published, None)


@pytest.mark.parametrize("target, message", [("file", "is a file; expected a publish folder"),
                                             ("/no/such/abs/folder", "neither an existing folder nor a valid Hub")],
                         ids=["file", "not-a-folder-nor-repo-id"])
def test_load_published_bad_locations(published, target, message):
    where = published / SCALES_FILE if target == "file" else target
    with pytest.raises(ValueError, match=message):
        load_published(where, None)


# ------------------------------------------------------------------------------------------------ Hub (mocked)
def test_from_pretrained_with_a_repo_id_downloads_the_three_files(monkeypatch, llama, published):
    calls = []

    def fake_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(published)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    cache = AsymKVCache.from_pretrained(REPO, config=llama.config, revision="v1")
    assert calls == [(REPO, {"repo_type": "model", "revision": "v1", "token": None,
                             "allow_patterns": [SCALES_FILE, CONFIG_FILE, "README.md"]})]
    assert cache.settings["residual_length"] == SMALL["residual_length"]


def test_hub_download_failure_is_reported(monkeypatch, llama):
    def offline(repo_id, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(OSError, match=f"'{REPO}' is not a local folder, and downloading it from the Hugging Face "
                                      "Hub failed .*no network"):
        AsymKVCache.from_pretrained(REPO, config=llama.config)


def test_push_to_hub_creates_the_repo_and_uploads_the_folder(hub, published):
    assert push_to_hub(published, REPO, private=True, token="hf_x") == "commit-info"
    assert [name for name, _ in hub.calls] == ["HfApi", "create_repo", "upload_folder"]
    assert hub.calls[0][1] == {"token": "hf_x"}
    assert hub.calls[1][1] == {"repo_id": REPO, "exist_ok": True, "private": True, "repo_type": "model"}
    upload = hub.calls[2][1]
    assert upload["folder_path"] == str(published) and upload["repo_id"] == REPO and upload["repo_type"] == "model"
    assert upload["files"] == sorted([SCALES_FILE, CONFIG_FILE, "README.md"])


@pytest.mark.parametrize("step", ["create_repo", "upload_folder"])
def test_push_to_hub_errors_propagate_with_a_message(hub, published, step):
    hub.fail[step] = PermissionError("401 Unauthorized")
    with pytest.raises(OSError, match=f"{REPO}.*401 Unauthorized") as info:
        push_to_hub(published, REPO)
    assert isinstance(info.value.__cause__, PermissionError)
    assert [name for name, _ in hub.calls][-1] == step  # nothing after the failing step


@pytest.mark.parametrize("case, message", [("bad-repo", "invalid Hub repo id"), ("bad-folder", "no asymkv_config")],
                         ids=["bad-repo", "bad-folder"])
def test_push_to_hub_checks_before_calling_the_hub(hub, published, tmp_path, case, message):
    with pytest.raises(ValueError, match=message):
        if case == "bad-repo":
            push_to_hub(published, "not a/valid/repo")
        else:
            push_to_hub(tmp_path, REPO)
    assert hub.calls == []


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_publish_and_push(hub, model_dir, scales_file, tmp_path, capsys):
    out = tmp_path / "cli-pub"
    rc = main(["publish", "--model", str(model_dir), "--scales", str(scales_file), "--out", str(out),
               "--residual-length", "8", "--key-block-size", "8", "--push-to-hub", REPO, "--private",
               "--base-model", "org/tiny-llama", "--license", "mit"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert f"wrote {out}" in stdout and f"pushed {out} to https://huggingface.co/{REPO}" in stdout
    _, cache_config = load_published(out, llama_config())
    assert cache_config == DEFAULT_CONFIG.replace(**SMALL)
    card = (out / "README.md").read_text()
    assert _front_matter(card)["license"] == "mit" and f'from_pretrained("{REPO}"' in card
    assert hub.calls[1][1]["private"] is True and hub.calls[2][1]["repo_id"] == REPO


@pytest.mark.parametrize("name", list(PRESETS))
def test_cli_publishes_every_preset(model_dir, scales_file, tmp_path, name):
    """3/5/6-bit values and int3 keys included; a preset with asymmetric keys is published with symmetric ones
    (--key-symmetric), which is what calibrated ranges serve."""
    preset = PRESETS[name]
    out = tmp_path / name
    extra = [] if preset.key_symmetric else ["--key-symmetric"]
    assert cli_exit_code(["publish", "--model", str(model_dir), "--scales", str(scales_file), "--out", str(out),
                          "--preset", name, *extra]) == 0
    _, cache_config = load_published(out, llama_config())
    assert cache_config == preset.replace(key_symmetric=True)


@pytest.mark.parametrize("case, message", [
    ("missing-scales", "error: --scales: no such file or folder: '.*nope.safetensors'"),
    ("wrong-model", "error: .*fingerprint mismatch"),
    ("non-empty-out", "error: .*exists and is not empty"),
    ("bad-repo", "argument --push-to-hub: invalid Hub repo id"),
    ("bad-eval", "error: --eval-results: no such file or folder: '.*nothing'"),
    ("bad-setting", "argument --residual-length: must be >= 0, got -1"),
    ("bad-value-bits", "argument --value-bits: invalid choice: 7 \\(choose from 1, 2, 3, 4, 5, 6, 8\\)"),
    ("asymmetric-preset", "error: .*calibrated key ranges are symmetric per-channel scales"),
    ("no-model", "argument --model: model '.*no-model-here': no such folder"),
], ids=["missing-scales", "wrong-model", "non-empty-out", "bad-repo", "bad-eval", "bad-setting", "bad-value-bits",
        "asymmetric-preset", "no-model"])
def test_cli_publish_bad_input_exits_2(hub, model_dir, scales, scales_file, tmp_path, capsys, case, message):
    out = tmp_path / "cli-pub"
    argv = ["publish", "--model", str(model_dir), "--scales", str(scales_file), "--out", str(out)]
    if case == "missing-scales":
        argv[4] = str(tmp_path / "nope.safetensors")
    elif case == "wrong-model":
        argv[4] = str(_foreign("fingerprint", scales).save(tmp_path / "other.safetensors"))
    elif case == "non-empty-out":
        out.mkdir()
        (out / "x").write_text("x")
    elif case == "bad-repo":
        argv += ["--push-to-hub", "a/b/c"]
    elif case == "bad-eval":
        argv += ["--eval-results", str(tmp_path / "nothing")]
    elif case == "bad-setting":
        argv += ["--residual-length", "-1"]
    elif case == "bad-value-bits":
        argv += ["--value-bits", "7"]
    elif case == "asymmetric-preset":
        argv += ["--preset", "tight"]
    elif case == "no-model":
        argv[2] = str(tmp_path / "no-model-here")
    assert cli_exit_code(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
    assert not out.exists() or case == "non-empty-out"
    assert hub.calls == []


def test_cli_publish_push_failure_exits_2_after_writing_the_folder(hub, model_dir, scales_file, tmp_path, capsys):
    hub.fail["create_repo"] = RuntimeError("403 Forbidden")
    out = tmp_path / "cli-pub"
    assert main(["publish", "--model", str(model_dir), "--scales", str(scales_file), "--out", str(out),
                 "--push-to-hub", REPO]) == 2
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out and "403 Forbidden" in captured.err and "pushed" not in captured.out
    assert (out / CONFIG_FILE).is_file()


@pytest.mark.parametrize("command", ["publish", "export-vllm"])
def test_cli_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage: hf-asymkv " + command in capsys.readouterr().out


def test_published_layer_overrides_round_trip(llama, model_dir, scales_file, tmp_path):
    """Per-layer overrides (issue 22) are saved in asymkv_config.json and read back by from_pretrained."""
    overrides = {0: {"key_format": "int8", "value_bits": 8}, -1: {"residual_length": 16}}
    folder = publish(str(model_dir), scales_file, tmp_path / "pub", settings={**SMALL, "layer_overrides": overrides})
    cache = AsymKVCache.from_pretrained(folder, llama.config)
    assert cache.cache_config.overrides() == overrides
    assert cache.layers[0].value_spec.bits == 8 and cache.layers[1].residual_length == 16


@pytest.mark.parametrize("wrapped", [False, True], ids=["mapping", "asymkv_config"])
def test_cli_publish_layer_overrides(llama, model_dir, scales_file, tmp_path, capsys, wrapped):
    """--layer-overrides takes a {layer: settings} file, AsymKVConfig.to_dict()'s JSON, or a published
    asymkv_config.json."""
    overrides = {"0": {"key_format": "int8", "value_bits": 8}, "-1": {"residual_length": 16}}
    source = tmp_path / "overrides.json"
    as_config = AsymKVConfig(layer_overrides={int(k): v for k, v in overrides.items()}).to_dict()
    source.write_text(json.dumps(as_config if wrapped else overrides))
    out = tmp_path / "cli-pub"
    assert main(["publish", "--model", str(model_dir), "--scales", str(scales_file), "--out", str(out),
                 "--residual-length", "8", "--key-block-size", "8", "--layer-overrides", str(source)]) == 0
    cache = AsymKVCache.from_pretrained(out, llama.config)
    assert cache.cache_config.overrides() == {0: overrides["0"], -1: overrides["-1"]}
    assert cache.layers[0].value_spec.bits == 8 and cache.layers[1].residual_length == 16
    again = tmp_path / "cli-pub-again"  # the published config is itself a valid --layer-overrides file
    assert main(["publish", "--model", str(model_dir), "--scales", str(scales_file), "--out", str(again),
                 "--layer-overrides", str(out / CONFIG_FILE)]) == 0
    assert AsymKVCache.from_pretrained(again, llama.config).cache_config.overrides() == cache.cache_config.overrides()


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not a readable JSON file"),
    ('[1, 2]', "must hold a JSON object"),
    ('{"0": 8}', "must hold a JSON object"),
    ('{"7": {"value_bits": 8}}', "layer_overrides names layer 7"),
    ('{"0": {"value_bits": 7}}', "layer_overrides[0]"),
])
def test_cli_publish_refuses_bad_layer_overrides(model_dir, scales_file, tmp_path, capsys, content, message):
    source = tmp_path / "overrides.json"
    source.write_text(content)
    out = tmp_path / "cli-pub"
    assert main(["publish", "--model", str(model_dir), "--scales", str(scales_file), "--out", str(out),
                 "--layer-overrides", str(source)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing half-written

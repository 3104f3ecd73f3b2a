"""Malformed scales files and publish folders (issue 56): seeded mutated and truncated copies of valid ones
(:mod:`file_fuzz`) are each refused with a ``ValueError`` that names the file or folder, or accepted only when still
valid (a cache builds from them); never another exception, a crash or a hang.

The fast tests try 120 mutations of a scales file and 60 of each file of a publish folder; the slow one 3000 of each
and prints the tally (tried / refused / accepted).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import llama_config
from file_fuzz import byte_mutations, check_reader, json_mutations, tiny_llama_scales

from hf_asymkv import AsymKVCache
from hf_asymkv.core.pretrained import CONFIG_FILE, CONFIG_FORMAT, CONFIG_FORMAT_VERSION, SCALES_FILE
from hf_asymkv.core.scales import KVScales

FAST, FAST_FOLDER, SLOW = 120, 60, 3000  # a folder builds a cache per mutation: fewer in the fast tier
CONFIG = llama_config()


def _publish_folder(folder: Path) -> Path:
    """A publish folder as ``hf-asymkv publish`` writes it (config, scales; the card is not read back)."""
    folder.mkdir()
    tiny_llama_scales(CONFIG).save(folder / SCALES_FILE)
    settings = {"config_version": 3, "key_block_size": 16, "residual_length": 8, "sink_tokens": 2}
    (folder / CONFIG_FILE).write_text(json.dumps({
        "format": CONFIG_FORMAT, "format_version": CONFIG_FORMAT_VERSION, "settings": settings,
        "scales_file": SCALES_FILE, "base_model": "org/tiny-llama", "hf_asymkv_version": "0"}, indent=2))
    return folder


def _cache_builds(cache: AsymKVCache) -> None:
    """What an accepted file must allow: a cache over the model that takes an update."""
    keys = torch.randn(1, 2, 40, 16)
    cache.update(keys, keys, 0)


def _fuzz_scales_file(tmp_path: Path, count: int) -> Counter:
    good = tiny_llama_scales(CONFIG).save(tmp_path / "good.safetensors").read_bytes()
    path = tmp_path / SCALES_FILE
    tally = Counter()
    for i, (kind, data) in enumerate(byte_mutations(good, count, seed=1)):
        path.write_bytes(data)
        check_reader(lambda: KVScales.load(path, CONFIG), (str(path),), f"scales mutation {i} ({kind})", tally,
                     valid=lambda scales: _cache_builds(AsymKVCache(CONFIG, scales=scales)))
    return tally


def _fuzz_publish_folder(tmp_path: Path, count: int) -> dict[str, Counter]:
    good = _publish_folder(tmp_path / "good")
    config_text = (good / CONFIG_FILE).read_text()
    scales_bytes = (good / SCALES_FILE).read_bytes()
    cases = [(f"{CONFIG_FILE} {kind}", CONFIG_FILE, data) for kind, data in json_mutations(config_text, count, seed=2)]
    cases += [(f"{SCALES_FILE} {kind}", SCALES_FILE, data) for kind, data in byte_mutations(scales_bytes, count, 3)]
    tallies = {CONFIG_FILE: Counter(), SCALES_FILE: Counter()}
    originals = {CONFIG_FILE: config_text.encode(), SCALES_FILE: scales_bytes}
    for i, (kind, name, data) in enumerate(cases):
        (good / name).write_bytes(data)
        check_reader(lambda: AsymKVCache.from_pretrained(good, config=CONFIG), (str(good),),
                     f"publish folder mutation {i} ({kind})", tallies[name], valid=_cache_builds)
        (good / name).write_bytes(originals[name])
    return tallies


def test_mutated_scales_files_are_refused_naming_the_file(tmp_path):
    tally = _fuzz_scales_file(tmp_path, FAST)
    assert tally["refused"] > tally["tried"] // 2, tally  # most mutations break the file


def test_mutated_publish_folders_are_refused_naming_the_folder(tmp_path):
    tallies = _fuzz_publish_folder(tmp_path, FAST_FOLDER)
    assert all(tally["refused"] > tally["tried"] // 2 for tally in tallies.values()), tallies


@pytest.mark.parametrize("damage", ["config-is-a-folder", "scales-is-a-folder", "empty-config", "empty-scales",
                                    "scales-outside", "no-scales"])
def test_damaged_publish_folders_are_refused_naming_the_folder(tmp_path, damage):
    folder = _publish_folder(tmp_path / "pub")
    if damage.endswith("is-a-folder"):
        name = CONFIG_FILE if damage.startswith("config") else SCALES_FILE
        (folder / name).unlink()
        (folder / name).mkdir()
    elif damage.startswith("empty"):
        (folder / (CONFIG_FILE if damage == "empty-config" else SCALES_FILE)).write_bytes(b"")
    elif damage == "scales-outside":
        published = json.loads((folder / CONFIG_FILE).read_text())
        (folder / CONFIG_FILE).write_text(json.dumps({**published, "scales_file": "../kv_scales.safetensors"}))
    else:
        (folder / SCALES_FILE).unlink()
    with pytest.raises(ValueError, match=str(folder)):
        AsymKVCache.from_pretrained(folder, config=CONFIG)


@pytest.mark.slow(reason="3000 mutations of each file, printed for the report: ~2 min; fast twins: "
                         "tests/core/test_malformed_files.py::test_mutated_scales_files_are_refused_naming_the_file and "
                         "tests/core/test_malformed_files.py::test_mutated_publish_folders_are_refused_naming_the_folder")
def test_many_mutations_of_scales_and_publish_folders(tmp_path, capsys):
    scales = _fuzz_scales_file(tmp_path, SLOW)
    folders = _fuzz_publish_folder(tmp_path, SLOW)
    with capsys.disabled():
        print(f"\n{SCALES_FILE} alone: {dict(scales)}\n" + "\n".join(f"publish folder, {name}: {dict(tally)}"
                                                                  for name, tally in folders.items()))
    assert all(tally["refused"] > tally["tried"] // 2 for tally in (scales, *folders.values()))

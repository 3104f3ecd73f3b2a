"""Malformed serving checkpoints (issue 56): mutated and truncated copies (:mod:`file_fuzz`) of

- an exported checkpoint's scales shard, read back by ``read_vllm_scales`` (``export-vllm --from-checkpoint``), and
  of its ``hf_asymkv_export.json``, whose presence alone marks a folder this tool may overwrite (nothing parses it);
- the source checkpoint ``export_serving_checkpoint`` reads: ``config.json``, the safetensors index of a sharded one,
  the header of a single ``model.safetensors``;

are each refused with a ``ValueError`` naming the file or folder (then nothing is written: no output folder, no
temporary folder beside it), or accepted only when still valid. The fast tests try 30 mutations of each export file
and 10 of each source file, the slow one 1000 of each and prints the tally.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import llama_config
from file_fuzz import byte_mutations, check_reader, json_mutations, tiny_llama_scales
from transformers import AutoModelForCausalLM

from hf_asymkv.hub.serving import EXPORT_MARKER, INDEX, SCALES_SHARD, export_serving_checkpoint
from hf_asymkv.hub.vllm import read_vllm_scales

pytestmark = pytest.mark.usefixtures("single_thread")
FAST, FAST_SOURCES, SLOW = 30, 10, 1000  # an accepted source mutation is a whole export: fewer in the fast tier
CONFIG = llama_config()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama saved single-file and sharded, and an export of the first."""
    root = tmp_path_factory.mktemp("fuzz-ckpt")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    export_serving_checkpoint(root / "single", tiny_llama_scales(CONFIG), root / "export")
    return {name: root / name for name in ("single", "sharded", "export")}


def _left_behind(parent: Path) -> list[str]:
    """Temporary folders an export left beside its output."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".out.tmp-") or p.name.startswith(".out.old-"))


def _fuzz_export_reads(checkpoints: dict[str, Path], tmp_path: Path, count: int) -> dict[str, Counter]:
    """Mutations of an export's scales shard and marker, read back as ``--from-checkpoint`` does; tallies by file."""
    folder = tmp_path / "export"
    shutil.copytree(checkpoints["export"], folder)
    shard, marker = folder / SCALES_SHARD, folder / EXPORT_MARKER
    cases = [(shard, kind, data) for kind, data in byte_mutations(shard.read_bytes(), count, seed=4)]
    cases += [(marker, kind, data) for kind, data in json_mutations(marker.read_text(), count // 2, seed=5)]
    originals = {shard: shard.read_bytes(), marker: marker.read_bytes()}
    want = read_vllm_scales(folder, CONFIG).k_channel_absmax
    tallies = {shard.name: Counter(), marker.name: Counter()}
    for i, (path, kind, data) in enumerate(cases):
        path.write_bytes(data)
        check_reader(lambda: read_vllm_scales(folder, CONFIG), (path.name, str(folder)),
                     f"export mutation {i} ({path.name} {kind})", tallies[path.name],
                     valid=lambda scales, path=path: path != marker or all(  # the marker is never parsed
                         torch.equal(scales.k_channel_absmax[i], want[i]) for i in want))
        path.write_bytes(originals[path])
    return tallies


def _fuzz_export_sources(checkpoints: dict[str, Path], tmp_path: Path, count: int) -> dict[str, Counter]:
    """Mutations of what ``export_serving_checkpoint`` reads of its source checkpoint; tallies by file."""
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    shutil.copytree(checkpoints["single"], single)
    shutil.copytree(checkpoints["sharded"], sharded)
    header = (single / "model.safetensors").read_bytes()
    header = header[: 8 + int.from_bytes(header[:8], "little")]  # mutate the header only (what the export reads)
    cases = [(single, "config.json", kind, data)
             for kind, data in json_mutations((single / "config.json").read_text(), count, seed=6)]
    cases += [(sharded, INDEX, kind, data) for kind, data in json_mutations((sharded / INDEX).read_text(), count, 7)]
    cases += [(single, "model.safetensors", kind, data + (single / "model.safetensors").read_bytes()[len(header):])
              for kind, data in byte_mutations(header, count, seed=8)]
    tallies = {name: Counter() for name in ("config.json", INDEX, "model.safetensors")}
    out = tmp_path / "runs" / "out"
    out.parent.mkdir()
    for i, (source, name, kind, data) in enumerate(cases):
        original = (source / name).read_bytes()
        (source / name).write_bytes(data)
        tally = tallies[name]
        before = tally["refused"]
        check_reader(lambda: export_serving_checkpoint(source, tiny_llama_scales(CONFIG), out), (name, str(source)),
                     f"source mutation {i} ({name} {kind})", tally)
        if tally["refused"] > before:  # refused: nothing written
            assert not out.exists() and not _left_behind(out.parent), f"mutation {i} ({name} {kind}) left files"
        shutil.rmtree(out, ignore_errors=True)
        (source / name).write_bytes(original)
    return tallies


def test_mutated_exports_are_refused_naming_the_file(checkpoints, tmp_path):
    tallies = _fuzz_export_reads(checkpoints, tmp_path, FAST)
    assert tallies[SCALES_SHARD]["refused"] > FAST // 2, tallies


def test_mutated_export_sources_are_refused_and_nothing_is_written(checkpoints, tmp_path):
    tallies = _fuzz_export_sources(checkpoints, tmp_path, FAST_SOURCES)
    assert all(tally["refused"] for tally in tallies.values()), tallies


@pytest.mark.slow(reason="1000 mutations of each file, printed for the report: ~5 min; fast twins: "
                         "tests/hub/test_malformed_exports.py::test_mutated_exports_are_refused_naming_the_file and "
                         "tests/hub/test_malformed_exports.py::test_mutated_export_sources_are_refused_and_nothing_is_written")
# a mutated header can declare a tensor of shape [0]: torch warns that initializing it is a no-op, and the reader
# then refuses or accepts the file on its own checks, which is what this test counts
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op:UserWarning")
def test_many_mutations_of_serving_checkpoints(checkpoints, tmp_path, capsys):
    tallies = {**_fuzz_export_reads(checkpoints, tmp_path, SLOW), **_fuzz_export_sources(checkpoints, tmp_path, SLOW)}
    with capsys.disabled():
        print("\n" + "\n".join(f"{name}: {dict(tally)}" for name, tally in tallies.items()))
    assert tallies[SCALES_SHARD]["refused"] > SLOW // 2 and all(tallies[name]["refused"] for name in tallies
                                                                  if name != EXPORT_MARKER)

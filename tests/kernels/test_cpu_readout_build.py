"""The native read-out built by several processes or threads into one empty cache folder at once (issue 56): each
gets a working library, and no half-written library is ever at the name that is loaded (each build writes a
temporary file and renames it into place).

A watcher polls the folder while the builds run and reads whatever stands at a library's name: it must always be
the whole library. The fast test stands a slow fake compiler (it writes its output in two steps, pausing between)
in for the real one, in two threads; the slow one runs the real compiler in two processes that then read a layer
through the library and compare it with torch's read-out.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hf_asymkv.kernels import cpu_readout

pytestmark = pytest.mark.skipif(cpu_readout.build_problem() is not None,
                                reason=f"the native read-out cannot be built here: {cpu_readout.build_problem()}")


class Watcher(threading.Thread):
    """Reads every ``cpu_readout-*.so`` in ``folder`` until stopped: the digests of what it saw there, by name."""

    def __init__(self, folder: Path):
        super().__init__(daemon=True)
        self.folder, self.seen, self.stop = folder, {}, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.look()
            time.sleep(0.002)
        self.look()  # once more after the builds: a loaded machine may not have scheduled this thread since the rename

    def look(self) -> None:
        for path in self.folder.glob("cpu_readout-*.so") if self.folder.exists() else ():
            try:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            except FileNotFoundError:
                continue
            self.seen.setdefault(path.name, set()).add(digest)

    def __enter__(self) -> Watcher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()


def _slow_compiler(tmp_path: Path, library: Path) -> str:
    """A 'compiler' that answers ``--version`` and writes ``library`` to its ``-o`` in two steps, 0.3 s apart."""
    script = tmp_path / "slow-cc"
    half = library.stat().st_size // 2
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "slow-cc 1.0"; exit 0; fi
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done
head -c {half} "{library}" > "$out"
sleep 0.3
cat "{library}" > "$out"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def _only_library(folder: Path) -> Path:
    """The folder holds one library and nothing else (no temporary file left behind)."""
    files = sorted(p.name for p in folder.iterdir())
    assert len(files) == 1 and files[0].startswith("cpu_readout-") and files[0].endswith(".so"), files
    return folder / files[0]


def test_two_threads_building_at_once_never_expose_a_partial_library(tmp_path, monkeypatch):
    library = Path(cpu_readout.native_library()._name)  # the real one, built already (the module's skip says so)
    compiler = _slow_compiler(tmp_path, library)
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_ASYMKV_CACHE", str(cache))
    barrier = threading.Barrier(2)

    def build(_):
        barrier.wait()
        return cpu_readout._build(compiler)

    with Watcher(cache / "native") as watcher, ThreadPoolExecutor(2) as pool:
        targets = list(pool.map(build, range(2)))
    built = _only_library(cache / "native")
    assert targets == [built, built]
    assert built.read_bytes() == library.read_bytes()
    assert watcher.seen == {built.name: {hashlib.sha256(library.read_bytes()).hexdigest()}}


BUILD_AND_READ = """
import os, torch
from hf_asymkv import AsymKVCache
from hf_asymkv.kernels import cpu_readout
from transformers import LlamaConfig
assert cpu_readout.build_problem() is None, cpu_readout.build_problem()
config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
                     intermediate_size=32, vocab_size=32)
layer = AsymKVCache.from_preset("compact", config, key_block_size=16, residual_length=8).layers[0]
k, v = torch.randn(2, 1, 2, 80, 16, generator=torch.Generator().manual_seed(0))
layer.update(k, v)
empty = torch.zeros(1, 2, 0, 16)
native = layer.update(empty, empty)
os.environ[cpu_readout.ENV_VAR] = "torch"
plain = layer.update(empty, empty)
assert all(torch.equal(a, b) for a, b in zip(native, plain)), "the native read-out differs from torch's"
print(cpu_readout.native_library()._name)
"""


@pytest.mark.slow(reason="two processes import torch and compile the C files at once: ~20 s; fast twin: "
                         "tests/kernels/test_cpu_readout_build.py::"
                         "test_two_threads_building_at_once_never_expose_a_partial_library")
def test_two_processes_building_into_one_empty_folder_both_work(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "HF_ASYMKV_CACHE": str(cache), cpu_readout.ENV_VAR: "native", "OMP_NUM_THREADS": "1"}
    with Watcher(cache / "native") as watcher:
        workers = [subprocess.Popen([sys.executable, "-c", BUILD_AND_READ], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [worker.communicate(timeout=600) for worker in workers]
    for worker, (out, err) in zip(workers, results):
        assert worker.returncode == 0, err[-3000:]
    built = _only_library(cache / "native")
    assert [out.strip() for out, _ in results] == [str(built)] * 2
    assert watcher.seen == {built.name: {hashlib.sha256(built.read_bytes()).hexdigest()}}

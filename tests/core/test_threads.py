"""Threads sharing one model (issue 56): each request has its own cache, the model, the registered attention and the
process-wide tables are shared; every thread's tokens (and logits, bit for bit) equal what the same request gives
run alone.

Requests cover every preset, the dynamic and the static cache, the dense read-out through the native CPU read-out
(``HF_ASYMKV_CPU_READOUT=native``: its library loaded by whichever thread comes first) and the fused attention
(``register_attention()`` called by every thread, ``attn_implementation="asymkv_sdpa"``). Small blocks make every
request quantize in its prefill and in its decode steps.
"""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import FIRST_PLAIN_TOKEN, VOCAB

from hf_asymkv import AsymKVCache, cache_kwargs, register_attention
from hf_asymkv.core.attention import ATTN_IMPLEMENTATION
from hf_asymkv.core.registry import PRESET_NAMES
from hf_asymkv.kernels import cpu_readout
from hf_asymkv.kernels.once import computed_once

THREADS = 4
SMALL = dict(key_block_size=8, residual_length=4, max_growth_tokens=16)  # blocks close in the prefill and decode
NEW_TOKENS = 8
JOBS = [(preset, static, fused) for preset in PRESET_NAMES for static in (False, True) for fused in (False, True)]
# the fast twin: four requests, the four (static, fused) kinds, four presets
SAMPLE = [("balanced", False, False), ("compact", True, False), ("max", False, True), ("quality", True, True)]


@pytest.fixture(scope="module")
def models(llama) -> dict[bool, torch.nn.Module]:
    """The shared tiny Llama with the default attention (False) and with the fused one (True)."""
    register_attention()
    fused = copy.deepcopy(llama)
    fused.set_attn_implementation(ATTN_IMPLEMENTATION)
    return {False: llama, True: fused}


@pytest.fixture
def native_readout(monkeypatch) -> list:
    """The native read-out required (an error where it cannot serve), loaded afresh by the first thread that reads;
    yields a list that gets one entry per native read-out call."""
    monkeypatch.setenv(cpu_readout.ENV_VAR, "native")
    assert cpu_readout.build_problem() is None, cpu_readout.build_problem()  # built once, outside the timed threads
    cpu_readout._library.cache_clear()
    calls = []
    for name in ("read_plain", "read_rotated"):
        real = getattr(cpu_readout, name)
        monkeypatch.setattr(cpu_readout, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    return calls


def _request(models, job: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request on its own cache: ``(tokens, logits)`` of a greedy generation."""
    preset, static, fused = job
    if fused:
        register_attention()  # what each request handler of a server may do: idempotent, guarded
    model = models[fused]
    cache = AsymKVCache.from_preset(preset, model.config, **SMALL, **({"max_cache_len": 48} if static else {}))
    prompt = torch.randint(FIRST_PLAIN_TOKEN, VOCAB, (1, 26 + seed % 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=NEW_TOKENS, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits)


def _check_threads_equal_serial(models, jobs: list, rounds: int) -> None:
    requests = [(job, seed) for seed, job in enumerate(jobs * rounds)]
    serial = [_request(models, job, seed) for job, seed in requests]
    with ThreadPoolExecutor(THREADS) as pool:
        threaded = list(pool.map(lambda request: _request(models, *request), requests))
    for (job, seed), (tokens, logits), (want_tokens, want_logits) in zip(requests, threaded, serial):
        assert torch.equal(tokens, want_tokens), f"request {seed} {job}: tokens differ from its serial run"
        assert torch.equal(logits, want_logits), f"request {seed} {job}: logits differ from its serial run"


def test_threads_equal_serial_runs(models, native_readout, single_thread):
    """4 threads, one request each: dynamic and static, dense and fused."""
    _check_threads_equal_serial(models, SAMPLE, rounds=1)
    assert native_readout, "the native read-out never ran"


@pytest.mark.slow(reason="24 request kinds x 2 rounds, serial then on 4 threads: ~30 s; fast twin: "
                         "tests/core/test_threads.py::test_threads_equal_serial_runs")
def test_threads_equal_serial_runs_every_kind(models, native_readout, single_thread):
    """4 threads x 48 requests: every preset x dynamic/static x dense/fused, twice."""
    _check_threads_equal_serial(models, JOBS, rounds=2)
    assert native_readout, "the native read-out never ran"


def test_computed_once_runs_once_under_threads():
    """8 threads ask at once for a value that takes a while to compute: it is computed once, all get it."""
    runs = []

    @computed_once
    def value(x):
        runs.append(x)
        time.sleep(0.05)
        return object()

    barrier = threading.Barrier(8)

    def ask():
        barrier.wait()
        return value(3)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: ask(), range(8)))
    assert runs == [3] and all(g is got[0] for g in got)

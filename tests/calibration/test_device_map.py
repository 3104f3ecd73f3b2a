"""Models spread over devices by an accelerate device map: calibration statistics, the CLI and `AsymKVCache`
give what they give on one device, and every cache layer keeps its tensors on its own layer's device.

On a CPU-only machine the maps mix ``"cpu"`` and ``"disk"`` entries: accelerate then really dispatches the model
(weights of disk entries are meta placeholders, loaded by hooks at each forward), which is the code path a model
too large for one device takes. Layers on two different devices need a GPU (``test_layers_on_cpu_and_gpu``).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_asymkv import AsymKVCache, cache_kwargs
from hf_asymkv.calibration.calibrate import calibrate_model, scales_from_stats
from hf_asymkv.cli import main
from hf_asymkv.core.scales import KVScales
from hf_asymkv.models import load_model

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.releases]

MODULES = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "model.rotary_emb", "lm_head")
MAPS = {
    "layer1-on-disk": dict.fromkeys(MODULES, "cpu") | {"model.layers.1": "disk"},
    "embeddings-and-layer0-on-disk": dict.fromkeys(MODULES, "cpu") | {"model.embed_tokens": "disk",
                                                                      "model.layers.0": "disk", "lm_head": "disk"},
}


def tensors(obj, seen=None):
    """Every tensor reachable through the attributes of ``obj`` (a cache layer and its stores)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item
                elif hasattr(item, "__dict__"):
                    yield from tensors(item, seen)
        elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.device, torch.dtype)):
            yield from tensors(value, seen)


def layer_devices(cache: AsymKVCache) -> list[set[torch.device]]:
    return [{t.device for t in tensors(layer)} for layer in cache.layers]


@pytest.fixture(scope="module")
def samples():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (1, 96), generator=gen) for _ in range(2)]


@pytest.fixture(scope="module")
def reference(workdir, samples):
    model, _ = load_model(str(workdir / "model"))
    return model, calibrate_model(model, samples, chunk_size=40, progress=False)


# transformers 5.0-5.22 compare input_ids' device with the model's first parameter, which sits on `meta` when the
# embeddings are offloaded to disk, and warn; accelerate's hooks move the weights in at each forward (the test checks
# the outputs). The newest releases no longer warn.
@pytest.mark.filterwarnings("ignore:You are calling .generate.. with the `input_ids` being on a device type:UserWarning")
@pytest.mark.parametrize("name", list(MAPS))
def test_calibration_and_cache_through_an_accelerate_dispatch(workdir, tmp_path, samples, reference, name):
    ref_model, ref_stats = reference
    model, _ = load_model(str(workdir / "model"), device_map=MAPS[name], offload_folder=tmp_path / "offload")
    assert model.hf_device_map == MAPS[name]
    stats = calibrate_model(model, samples, chunk_size=40, progress=False)
    assert sorted(stats) == sorted(ref_stats)
    for i in stats:
        assert torch.equal(stats[i].k_absmax, ref_stats[i].k_absmax)
        assert torch.equal(stats[i].v_absmax, ref_stats[i].v_absmax)

    scales = scales_from_stats(stats, model.config)
    prompt = samples[0][:, :60]
    outputs = []
    for m in (ref_model, model):
        cache = AsymKVCache(m.config, scales=scales, residual_length=8, key_block_size=8)
        outputs.append(m.generate(prompt, **cache_kwargs(cache), max_new_tokens=6, do_sample=False))
        assert layer_devices(cache) == [{torch.device("cpu")}] * 2
    assert torch.equal(outputs[0], outputs[1])


def test_calibrate_cli_with_a_device_map_file(workdir, tmp_path):
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps(MAPS["layer1-on-disk"]))
    outs = [tmp_path / "plain.safetensors", tmp_path / "mapped.safetensors"]
    common = ["calibrate", "--model", str(workdir / "model"), "--data", str(workdir / "data.txt"), "--seq-len", "96",
              "--num-samples", "2", "--chunk-size", "40", "--quiet"]
    assert main([*common, "--out", str(outs[0])]) == 0
    assert main([*common, "--out", str(outs[1]), "--device-map", str(map_file),
                 "--offload-folder", str(tmp_path / "offload")]) == 0
    plain, mapped = (KVScales.load(p) for p in outs)
    for i in plain.k_channel_absmax:
        assert torch.equal(plain.k_channel_absmax[i], mapped.k_channel_absmax[i])
        assert torch.equal(plain.v_head_absmax[i], mapped.v_head_absmax[i])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="two devices need a GPU")
def test_layers_on_cpu_and_gpu(workdir, samples, reference):
    """Layer 1 (and the head) on the GPU, the rest on the CPU, each computed where it lives (main_device="cpu":
    accelerate does not bring the CPU layers to the GPU)."""
    from accelerate import dispatch_model

    ref_model, ref_stats = reference
    model, _ = load_model(str(workdir / "model"))
    device_map = dict.fromkeys(MODULES, "cpu") | {"model.layers.1": 0, "model.norm": 0, "lm_head": 0}
    model = dispatch_model(model, device_map=device_map, main_device="cpu")
    stats = calibrate_model(model, samples, chunk_size=40, progress=False)
    for i in stats:  # the GPU's matmuls round differently
        torch.testing.assert_close(stats[i].k_absmax, ref_stats[i].k_absmax, rtol=1e-4, atol=1e-5)

    scales = scales_from_stats(stats, model.config)
    prompt = samples[0][:, :60]
    logits = []
    for m in (ref_model, model):
        cache = AsymKVCache(m.config, scales=scales, residual_length=8, key_block_size=8)
        logits.append(m(prompt, **cache_kwargs(cache)).logits[:, -1].cpu())
        logits.append(m(prompt[:, :1], **cache_kwargs(cache)).logits[:, -1].cpu())  # a decode step over quantized blocks
        if m is model:
            assert layer_devices(cache) == [{torch.device("cpu")}, {torch.device("cuda", 0)}]
    torch.testing.assert_close(logits[2], logits[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(logits[3], logits[1], rtol=1e-3, atol=1e-3)

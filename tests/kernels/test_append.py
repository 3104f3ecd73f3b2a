"""The Triton append kernel (hf_asymkv/kernels/triton_append.py) under Triton's interpreter on CPU tensors: bit for bit
the torch path's codes, scales, zeros and wide channels (``encode_blocks`` on ``stored_form``) for every preset's
formats and the others the cache accepts, NaN/inf included; through the dynamic and static stores with the switch
forced; and the dispatcher's choices."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import layer_config, tiered

from hf_asymkv import AsymKVConfig
from hf_asymkv.core import append
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.core.presets import PRESETS
from hf_asymkv.core.quant import QuantSpec
from hf_asymkv.core.static import StaticAsymKVLayer
from hf_asymkv.core.store import encode_blocks, stored_form
from hf_asymkv.kernels.append import APPEND_ENV_VAR, launch_append, unserved

# The inputs carry NaN and +-inf on purpose (stored as 0 and the group's extremes, as the torch path stores them): numpy
# under Triton's interpreter warns when the kernel's masked arithmetic touches them (`inf - inf` in a lane it then
# discards). A GPU computes the same lanes silently; the stored bits are compared with the torch path's below.
# `_drive` puts a NaN in the values on purpose too: the cache's own warning about it (tested in
# tests/core/test_extremes.py) says nothing here.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning"),
              # (the same for fp8 keys: the interpreter casts the NaN lanes to an integer type numpy warns about)
              pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:quantized K/V hold .* NaN/inf values:RuntimeWarning")]

def _specs(config: AsymKVConfig, head_dim: int) -> tuple[QuantSpec, QuantSpec]:
    resolved = config.resolved([head_dim])
    return resolved.key_spec(), resolved.value_spec()


def _cases() -> dict[str, tuple[QuantSpec, int, torch.dtype]]:
    """``{id: (spec, head_dim, input dtype)}``: both specs of every preset (head_dim 64, bf16 as on a GPU), a few at
    head_dim 128 and in float32 / float16, and the other formats and layouts the cache accepts."""
    cases = {}
    for name, config in PRESETS.items():
        keys, values = _specs(config, 64)
        cases[f"{name}-keys"], cases[f"{name}-values"] = (keys, 64, torch.bfloat16), (values, 64, torch.bfloat16)
    for name in ("balanced", "compact", "max"):
        keys, values = _specs(PRESETS[name], 128)
        cases[f"{name}-keys-d128-fp16"] = (keys, 128, torch.float16)
        cases[f"{name}-values-d128-fp32"] = (values, 128, torch.float32)
    small = dict(key_block_size=16)
    others = {"fp8_e4m3-keys": dict(key_format="fp8_e4m3"), "fp8_e5m2-keys": dict(key_format="fp8_e5m2"),
              "int2-keys": dict(key_format="int2", key_symmetric=False), "int8-values": dict(value_bits=8),
              "int5-values-unrotated": dict(value_bits=5, value_rotation=False),
              "int6-symmetric-values": dict(value_bits=6, value_symmetric=True),
              "int4-values-groups-of-16": dict(value_group_size=16),
              "per-token-keys": dict(key_granularity="token", key_format="int4", key_symmetric=False),
              "rotated-keys": dict(key_rotation=True),
              "symmetric-wide-keys": dict(key_format="int3", key_symmetric=True, key_wide_fraction=0.25),
              "int8-asymmetric-keys": dict(key_symmetric=False)}
    for name, settings in others.items():
        keys, values = _specs(PRESETS["balanced"].replace(**small, **settings), 64)
        cases[name] = (values if "values" in name else keys), 64, torch.float32
    int1 = QuantSpec("int1", "channel", None, False, torch.bfloat16, block_size=32)  # 1-bit keys: 2-means per channel
    cases["int1-keys-per-channel"] = (int1, 64, torch.bfloat16)
    head_dim_packed = QuantSpec("int3", "token", 64, False, torch.float16, block_size=4)  # blocks too short to pack
    cases["int3-packed-along-head-dim"] = (head_dim_packed, 64, torch.float32)  # along tokens
    return cases


CASES = _cases()


def _tokens(spec: QuantSpec, head_dim: int, dtype: torch.dtype, blocks: int = 2, seed: int = 0) -> torch.Tensor:
    """``[2, 2, blocks * bs, D]``: channels 50x apart in width, one constant channel, a zero token, NaN and +-inf."""
    g = torch.Generator().manual_seed(seed)
    widths = torch.linspace(0.05, 2.5, head_dim)[torch.randperm(head_dim, generator=g)]
    x = torch.randn(2, 2, blocks * spec.block_size, head_dim, generator=g) * widths + 0.2
    x[:, :, :, 1] = 0.75
    x[0, 0, 1] = 0.0
    x[0, 1, 2, 3], x[1, 0, 3, 4], x[1, 1, 0, 5] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype)


def _empty_store(spec: QuantSpec, b: int, h: int, m: int, head_dim: int) -> dict[str, torch.Tensor | None]:
    """Destination buffers for ``m`` tokens, filled with a pattern the kernel must overwrite."""
    tg, cg = spec.groups(head_dim)
    r = spec.wide_count(head_dim)
    codes = torch.full((b, h, m, spec.packed_dim(head_dim)), 0xA5, dtype=torch.uint8).view(spec.code_dtype)
    scales = torch.full((b, h, m // tg, head_dim // cg), 3.0, dtype=spec.scale_dtype)
    return dict(codes=codes, scales=scales, zeros=None if spec.symmetric else scales.clone(),
                wide_bits=torch.full((b, h, m, -(-r // 8)), 0xA5, dtype=torch.uint8) if r else None,
                wide_channels=torch.full((b, h, m // spec.block_size, r), 0xA5, dtype=torch.uint8) if r else None)


def _assert_same(store: dict, codes, scale, zero, wide) -> None:
    assert torch.equal(store["codes"].view(torch.uint8), codes.data.view(torch.uint8))
    assert torch.equal(store["scales"], scale)
    assert zero is None or torch.equal(store["zeros"], zero)
    if wide is not None:
        assert torch.equal(store["wide_bits"], wide.bits) and torch.equal(store["wide_channels"], wide.channels)


@pytest.mark.parametrize("case", tiered(list(CASES), {"balanced-keys", "balanced-values", "compact-keys", "max-values"},
                                        "the other formats and layouts under Triton's interpreter (~1-7 s each); fast "
                                        "twin (int8 channel keys, rotated int4 values, wide channels, 1-bit values): "
                                        "tests/kernels/test_append.py::test_kernel_stores_the_torch_paths_bits"))
def test_kernel_stores_the_torch_paths_bits(case):
    spec, head_dim, dtype = CASES[case]
    x = _tokens(spec, head_dim, dtype)
    store = _empty_store(spec, *x.shape[:3], head_dim)
    counts = torch.zeros(2, dtype=torch.long)
    launch_append(x, append.block_format(spec, head_dim), counts=counts, **store)
    _assert_same(store, *encode_blocks(stored_form(x, spec, clean=True), spec))
    assert counts.tolist() == [3, 0]  # NaN, inf, -inf; no metadata beyond its dtype


@pytest.mark.parametrize("case", ["balanced-keys", "symmetric-wide-keys"])
def test_a_calibrated_scale_is_used_as_given(case):
    """A calibrated key range (the layer applies the widen/clip policy and hands over the block's scale): the kernel
    quantizes with it, wide channels taking the wider code's step of the same range."""
    spec, head_dim, dtype = CASES[case]
    x = _tokens(spec, head_dim, dtype)
    scale = (x.float().nan_to_num(posinf=0, neginf=0).abs().amax(2, keepdim=True) / 200).to(spec.scale_dtype)
    scale = scale.expand(-1, -1, 2, -1).contiguous()  # one per block: smaller than the range, so codes clip
    store = _empty_store(spec, *x.shape[:3], head_dim)
    launch_append(x, append.block_format(spec, head_dim), counts=torch.zeros(2, dtype=torch.long), calibrated=scale,
                  **store)
    _assert_same(store, *encode_blocks(x, spec, scale))


def test_static_slots_take_only_the_valid_blocks():
    spec, head_dim, dtype = CASES["compact-keys"]
    x = _tokens(spec, head_dim, dtype, blocks=3)
    slots_store = _empty_store(spec, 2, 2, 4 * spec.block_size, head_dim)
    before = {k: None if v is None else v.clone() for k, v in slots_store.items()}
    counts = torch.zeros(2, dtype=torch.long)
    targets, valid = torch.tensor([3, 0, 1]), torch.tensor([True, True, False])
    launch_append(x, append.block_format(spec, head_dim), counts=counts, slots=targets, valid=valid, **slots_store)
    codes, scale, zero, wide = encode_blocks(x, spec)
    bs = spec.block_size
    for f, slot in enumerate(targets.tolist()):
        source = slots_store if valid[f] else before
        got = {k: None if v is None else v[:, :, slot * bs : (slot + 1) * bs] for k, v in source.items()}
        got["scales"], got["zeros"] = source["scales"][:, :, slot : slot + 1], source["zeros"][:, :, slot : slot + 1]
        got["wide_channels"] = source["wide_channels"][:, :, slot : slot + 1]
        expected = (codes.token_slice(f * bs, (f + 1) * bs), scale[:, :, f : f + 1], zero[:, :, f : f + 1],
                    wide.token_slice(f * bs, (f + 1) * bs, bs))
        if valid[f]:
            _assert_same(got, *expected)
        else:
            assert all(torch.equal(got[k], before[k][:, :, : got[k].shape[2]] if k not in ("scales", "zeros",
                       "wide_channels") else got[k]) for k in got)
    assert torch.equal(slots_store["codes"][:, :, 2 * bs : 3 * bs], before["codes"][:, :, 2 * bs : 3 * bs])
    # the invalid block's non-finite element (in its tokens) is not counted
    assert counts[0] == (~torch.isfinite(x[:, :, : 2 * bs])).sum()


def _drive(layer, steps: list[int], head_dim: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    for n in steps:
        k, v = (torch.randn(2, 2, n, head_dim, generator=g).to(dtype) for _ in range(2))
        k[..., 7] *= 30
        v[0, 0, 0, 0] = float("nan")
        layer.update(k, v)


@pytest.mark.parametrize("preset", ["compact", "max"])
def test_dynamic_store_with_the_kernel_forced_stores_the_same(preset, monkeypatch):
    """A prefill and token steps through AsymKVLayer: the buffers, the read-out and the stats equal the torch path's;
    the kernel's non-finite count is read at ``stats``, not in the step."""
    config = PRESETS[preset].replace(key_block_size=16, residual_length=16, sink_tokens=2).resolved([64])
    layers = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(APPEND_ENV_VAR, backend)
        layers[backend] = layer = AsymKVLayer(config.layer_config())
        _drive(layer, [40] + [1] * 26, 64, torch.bfloat16)
    torch_layer, kernel_layer = layers["torch"], layers["triton"]
    assert kernel_layer.key_store.blocks.length == 48  # three flushes
    for a, b in zip(torch_layer.stores, kernel_layer.stores):
        for name, buf in a.blocks.buffers().items():
            assert torch.equal(buf.live.view(torch.uint8), b.blocks.buffers()[name].live.view(torch.uint8)), name
    on_device = sum(int(store.blocks.device_counts[0]) for store in kernel_layer.stores)
    assert on_device == torch_layer.stats["nonfinite_values"] > 0  # the update's first value NaN, in each flush
    with pytest.warns(RuntimeWarning, match="NaN/inf"):
        assert kernel_layer.stats == torch_layer.stats
    for a, b in ((kernel_layer.keys, torch_layer.keys), (kernel_layer.values, torch_layer.values)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # the window holds the exact NaNs


@pytest.mark.parametrize("policy", ["widen", "clip"])
def test_calibrated_layer_with_the_kernel_forced(policy, monkeypatch):
    spec, value_spec = _specs(PRESETS["balanced"], 64)
    config = layer_config(spec, value_spec, 16, residual_length=16, overflow_policy=policy)
    absmax = torch.full((2, 64), 2.0)
    layers = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(APPEND_ENV_VAR, backend)
        layers[backend] = layer = AsymKVLayer(config, key_absmax=absmax)
        _drive(layer, [48, 1, 1], 64, torch.float32)
    a, b = layers["torch"].key_store.blocks, layers["triton"].key_store.blocks
    assert torch.equal(a.codes.live, b.codes.live) and torch.equal(a.scales.live, b.scales.live)
    with pytest.warns(RuntimeWarning):
        assert layers["triton"].stats == layers["torch"].stats and layers["torch"].stats["key_overflow_channels"]


def test_static_store_with_the_kernel_forced_stores_the_same(monkeypatch):
    config = PRESETS["compact"].replace(key_block_size=16, residual_length=16, sink_tokens=2).resolved([64])
    layers = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(APPEND_ENV_VAR, backend)
        layers[backend] = layer = StaticAsymKVLayer(config.layer_config(), max_cache_len=96)
        _drive(layer, [40] + [1] * 40, 64, torch.float16)
    for a, b in zip(layers["torch"].tensors(), layers["triton"].tensors()):  # NaN where the window holds one
        as_bytes = a.element_size() == 1
        torch.testing.assert_close(b.view(torch.uint8) if as_bytes else b, a.view(torch.uint8) if as_bytes else a,
                                   rtol=0, atol=0, equal_nan=True)
    assert layers["triton"].stats == layers["torch"].stats and layers["torch"].stats["nonfinite_values"] == 10


def test_metadata_beyond_float16_saturates_and_is_counted(monkeypatch):
    """The torch path widens a dynamic store's float16 metadata to float32 (a host check per flush); the kernel path
    keeps float16, saturates those groups and counts them."""
    config = PRESETS["balanced"].replace(key_block_size=16, residual_length=16).resolved([64])
    monkeypatch.setenv(APPEND_ENV_VAR, "triton")
    layer = AsymKVLayer(config.layer_config())
    k, v = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    v[0, 1, 10, :] = -1e5  # a rotated token of -1e5 everywhere: its group's zero is below float16's range
    layer.update(k, v)
    assert layer.value_store.blocks.scales.data.dtype == torch.float16
    assert layer.stats["saturated_metadata_groups"] == 1


@pytest.mark.parametrize("spec,head_dim,phrase", [
    (QuantSpec("int8", "tensor", None, True, torch.float32, block_size=16), 64, "'tensor' granularity"),
    (QuantSpec("int4", "token", 16, False, torch.float16, block_size=16), 80, "head_dim=80"),
    (QuantSpec("int8", "channel", None, True, torch.bfloat16, block_size=24), 64, "blocks of 24 tokens"),
    (QuantSpec("int4", "token", 24, False, torch.float16, block_size=16), 96, "head_dim=96"),
], ids=["tensor-granularity", "head-dim-80", "block-24", "head-dim-96"])
def test_unserved_formats_stay_on_the_torch_path(spec, head_dim, phrase, monkeypatch):
    problem = unserved(append.block_format(spec, head_dim), head_dim)
    assert phrase in problem
    cuda = torch.device("cuda")
    assert not append.choose_kernel("auto", cuda, False, problem, spec.fmt)  # auto: the torch path, on a GPU too
    with pytest.raises(ValueError, match=f"{APPEND_ENV_VAR}=triton cannot quantize these {spec.fmt} blocks: .*{phrase}"):
        append.choose_kernel("triton", cuda, False, problem, spec.fmt)
    monkeypatch.setenv(APPEND_ENV_VAR, "triton")  # and through a store
    layer = AsymKVLayer(layer_config(spec, dataclasses.replace(spec), spec.block_size, residual_length=0))
    with pytest.raises(ValueError, match=phrase):
        layer.update(torch.randn(1, 2, spec.block_size, head_dim), torch.randn(1, 2, spec.block_size, head_dim))


@pytest.mark.parametrize("backend,device,compiling,expected", [
    ("auto", "cuda", False, True), ("auto", "cpu", False, False), ("auto", "cuda", True, False),
    ("torch", "cuda", False, False), ("triton", "cpu", False, True), ("triton", "cuda", True, True),
], ids=["auto-cuda", "auto-cpu", "auto-compiled", "torch", "triton-cpu-interpreted", "triton-compiled-cuda"])
def test_who_quantizes(backend, device, compiling, expected):
    assert append.choose_kernel(backend, torch.device(device), compiling, None, "int8") is expected


@pytest.mark.parametrize("preset,wide", [("balanced", False), ("compact", True), ("max", True)])
def test_auto_keeps_wide_channel_keys_on_the_torch_path(monkeypatch, preset, wide):
    """Under ``auto`` on a GPU, keys with wide channels are not sent to the kernel (its sm_90 compile did not finish
    in 45 minutes here); the others are asked of :func:`choose_kernel` as before."""
    monkeypatch.delenv(APPEND_ENV_VAR, raising=False)
    asked = []
    monkeypatch.setattr(append, "choose_kernel", lambda *args: asked.append(args) or True)
    spec = PRESETS[preset].key_spec()
    on_gpu = type("Blocks", (), {"device": torch.device("cuda"), "shape": (1, 2, spec.block_size, 64)})()
    assert append.uses_kernel(on_gpu, spec) is (not wide) and bool(asked) is (not wide)


def test_forced_kernel_refuses_a_compiled_graph_on_cpu():
    with pytest.raises(ValueError, match="compiled graph on CPU tensors"):
        append.choose_kernel("triton", torch.device("cpu"), True, None, "int8")


def test_bad_backend_name_is_named(monkeypatch):
    monkeypatch.setenv(APPEND_ENV_VAR, "cuda")
    spec = CASES["balanced-keys"][0]
    with pytest.raises(ValueError, match=r"HF_ASYMKV_APPEND_BACKEND='cuda' is not an append backend; allowed: "
                                         r"\['auto', 'triton', 'torch'\]"):
        append.uses_kernel(torch.zeros(1, 1, 128, 64), spec)


def test_codes_whose_rows_are_not_contiguous_are_refused():
    spec, head_dim, dtype = CASES["balanced-keys"]
    x = _tokens(spec, head_dim, dtype, blocks=1)
    store = _empty_store(spec, 2, 2, spec.block_size, head_dim)
    store["codes"] = torch.zeros(2, 2, head_dim, spec.block_size, dtype=torch.int8).transpose(-1, -2)
    with pytest.raises(ValueError, match="codes whose rows are not contiguous"):
        launch_append(x, append.block_format(spec, head_dim), counts=torch.zeros(2, dtype=torch.long), **store)

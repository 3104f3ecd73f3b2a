"""Inputs for the kernel tests, built with the core's quantization functions (so the codes have exactly the
layout the cache stores), and the float64 reference attention over their dequantized values."""

from __future__ import annotations

import dataclasses

import torch

from hf_asymkv.core.config import AsymKVConfig
from hf_asymkv.core.presets import PRESETS
from hf_asymkv.core.quant import QuantSpec, dequantize
from hf_asymkv.core.rotation import dequantize_rotated, rotate
from hf_asymkv.core.store import encode_blocks
from hf_asymkv.kernels.regions import ExactSegment, QuantizedRegion, StoredCodes

PAD = 13  # left padding of batch row 1 (columns hidden from every query of that row)


def formats() -> dict[str, tuple[AsymKVConfig, int]]:
    """Every preset's key/value formats, plus fp8 keys and 1-bit values: ``{id: (config, block_size)}``."""
    configs = {name: config for name, config in PRESETS.items()}
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        configs[f"{fmt}-keys"] = PRESETS["balanced"].replace(key_format=fmt)
    configs["int1-values"] = PRESETS["tight"].replace(key_wide_fraction=0.25, value_bits=1)
    return {name: (config, config.key_block_size) for name, config in configs.items()}


def specs(config: AsymKVConfig, head_dim: int) -> tuple[QuantSpec, QuantSpec]:
    resolved = config.resolved([head_dim])
    return resolved.key_spec(), resolved.value_spec()


def stored(x: torch.Tensor, spec: QuantSpec, block: int) -> tuple[StoredCodes, torch.Tensor]:
    """Quantize ``x`` ``[B, H, N, D]`` as the cache does: ``(StoredCodes, its dequantized float64 values)``."""
    spec = dataclasses.replace(spec, block_size=block)
    source = rotate(x) if spec.rotated else x.float()
    codes, scale, zero, wide = encode_blocks(source, spec)  # compact's keys have wide channels
    if spec.rotated:
        dense = dequantize_rotated(codes, scale, zero, spec, dtype=torch.float32).double()
    else:
        dense = dequantize(codes, scale, zero, spec, dtype=torch.float32, wide=wide).double()
    return StoredCodes(codes.data, scale, zero, codes.bits, spec.symmetric, codes.layout, codes.block_size,
                       spec.rotated, None if wide is None else wide.bits,
                       None if wide is None else wide.channels), dense


def build(key_spec: QuantSpec, value_spec: QuantSpec, block: int, *, batch=2, heads=2, head_dim=64, sinks=4,
          blocks=2, tail=37, dtype=torch.float32, seed=0):
    """A layer's K/V: ``(region or None, segments, dense K, dense V)``, in token order sinks, blocks, tail; the
    dense tensors are float64 ``[B, H, kv, D]``."""
    g = torch.Generator().manual_seed(seed)

    def draw(n: int, outliers: bool) -> torch.Tensor:
        x = torch.randn(batch, heads, n, head_dim, generator=g)
        if outliers:
            x[..., 3] *= 20  # a key outlier channel, as real keys have
        return x.to(dtype)

    sink_k, sink_v = draw(sinks, True), draw(sinks, False)
    tail_k, tail_v = draw(tail, True), draw(tail, False)
    region, parts_k, parts_v = None, [sink_k.double()], [sink_v.double()]
    if blocks:
        keys, dense_k = stored(draw(blocks * block, True), key_spec, block)
        values, dense_v = stored(draw(blocks * block, False), value_spec, block)
        region = QuantizedRegion(keys, values, start=sinks)
        parts_k.append(dense_k)
        parts_v.append(dense_v)
    segments = (ExactSegment(sink_k, sink_v, 0), ExactSegment(tail_k, tail_v, sinks + blocks * block))
    return region, segments, torch.cat(parts_k + [tail_k.double()], 2), torch.cat(parts_v + [tail_v.double()], 2)


def padded_causal_mask(batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """``[B, 1, q, kv]`` bool: causal (bottom-right aligned), batch row 1 left-padded by :data:`PAD` tokens."""
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None].repeat(batch, 1, 1, 1)
    if batch > 1:
        mask[1, :, :, :PAD] = False
    return mask


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              scaling: float) -> torch.Tensor:
    """float64 softmax attention ``[B, q, Hq, D]`` of ``query`` ``[B, Hq, q, D]`` over ``[B, H, kv, D]``; ``mask``
    bool or additive ``[B|1, 1|Hq, q, kv]``, None for causal."""
    n_rep = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(n_rep, 1), values.repeat_interleave(n_rep, 1)
    scores = query.double() @ k.transpose(-1, -2) * scaling
    q_len, kv_len = scores.shape[-2:]
    if mask is None:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)

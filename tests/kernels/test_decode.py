"""The Triton decode attention (under the interpreter) against a float64 reference over the dequantized K/V.

Both sides read the same codes, so the difference is float rounding only: SQNR >= 60 dB in float32 (measured
~110-120 dB), looser for half-precision queries and exact tokens (their output is rounded to 8 or 11 bits).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from helpers import tiered
from kernel_cases import PAD, build, formats, padded_causal_mask, reference, specs, stored

from hf_asymkv.core.presets import PRESETS
from hf_asymkv.core.quant import QuantSpec, sqnr_db
from hf_asymkv.kernels import decode
from hf_asymkv.kernels.decode import (
    KernelLaunch,
    LaunchConfig,
    codes_left,
    decode_attention,
    fast_path,
    fast_warps,
    launch_decode_attention,
    pipeline_stages,
    plan_decode_attention,
    settle_spills,
    spill_alternatives,
    two_key_blocks,
    wide_query_loads,
)
from hf_asymkv.kernels.regions import ExactSegment, QuantizedRegion, StoredCodes

# The int8 key products (triton_codes._int8_key_scores) compute 127 / max|q| for every row of a tile, padded rows
# (max 0) too, and keep 1.0 there with tl.where: numpy under Triton's interpreter warns on the discarded lanes, a GPU
# does not. The outputs are compared with the float64 reference below.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning")

FLOAT32_DB = 60.0
HALF_DB = {torch.bfloat16: 40.0, torch.float16: 55.0}
FORMATS = formats()
NAMES = list(FORMATS)


def _attend(key_spec: QuantSpec, value_spec: QuantSpec, block: int, *, n_rep=3, q_len=5, head_dim=64,
            dtype=torch.float32, tiles_per_split=None, seed=0, launch=None, query_outlier=1.0, **shape
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kernel output, float64 reference)`` for a left-padded batch of 2 with a causal mask; the query's channel 3
    times ``query_outlier``."""
    region, segments, k, v = build(key_spec, value_spec, block, head_dim=head_dim, dtype=dtype, seed=seed, **shape)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(2, k.shape[1] * n_rep, q_len, head_dim, generator=g)
    query[..., 3] *= query_outlier
    query = query.to(dtype)
    mask = padded_causal_mask(2, q_len, k.shape[2])
    if launch is None:
        out = decode_attention(query, head_dim**-0.5, quantized=region, exact=segments, attention_mask=mask,
                               tiles_per_split=tiles_per_split)
    else:
        out = launch_decode_attention(query, head_dim**-0.5, quantized=region, exact=tuple(segments),
                                      attention_mask=mask, tiles_per_split=tiles_per_split, launch=launch)
    assert out.shape == (2, q_len, k.shape[1] * n_rep, head_dim) and out.dtype == dtype
    return out, reference(query, k, v, mask, head_dim**-0.5)


def _preset(name: str, head_dim: int = 64, **kwargs):
    """A preset's formats and block size; 128 quantized tokens unless ``blocks`` says otherwise."""
    config, block = FORMATS[name]
    kwargs.setdefault("blocks", max(1, 128 // block))
    return _attend(*specs(config, head_dim), block, head_dim=head_dim, **kwargs)


# every format meets every GQA width and both query lengths (not every triple: the interpreter is slow)
HEADS_AND_QUERIES = {"mha-q1": (1, 1), "gqa3-q5": (3, 5), "gqa4-q1": (4, 1), "gqa4-q5": (4, 5)}


@pytest.mark.parametrize("heads_and_query", tiered(list(HEADS_AND_QUERIES), {"gqa3-q5"}, "every format at the other GQA "
                                                   "widths and query lengths under Triton's interpreter (~3-10 s "
                                                   "each); fast twin, every format at GQA 3 with 5 query tokens: "
                                                   "tests/kernels/test_decode.py::test_formats"))
@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_formats(name, heads_and_query):
    n_rep, q_len = HEADS_AND_QUERIES[heads_and_query]
    out, ref = _preset(name, n_rep=n_rep, q_len=q_len)
    assert sqnr_db(ref, out) >= FLOAT32_DB


@pytest.mark.parametrize("name", tiered(NAMES, {"balanced", "compact"}, "the other formats at head_dim 128 under "
                                        "Triton's interpreter; fast twin: tests/kernels/test_decode.py::test_head_dim_128"))
def test_head_dim_128(name):
    out, ref = _preset(name, head_dim=128, n_rep=4, blocks=1)
    assert sqnr_db(ref, out) >= FLOAT32_DB


@pytest.mark.parametrize("name", tiered(list(PRESETS), {"balanced"}, "the other presets at head_dim 256 under Triton's "
                                        "interpreter; fast twin: "
                                        "tests/kernels/test_decode.py::test_head_dim_256_reads_two_value_groups_on_the_fast_path"))
def test_head_dim_256_reads_two_value_groups_on_the_fast_path(name):
    # Gemma's head_dim: values carry a scale per 128 channels (the default group), two per token; the fast path
    # takes one product per group into accumulators of their own (measured 68-88 dB)
    config, block = FORMATS[name]
    region, _, _, _ = build(*specs(config, 256), block, head_dim=256, blocks=1)
    assert region.values.channel_group == 128 and fast_path(region, 256)
    out, ref = _preset(name, head_dim=256, n_rep=4, blocks=1)
    assert sqnr_db(ref, out) >= FLOAT32_DB


LENGTHS = {
    "whole-tiles": dict(tail=64, sinks=4),  # every region ends on a tile (and block) boundary
    "one-new-token": dict(tail=1, sinks=0),
    "partial-tile": dict(tail=37, sinks=4),
    "no-quantized-region": dict(tail=37, sinks=4, blocks=0),
}


@pytest.mark.parametrize("tiles_per_split", [None, 1], ids=["auto-splits", "one-tile-splits"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("name", tiered(["balanced", "compact", "max"], {"compact"}, "balanced and max at every length "
                                        "and split under Triton's interpreter; fast twin, compact at each: "
                                        "tests/kernels/test_decode.py::test_lengths_and_splits"))
def test_lengths_and_splits(name, lengths, tiles_per_split):
    out, ref = _preset(name, tiles_per_split=tiles_per_split, **LENGTHS[lengths])
    assert sqnr_db(ref, out) >= FLOAT32_DB


LAUNCHES = {"half-tiles": LaunchConfig(tile=32), "eight-warps-3-stages": LaunchConfig(num_warps=8, num_stages=3),
            "sixteen-token-tiles-2-per-sm": LaunchConfig(tile=16, programs_per_sm=2)}


@pytest.mark.parametrize("launch", list(LAUNCHES), ids=list(LAUNCHES))
@pytest.mark.parametrize("name", tiered(["balanced", "compact"], {"compact"}, "balanced under every launch override "
                                        "(interpreter); fast twin, compact under each: "
                                        "tests/kernels/test_decode.py::test_launch_overrides_give_the_same_attention"))
def test_launch_overrides_give_the_same_attention(name, launch):
    # a tile smaller than the key scale group still folds one scale per tile; warps, stages and splits change
    # nothing the kernel computes (gpu_check.py --parts tune sweeps them on a GPU)
    out, ref = _preset(name, launch=LAUNCHES[launch], **LENGTHS["partial-tile"])
    assert sqnr_db(ref, out) >= FLOAT32_DB


def _planned_tile(name: str, blocks: int = 2) -> int:
    config, block = FORMATS[name]
    region, segments, k, _ = build(*specs(config, 64), block, blocks=blocks)
    query = torch.randn(2, k.shape[1] * 4, 1, 64)  # GQA 4, one query token
    (partial, _), _ = plan_decode_attention(query, 0.125, quantized=region, exact=segments, kv_len=k.shape[2])
    return partial.options["TILE"]


def test_lean_reads_two_key_blocks_per_tile():
    # lean's 32-token key blocks, two per 64-token tile on the fast path (0.188 -> 0.144 warp instructions per byte
    # on sm_90a, kernel_report.md); keys of two plane sets or with wide channels keep tiles of one block
    assert _planned_tile("lean") == 64
    assert {name: _planned_tile(name) for name in ("balanced", "compact", "tight", "max")} == {
        "balanced": 128, "compact": 64, "tight": 64, "max": 64}
    config, block = FORMATS["lean"]
    region, _, _, _ = build(*specs(config, 64), block, blocks=2)
    assert two_key_blocks(region, 64) and not two_key_blocks(region, 32) and fast_path(region, 64, 64)
    for name in ("compact", "tight", "balanced"):  # wide channels; two plane sets (int3); int8
        config, _ = FORMATS[name]
        region, _, _, _ = build(*specs(config, 64), 32, blocks=2)  # in 32-token blocks, as lean's
        assert region.keys.token_group == 32 and not two_key_blocks(region, 64)


@pytest.mark.parametrize("tiles_per_split", [None, 1], ids=["auto-splits", "one-tile-splits"])
@pytest.mark.parametrize("blocks", tiered([1, 2, 3, 5], {"5"}, "1 to 3 key blocks (interpreter); fast twin, 5 blocks "
                                          "(a split ends half way): "
                                          "tests/kernels/test_decode.py::test_tiles_of_two_key_blocks_where_a_split_ends_half_way"))
def test_tiles_of_two_key_blocks_where_a_split_ends_half_way(blocks, tiles_per_split):
    # an odd number of 32-token blocks: a split's last tile holds one block, whose second half reads the first's
    # bytes and scales and is weighed 0 (the scales past the region are never read: test_static_kernel.py). GQA 4,
    # one query token: 4 rows (more than 8 padded rows keep one block per tile)
    assert _planned_tile("lean", blocks) == 64
    out, ref = _preset("lean", blocks=blocks, tiles_per_split=tiles_per_split, n_rep=4, q_len=1,
                       **LENGTHS["partial-tile"])
    assert sqnr_db(ref, out) >= FLOAT32_DB


TWO_BLOCK_KEYS = {"int4-symmetric": QuantSpec("int4", "channel"),  # the codes' offset (8) in the row constant
                  "int2-asymmetric": QuantSpec("int2", "channel", symmetric=False)}  # four tokens per byte


@pytest.mark.parametrize("name", list(TWO_BLOCK_KEYS), ids=list(TWO_BLOCK_KEYS))
def test_other_keys_of_one_plane_set_in_two_block_tiles(name):
    # 3 blocks of 32 tokens, 4 query rows: two 64-token tiles, the second ending half way
    value_spec = QuantSpec("int4", "token", 64, symmetric=False)
    region, _, _, _ = build(TWO_BLOCK_KEYS[name], value_spec, 32, blocks=3)
    assert two_key_blocks(region, 64)
    out, ref = _attend(TWO_BLOCK_KEYS[name], value_spec, 32, blocks=3, n_rep=4, q_len=1)
    assert sqnr_db(ref, out) >= FLOAT32_DB


WIDE_KEYS = {"compact": None, "max": None,
             "symmetric-int3": QuantSpec("int3", "channel", block_size=32, wide_fraction=0.3)}  # the codes' offset


WIDE_CASES = {"gqa4-q1": ("gqa4-q1", torch.float32), "gqa3-q5": ("gqa3-q5", torch.float32),
              "gqa4-q1-bf16": ("gqa4-q1", torch.bfloat16)}  # fp16 operands: the columns rounded as qs is


@pytest.mark.parametrize("case", tiered(list(WIDE_CASES), {"gqa3-q5"}, "GQA 4 x 1 token in float32 and bf16 "
                                        "(interpreter); fast twin, GQA 3 x 5 tokens (15 real rows of 16) for every key: "
                                        "tests/kernels/test_decode.py::test_wide_channels_query_columns_loaded_or_gathered_are_the_same"))
@pytest.mark.parametrize("name", list(WIDE_KEYS))
def test_wide_channels_query_columns_loaded_or_gathered_are_the_same(monkeypatch, name, case):
    # _wide_scores takes the block's wide channels' query columns from memory (K_WIDE_LOAD) or gathers them across
    # lanes: the same numbers, rounded as the keys' own product rounds them, so the same attention to the bit (GQA 3 x 5
    # tokens: 15 real rows of 16 padded ones)
    heads_and_query, dtype = WIDE_CASES[case]
    n_rep, q_len = HEADS_AND_QUERIES[heads_and_query]
    if WIDE_KEYS[name] is None:
        config, block = FORMATS[name]
        key_spec, value_spec = specs(config, 128)
    else:
        key_spec, value_spec, block = WIDE_KEYS[name], QuantSpec("int4", "token", 64, symmetric=False), 32
    region, _, _, _ = build(key_spec, value_spec, block, head_dim=128, blocks=3)
    assert region.keys.wide_bits is not None and fast_path(region, 128)
    outs = {}
    for load in (False, True):
        seen = []
        monkeypatch.setattr(decode, "wide_query_loads", lambda *args, load=load: seen.append(load) or load)
        out, ref = _attend(key_spec, value_spec, block, blocks=3, head_dim=128, n_rep=n_rep, q_len=q_len, dtype=dtype)
        assert seen == [load] and sqnr_db(ref, out) >= (FLOAT32_DB if dtype == torch.float32 else HALF_DB[dtype])
        outs[load] = out
    assert torch.equal(outs[False], outs[True])


@pytest.mark.parametrize("tile", [48, 256, 8], ids=["not-a-power-of-two", "wider-than-the-group", "below-16"])
def test_a_tile_that_does_not_fit_the_key_group_is_refused(tile):
    # balanced's key scale group is its 128-token block: the fast path's default tile (the generic path's is 64)
    with pytest.raises(ValueError, match=f"tile of {tile} tokens: a power of two >= 16 dividing 128 expected"):
        _preset("balanced", launch=LaunchConfig(tile=tile))


@pytest.mark.parametrize("filled", [torch.tensor(128.0), torch.tensor([128])], ids=["float", "not-0-d"])
def test_a_filled_count_that_is_not_a_0d_integer_tensor_is_refused(filled):
    config, block = FORMATS["balanced"]
    region, segments, k, _ = build(*specs(config, 64), block, blocks=1)
    query = torch.randn(2, k.shape[1], 1, 64)
    with pytest.raises(ValueError, match="filled count must be a 0-d integer tensor on cpu, got torch.(float32 of "
                                         r"shape \(\)|int64 of shape \(1,\)) on cpu"):
        decode_attention(query, 0.125, quantized=dataclasses.replace(region, filled=filled), exact=segments)


def test_pipeline_stages_follow_the_h200_sweep():
    # results/gpu/h200_tune: 1 stage fastest for 64-token tiles, 2 for 32; Triton's default 3 ran float32 out of
    # shared memory with 64-token tiles; 128-token tiles take 1 like 64 (2 stages would not fit sm_89's shared
    # memory, kernel_report.md)
    assert [pipeline_stages(t) for t in (128, 64, 32, 16)] == [1, 1, 2, 2]


def test_fast_path_warps_and_operand_sides_follow_the_kernel_report():
    # results/gpu/kernel_report.md (sm_90a): at least 16 tokens of a tile per warp, 2 warps below 128-token tiles
    # unless the keys have wide channels beyond head_dim 128 (or the card is older than sm_89); value codes on the left
    # of their product, key codes where each warp holds whole 16-token fragments
    keys = dataclasses.make_dataclass("Keys", ["wide_bits", ("token_group", int, 64), ("head_dim", int, 128)])
    region = dataclasses.make_dataclass("Region", ["keys"])
    plain, wide, wide_256 = region(keys(None)), region(keys(torch.zeros(1))), region(keys(torch.zeros(1), 64, 256))
    assert [fast_warps(t, plain) for t in (128, 64, 32, 16)] == [4, 2, 2, 1]
    # wide channels up to head_dim 128 take 2 warps, on sm_80 too (their query columns loaded: 223-250 registers)
    assert [fast_warps(t, wide) for t in (128, 64, 32, 16)] == [4, 2, 2, 1]
    assert [fast_warps(64, wide, capability) for capability in (80, 89, 90)] == [2, 2, 2]
    assert [fast_warps(t, wide_256) for t in (128, 64, 32, 16)] == [4, 4, 2, 1]  # 254-255 registers with 2
    assert fast_warps(64, wide, 90, 32) == 4
    assert [wide_query_loads(wide, 4, capability) for capability in (80, 89, 90, None)] == [True] * 4
    assert [wide_query_loads(wide_256, 4, capability) for capability in (80, 89, 90, None)] == [
        False, False, True, True]  # compact at the register cap on sm_80 and sm_89
    assert not wide_query_loads(wide, 32) and not wide_query_loads(plain) and not wide_query_loads(None)
    wide_64 = region(keys(torch.zeros(1), 64, 64))  # ptxas holds max to 128 registers there: loading spilled 8 B
    assert fast_warps(64, wide_64) == 2 and not any(wide_query_loads(wide_64, 4, c) for c in (80, 89, 90, None))
    assert [fast_warps(64, plain, capability) for capability in (80, 86, 89, 90)] == [4, 4, 2, 2]  # sm_80: 255 regs
    assert [fast_warps(64, plain, 90, rows) for rows in (4, 8, 32)] == [2, 2, 4]  # 5 query tokens x GQA 4: 32 rows
    # lean's tiles of two key blocks keep 2 on sm_80 up to head_dim 128 (168 registers; 255 at head_dim 256)
    config, block = FORMATS["lean"]
    lean = {d: build(*specs(config, d), block, head_dim=d, blocks=2)[0] for d in (128, 256)}
    assert [fast_warps(64, lean[128], capability) for capability in (80, 90)] == [2, 2]
    assert [fast_warps(64, lean[256], capability) for capability in (80, 90)] == [4, 2]
    assert codes_left(plain, 128, 4, True) == {"K_LEFT": True, "V_LEFT": True}
    assert codes_left(plain, 32, 4, True) == {"K_LEFT": False, "V_LEFT": True}  # 8 tokens per warp
    assert codes_left(wide, 64, 4, True) == {"K_LEFT": True, "V_LEFT": True}
    assert codes_left(plain, 128, 4, False) == {"K_LEFT": False, "V_LEFT": False}  # the generic path
    assert codes_left(plain, 32, 2, True, 89) == {"K_LEFT": False, "V_LEFT": True}  # lean spilled so on sm_89
    assert codes_left(plain, 32, 2, True, 90) == codes_left(plain, 32, 2, True) == {"K_LEFT": True, "V_LEFT": True}


class _SpillingKernel:
    """A stand-in for a Triton kernel whose launches record their warps and report the local bytes the compiled
    kernel spilled (``n_spills``, as Triton's CompiledKernel holds after a launch)."""

    def __init__(self, spills: dict[int, int]):
        self.spills, self.compiled, self.launched = spills, [], []

    def __getitem__(self, grid):
        def run(*args, num_warps, **options):
            self.launched.append(num_warps)
            return types.SimpleNamespace(n_spills=self.spills[num_warps])
        return run


class _CompilingKernel(_SpillingKernel):
    """:class:`_SpillingKernel` with Triton's ``warmup``: compiles without a launch (recording its warps) and returns a
    compiled kernel that knows its spills once loaded (``_init_handles`` sets ``n_spills``)."""

    def warmup(self, *args, grid, num_warps, **options):
        self.compiled.append(num_warps)
        compiled = types.SimpleNamespace()
        compiled._init_handles = lambda: setattr(compiled, "n_spills", self.spills[num_warps])
        return compiled


def test_a_launch_that_spills_falls_back_to_more_warps_once(monkeypatch):
    monkeypatch.setattr(decode, "INTERPRETED", False)  # the fallback reads what a GPU compile spilled
    monkeypatch.setattr(decode, "_SPILL_FREE", {})
    kernel = _CompilingKernel({2: 96, 4: 8, 8: 0})
    planned = KernelLaunch(kernel, (1, 1), (), {"TILE": 64, "num_warps": 2})
    assert decode._spill_free(planned).options == {"TILE": 64, "num_warps": 8}
    assert kernel.compiled == [2, 4, 8] and kernel.launched == []  # compiled and loaded, not launched
    assert decode._spill_free(planned).options["num_warps"] == 8 and kernel.compiled == [2, 4, 8]  # remembered
    kept = KernelLaunch(_CompilingKernel({4: 0, 8: 0}), (1, 1), (), {"TILE": 128, "num_warps": 4})
    assert decode._spill_free(kept) is kept and kept.kernel.compiled == [4]


def test_spill_probe_launches_where_triton_cannot_compile_apart(monkeypatch):
    monkeypatch.setattr(decode, "INTERPRETED", False)
    monkeypatch.setattr(decode, "_SPILL_FREE", {})
    kernel = _SpillingKernel({2: 96, 4: 0})  # no warmup
    planned = KernelLaunch(kernel, (1, 1), (), {"TILE": 64, "num_warps": 2})
    assert decode._spill_free(planned).options["num_warps"] == 4 and kernel.launched == [2, 4]


def test_spill_fallbacks_and_the_choice_among_them():
    def warps(n):
        return [c.options["num_warps"] for c in spill_alternatives(KernelLaunch(None, (1,), (), {"num_warps": n}))]

    assert [warps(n) for n in (1, 2, 4, 8)] == [[1, 2, 8], [2, 4, 8], [4, 8], [8]]
    assert settle_spills((1, 2, 3), {1: 0, 2: 0, 3: 0}.get) == (0, [0])
    assert settle_spills((1, 2, 3), {1: 96, 2: 0, 3: 0}.get) == (1, [96, 0])
    assert settle_spills((1, 2, 3), {1: 96, 2: 8, 3: 16}.get) == (1, [96, 8, 16])  # all spill: the least


def test_warps_the_caller_sets_are_kept(monkeypatch):
    seen = []
    monkeypatch.setattr(decode, "_spill_free", lambda launch: seen.append(launch.options["num_warps"]) or launch)
    _preset("balanced", n_rep=4, q_len=1, launch=LaunchConfig(num_warps=8))
    _preset("balanced", n_rep=4, q_len=1, launch=LaunchConfig(tile=64))
    _preset("balanced", n_rep=4, q_len=1)
    assert seen == [2, 4]  # the planned warps went through the fallback; the caller's 8 did not


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", tiered([*PRESETS, "fp8_e4m3-keys"], {"balanced", "compact", "fp8_e4m3-keys"},
                                        "the other presets with half-precision operands (interpreter); fast twin, "
                                        "balanced, compact and fp8 keys in bf16 and fp16: tests/kernels/test_decode.py::test_half_precision"))
def test_half_precision(name, dtype):
    # every preset's fast path with float16 operands over codes, as on a GPU (the interpreter multiplies them exactly
    # and sums in float32): measured 49.0-49.5 dB in bf16 (its output rounding), 60.9-65.7 dB in fp16
    out, ref = _preset(name, dtype=dtype, n_rep=4)
    assert sqnr_db(ref, out) >= HALF_DB[dtype]


@pytest.mark.parametrize("outlier", tiered([1.0, 30.0, 300.0], {"300.0"}, "query outliers of 1x and 30x "
                                           "(interpreter); fast twin, 300x, the hardest: "
                                           "tests/kernels/test_decode.py::test_int8_key_products_keep_half_precision_accuracy"))
@pytest.mark.parametrize("name", ["quality", "balanced"])
def test_int8_key_products_keep_half_precision_accuracy(name, outlier):
    # int8 keys with fp16 operands take int8 products against the query as two int8 digits per row
    # (triton_codes._int8_key_scores), whose fixed point is set by the row's largest element: one query channel
    # 30x or 300x the others. Measured 64.9-73.7 dB (the fp16 operands before: 64.9-73.8; 30x cost 2.6-2.8 dB)
    out, ref = _preset(name, dtype=torch.float16, n_rep=4, query_outlier=outlier)
    assert sqnr_db(ref, out) >= 62.0


VALUE_LAYOUTS = {
    # (value spec, packing block): per-token codes packed along head_dim (what a region that is not whole
    # token-packed blocks holds), two scale groups per token, and one scale per block and channel
    "int4-head_dim-packed": (QuantSpec("int4", "token", 64, symmetric=False), 1),
    "int3-head_dim-packed": (QuantSpec("int3", "token", 64, symmetric=False), 1),
    "int4-two-groups": (QuantSpec("int4", "token", 32, symmetric=False), 32),  # the fast path's two groups
    "int4-four-groups": (QuantSpec("int4", "token", 16, symmetric=False), 32),  # the generic path's tile scaling
    "int4-symmetric": (QuantSpec("int4", "token", 64), 32),
    "int8-per-block-channel": (QuantSpec("int8", "channel", symmetric=False), 32),
    "int8-rotated-symmetric": (QuantSpec("int8", "token", 64, rotated=True), 32),
}


@pytest.mark.parametrize("layout", list(VALUE_LAYOUTS), ids=list(VALUE_LAYOUTS))
def test_value_layouts(layout):
    value_spec, value_block = VALUE_LAYOUTS[layout]
    region, segments, k, v = build(QuantSpec("int8", "channel"), value_spec, 32)
    values, dense_v = stored(torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(3)), value_spec,
                             value_block)
    region = QuantizedRegion(region.keys, values, start=region.start)
    assert fast_path(region, 64) == (layout in ("int4-two-groups", "int4-symmetric", "int8-rotated-symmetric"))
    v = torch.cat([v[:, :, :4], dense_v, v[:, :, 68:]], 2)
    query = torch.randn(2, 6, 5, 64, generator=torch.Generator().manual_seed(4))
    mask = padded_causal_mask(2, 5, k.shape[2])
    out = decode_attention(query, 0.125, quantized=region, exact=segments, attention_mask=mask)
    assert sqnr_db(reference(query, k, v, mask, 0.125), out) >= FLOAT32_DB


KEY_SPECS = {
    "int8-per-block-tensor": QuantSpec("int8", "tensor"),
    "int4-symmetric-channel": QuantSpec("int4", "channel"),
    "int6-asymmetric-channel": QuantSpec("int6", "channel", symmetric=False),
    "int5-asymmetric-channel": QuantSpec("int5", "channel", symmetric=False),
}


@pytest.mark.parametrize("name", list(KEY_SPECS), ids=list(KEY_SPECS))
def test_other_key_formats(name):
    out, ref = _attend(KEY_SPECS[name], QuantSpec("int4", "token", 64, symmetric=False), 32)
    assert sqnr_db(ref, out) >= FLOAT32_DB


def test_head_dim_80_rotates_in_blocks_of_16():
    """A head_dim that is not a power of two: padded to 128 lanes, values rotated by 5 Hadamard blocks of 16."""
    out, ref = _preset("compact", head_dim=80, blocks=1)
    assert sqnr_db(ref, out) >= FLOAT32_DB


def _balanced_case(q_len: int = 5):
    config, block = FORMATS["balanced"]
    region, segments, k, v = build(*specs(config, 64), block, blocks=1)
    query = torch.randn(2, 6, q_len, 64, generator=torch.Generator().manual_seed(9))
    return region, segments, k, v, query


@pytest.mark.parametrize("kind", ["additive", "finfo-min", "per-head", "causal-none"])
def test_mask_kinds(kind):
    region, segments, k, v, query = _balanced_case()
    bool_mask = padded_causal_mask(2, 5, k.shape[2])
    if kind == "additive":
        mask = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, float("-inf"))
    elif kind == "finfo-min":  # transformers' eager masks: the dtype's lowest value instead of -inf
        mask = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    elif kind == "per-head":
        mask = bool_mask.repeat(1, 6, 1, 1)
        mask[:, 4, :, 20:40] = False  # one query head sees less
    else:
        mask = None
    out = decode_attention(query, 0.125, quantized=region, exact=segments, attention_mask=mask)
    assert sqnr_db(reference(query, k, v, mask, 0.125), out) >= FLOAT32_DB


def test_an_empty_quantized_region_is_skipped():
    region, segments, k, v, query = _balanced_case()
    keys, values = region.keys, region.values
    empty = QuantizedRegion(StoredCodes(keys.codes[:, :, :0], keys.scale[:, :, :0], None, 8, True),
                            StoredCodes(values.codes[:, :, :0], values.scale[:, :, :0], values.zero[:, :, :0], 4,
                                        False, "tokens", 128, rotated=True), start=4)
    tail = ExactSegment(segments[1].keys, segments[1].values, 4)
    k, v = torch.cat([k[:, :, :4], k[:, :, -37:]], 2), torch.cat([v[:, :, :4], v[:, :, -37:]], 2)
    out = decode_attention(query, 0.125, quantized=empty, exact=(segments[0], tail))
    assert sqnr_db(reference(query, k, v, None, 0.125), out) >= FLOAT32_DB


def test_rows_that_see_nothing_are_zero():
    region, segments, k, v, query = _balanced_case(q_len=1)
    mask = torch.ones(2, 1, 1, k.shape[2], dtype=torch.bool)
    mask[1] = False
    out = decode_attention(query, 0.125, quantized=region, exact=segments, attention_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert sqnr_db(reference(query[:1], k[:1], v[:1], mask[:1], 0.125), out[:1]) >= FLOAT32_DB


def test_sink_overlay_through_masks():
    """An exact sink overlay (blocks quantized from token 0; exact copies of each row's first real tokens kept
    aside) needs no kernel change: mask the overlaid positions out of the quantized region, and give the sinks
    their own mask slice. Row 1 is left-padded: its sinks are tokens PAD..PAD+3."""
    config, block = FORMATS["compact"]
    key_spec, value_spec = specs(config, 64)
    g = torch.Generator().manual_seed(21)
    raw_k, raw_v = torch.randn(2, 2, 2 * block, 64, generator=g), torch.randn(2, 2, 2 * block, 64, generator=g)
    (keys, dense_k), (values, dense_v) = stored(raw_k, key_spec, block), stored(raw_v, value_spec, block)
    tail_k, tail_v = torch.randn(2, 2, 9, 64, generator=g), torch.randn(2, 2, 9, 64, generator=g)
    first_real = torch.tensor([0, PAD])
    rows = first_real[:, None] + torch.arange(4)  # [B, S] positions of each row's sinks
    take = rows[:, None, :, None].expand(2, 2, 4, 64)
    sink_k, sink_v = raw_k.gather(2, take), raw_v.gather(2, take)
    kv = 2 * block + 9
    mask = padded_causal_mask(2, 1, kv)
    quant_mask = mask[..., : 2 * block].clone()
    quant_mask.scatter_(3, rows[:, None, None, :], False)  # the overlaid positions leave the quantized stream
    sink_mask = mask.gather(3, rows[:, None, None, :])
    region = QuantizedRegion(keys, values, mask=quant_mask)
    segments = (ExactSegment(sink_k, sink_v, mask=sink_mask), ExactSegment(tail_k, tail_v, 2 * block))
    query = torch.randn(2, 6, 1, 64, generator=g)
    out = decode_attention(query, 0.125, quantized=region, exact=segments, attention_mask=mask)
    # reference: the dequantized stream with each row's sink positions holding the exact tokens
    ref_k, ref_v = torch.cat([dense_k, tail_k.double()], 2), torch.cat([dense_v, tail_v.double()], 2)
    ref_k.scatter_(2, take, sink_k.double())
    ref_v.scatter_(2, take, sink_v.double())
    assert sqnr_db(reference(query, ref_k, ref_v, mask, 0.125), out) >= FLOAT32_DB

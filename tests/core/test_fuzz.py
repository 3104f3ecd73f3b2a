"""Stateful property test: random sequences of cache operations against a reference that stores exact tensors.

A hypothesis ``RuleBasedStateMachine`` drives one :class:`AsymKVLayer` (and, below, a whole
:class:`AsymKVCache`) through updates of 1..300 tokens, crops, beam reorders, batch selects and repeats,
deep copies, resets and past recording switched on and off, for every key format x value bits x sinks x
calibrated/uncalibrated, plus the preset formats (asymmetric low-bit keys, 3/5/6-bit values, Hadamard-rotated
values or keys). After every step:

- lengths and mask sizes agree with the reference;
- sinks are bit-exact (a left-padded row's own first tokens too, wherever they lie), and so are the newest
  ``min(length, residual_length)`` tokens, except tokens a rollback
  without recording had to return from a block (the layer cannot know them exactly: they hold their
  dequantized values, within the quantization bound);
- every quantized element is within its format's error bound of the reference (computed from the reference
  block's range, see :func:`error_bound`), twice the bound for tokens quantized a second time;
- the quantized buffers' unused capacity stays within one growth step (``max_growth_tokens`` rounded to blocks);
- the window never exceeds ``residual_length + block_size`` plus the latest update's tokens while deferring
  (past recording keeps one update pending, never more: recording left on must not grow the window);
- the fused attention over the stored codes equals the dense read-out's attention (SQNR > 80 dB: float32
  rounding of logits up to 1e5);
- an interrupt (``KeyboardInterrupt``) raised at a drawn line of the core inside an update, crop or beam reorder
  (issue 56, :func:`faults.interrupt_at_line`) leaves the layer, or the whole cache, exactly as it was; the machine
  goes on with the interrupted object, so every later check covers it too.

On failure hypothesis prints the falsifying steps, and ``conftest.py`` the session's seed (rerun with
``--hypothesis-seed=N``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os

import pytest
import torch
from conftest import llama_config
from faults import assert_same, cache_state, layer_state, run_interrupted
from helpers import tiered
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hf_asymkv import AsymKVCache, AsymKVConfig, AsymKVLayer
from hf_asymkv.core.attention import fused_attention
from hf_asymkv.core.kv_view import QuantizedKV
from hf_asymkv.core.quant import QuantSpec, sqnr_db
from hf_asymkv.core.rotation import hadamard, rotate

H, D, BLOCK = 2, 8, 4
MAX_BATCH = 4
STEPS = 25
EXAMPLES = int(os.environ.get("HF_ASYMKV_FUZZ_EXAMPLES", 20))  # raise for a longer soak
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, print_blob=True,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

KEY_FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2", "int4"]
VALUE_BITS = [2, 4, 8]
COMBOS = list(itertools.product(KEY_FORMATS, VALUE_BITS, [0, 3], [False, True]))
COMBO_IDS = [f"K{k}-V{v}-sinks{s}-{'calib' if c else 'dyn'}" for k, v, s, c in COMBOS]
# The preset formats: (key_format, key_symmetric, key_rotation, value_bits, value_rotation, sinks, calibrated)
PRESET_COMBOS = [
    ("int8", True, False, 6, True, 3, False),   # quality
    ("int8", True, False, 4, True, 3, True),    # balanced, calibrated
    ("int4", False, False, 3, True, 3, False),  # compact
    ("int2", False, False, 2, True, 0, False),  # max
    ("int3", False, False, 2, True, 3, False),  # 3-bit keys (max candidate)
    ("int8", True, False, 3, False, 0, False),  # 3-bit values unrotated
    ("int4", True, False, 5, False, 3, True),   # 5-bit values, calibrated int4 keys
    ("int8", True, True, 4, False, 3, False),   # rotated keys (ablation)
]
PRESET_IDS = [f"K{k}{'' if ks else '-asym'}{'-rot' if kr else ''}-V{v}{'-rot' if vr else ''}-sinks{s}-"
              f"{'calib' if c else 'dyn'}" for k, ks, kr, v, vr, s, c in PRESET_COMBOS]


# ------------------------------------------------------------------------------------------------ error bounds
def _fp8_relative(spec: QuantSpec) -> tuple[float, float]:
    """``(relative rounding error, absolute floor in code units)`` of a float8 format."""
    finfo = torch.finfo(spec.code_dtype)
    return finfo.eps / 2, finfo.tiny * finfo.eps / 2


def error_bound(ref: torch.Tensor, spec: QuantSpec, block: int, key_absmax: torch.Tensor | None = None,
                slack: torch.Tensor | None = None) -> torch.Tensor:
    """Largest error allowed for each element of ``ref`` ``[B, H, n, D]`` (n a multiple of ``block`` for
    per-channel specs) once quantized with ``spec``, from the reference block's own range. ``slack`` (same
    shape) widens each element's range: what the layer quantized may differ from ``ref`` by that much (tokens a
    rollback returned dequantized).

    Keys (symmetric, one scale per block and channel): ``amax / qmax / 2`` for integers; for float8, the format's
    relative rounding of each element, with its subnormal floor. Values (asymmetric, one scale and zero per
    token group): half a step of the group's range. Metadata rounding (scales up, zeros down, into bf16/fp16)
    widens each bound by a small factor. Asymmetric keys: half a step of the block's (min, max) per channel.
    Rotated specs: the bound of the rotated reference, carried back through ``|H|`` (an error of at most
    ``e_i`` on rotated channel i is at most ``sum_i e_i |H_ji|`` on channel j), plus float32 rotation rounding.
    """
    x = torch.nan_to_num(ref.float())
    slack = torch.zeros_like(x) if slack is None else slack
    b, h, n, d = x.shape
    if spec.rotated:
        habs = hadamard(d).abs()
        plain = dataclasses.replace(spec, rotated=False)
        bound = error_bound(rotate(x), plain, block, key_absmax, slack @ habs) @ habs.T
        return bound + 1e-5 * x.abs().amax(-1, keepdim=True) + 1e-7
    if spec.granularity == "channel" and not spec.symmetric:
        g, sg = x.view(b, h, n // block, block, d), slack.view(b, h, n // block, block, d)
        lo, hi = (g - sg).amin(3, keepdim=True), (g + sg).amax(3, keepdim=True)
        step = ((hi - lo + lo.abs() * 2**-7) / spec.qmax * (1 + 2**-7)).clamp(min=torch.finfo(spec.scale_dtype).tiny)
        return (step / 2 * 1.01 + 1e-7).expand(b, h, n // block, block, d).reshape(b, h, n, d)
    if spec.granularity == "channel":
        amax = (x.abs() + slack).view(b, h, n // block, block, d).amax(dim=3, keepdim=True)
        if key_absmax is not None:  # calibrated, overflow policy "widen": the larger of the two ranges
            amax = torch.maximum(amax, key_absmax[None, :, None, None, :].float())
        scale = (amax / spec.qmax * (1 + 2**-7)).clamp(min=torch.finfo(spec.scale_dtype).tiny)
        scale = scale.expand(b, h, n // block, block, d).reshape(b, h, n, d)
        if spec.is_float:
            rel, floor = _fp8_relative(spec)
            return (x.abs() * rel * 1.01 + scale * floor).reshape(b, h, n, d)
        return scale / 2 * 1.01
    g = x.view(b, h, n, d // spec.group_size, spec.group_size)
    sg = slack.view_as(g)
    lo, hi = (g - sg).amin(-1, keepdim=True), (g + sg).amax(-1, keepdim=True)
    step = ((hi - lo + lo.abs() * 2**-9) / spec.qmax * (1 + 2**-9)).clamp(min=torch.finfo(torch.float16).tiny)
    return (step / 2 * 1.01 + 1e-7).expand_as(g).reshape(b, h, n, d)


# ------------------------------------------------------------------------------------------------ reference
class Reference:
    """What the layer must hold: the exact tokens, and for each position an error budget: 0 (exact), or the bound
    of the first quantization of a token that a rollback without recording returned from a block."""

    def __init__(self) -> None:
        self.k = self.v = None
        self.budget_k = self.budget_v = None
        self.anchors = None  # [B] each row's first real token (left padding), None: every row starts at 0

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        zeros = torch.zeros_like(k)
        if self.k is None:
            self.k, self.v, self.budget_k, self.budget_v = k, v, zeros, zeros.clone()
        else:
            cat = lambda a, b: torch.cat([a, b], dim=2)  # noqa: E731
            self.k, self.v = cat(self.k, k), cat(self.v, v)
            self.budget_k, self.budget_v = cat(self.budget_k, zeros), cat(self.budget_v, zeros.clone())

    def keep(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]
            self.budget_k, self.budget_v = self.budget_k[:, :, :n], self.budget_v[:, :, :n]

    def map_batch(self, fn) -> None:
        if self.k is not None:
            self.k, self.v, self.budget_k, self.budget_v = map(fn, (self.k, self.v, self.budget_k, self.budget_v))
        if self.anchors is not None:
            self.anchors = fn(self.anchors)

    def clear(self) -> None:
        self.__init__()


def _tokens(batch: int, n: int, seed: int, magnitude: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, H, n, D, generator=g) * torch.logspace(-1, 1, D) * magnitude  # channel-dependent ranges
    v = torch.randn(batch, H, n, D, generator=g) * magnitude
    return k, v


# ------------------------------------------------------------------------------------------------ the machine
class LayerMachine(RuleBasedStateMachine):
    """One `AsymKVLayer` against :class:`Reference`. Class attributes set per combination: key format, value bits,
    sinks, calibrated."""

    key_format, value_bits, sinks, calibrated = "int8", 4, 0, False
    key_symmetric, key_rotation, value_rotation = True, False, False

    def __init__(self) -> None:
        super().__init__()
        self.ref = Reference()
        self.batch = 2
        self.seed = 0
        self.peak = 0  # the most quantized tokens held since the layer was built or reset
        self.short_window_ok = False  # a rollback beyond what recording covers left the window short
        self.short_before_update = False  # short_window_ok before the latest update (what a covered rollback restores)
        self.recorded = 0  # tokens of the latest update while recording: what a rollback can undo exactly
        self.pending = 0  # tokens of the latest update kept pending (until the next update or crop)

    @initialize(residual=st.sampled_from([0, 3, 6]), recording=st.booleans(), padded=st.booleans())
    def build(self, residual: int, recording: bool, padded: bool) -> None:
        self.padded = padded  # prefills come left-padded (position_ids as generate makes them)
        config = AsymKVConfig(key_format=self.key_format, value_bits=self.value_bits, key_block_size=BLOCK,
                              residual_length=residual, sink_tokens=self.sinks, max_growth_tokens=8,
                              key_symmetric=self.key_symmetric, key_rotation=self.key_rotation,
                              value_rotation=self.value_rotation).resolved([D])
        self.key_absmax = torch.rand(H, D) * 2 + 0.05 if self.calibrated else None
        self.layer = AsymKVLayer(config.layer_config(),
                                 key_absmax=None if self.key_absmax is None else self.key_absmax.clone())
        if recording:
            self.layer.activate_past_recording()

    # ------------------------------------------------------------------ operations
    @rule(n=st.one_of(st.integers(1, 12), st.integers(1, 300)), magnitude=st.sampled_from([1.0, 1e-3, 300.0]))
    def update(self, n: int, magnitude: float) -> None:
        self.seed += 1
        k, v = _tokens(self.batch, n, self.seed, magnitude)
        kwargs = {}
        if self.ref.length == 0:  # a prefill: each row's first real token after its padding
            pads = torch.randint(0, n, (self.batch,), generator=torch.Generator().manual_seed(self.seed))
            pads = pads if self.padded else torch.zeros_like(pads)
            kwargs = {"position_ids": (torch.arange(n)[None] - pads[:, None]).clamp(min=0)}
            self.ref.anchors = pads if pads.any() else None
        self.short_before_update = self.short_window_ok
        keys, values = self.layer.update(k, v, kwargs=kwargs)
        self.recorded = self.pending = n if self.layer.defers else 0
        self.ref.append(k, v)
        assert keys.shape == values.shape == (self.batch, H, self.ref.length, D)
        self._check_readout(keys, values)

    @rule(data=st.data())
    def crop(self, data) -> None:
        n = data.draw(st.one_of(st.integers(0, 6), st.integers(0, max(self.ref.length, 0))), label="remove")
        if self.ref.length == 0:
            self.layer.crop(-n)
            return
        ks = self.layer.key_store
        before_blocks, ns = ks.blocks.length, ks.sinks.length
        bounds = self._bounds(ns, before_blocks)
        covered = n <= self.recorded
        self.layer.crop(-n)
        keep = max(0, self.ref.length - n)
        self.recorded = self.pending = 0
        if not covered and n and before_blocks:
            self.short_window_ok = True
        elif covered and n:  # back to the layer before the latest update, whose window may have been short already
            self.short_window_ok = self.short_before_update
        # Tokens the layer returned from a block to the window carry their first quantization's error.
        back = slice(ns + ks.blocks.length, min(keep, ns + before_blocks))
        if back.start < back.stop:
            self.ref.budget_k[:, :, back] += bounds[0][:, :, back.start - ns : back.stop - ns]
            self.ref.budget_v[:, :, back] += bounds[1][:, :, back.start - ns : back.stop - ns]
        self.ref.keep(keep)

    @precondition(lambda self: self.ref.length > 0)
    @rule(data=st.data())
    def reorder(self, data) -> None:
        perm = torch.tensor(data.draw(st.permutations(range(self.batch)), label="beam_idx"))
        self.layer.reorder_cache(perm)
        self.ref.map_batch(lambda t: t.index_select(0, perm))

    @precondition(lambda self: self.ref.length > 0 and self.batch > 1)
    @rule(data=st.data())
    def select(self, data) -> None:
        rows = sorted(data.draw(st.sets(st.integers(0, self.batch - 1), min_size=1, max_size=self.batch - 1)))
        idx = torch.tensor(rows)
        self.layer.batch_select_indices(idx)
        self.ref.map_batch(lambda t: t[idx])
        self.batch = len(rows)

    @precondition(lambda self: self.ref.length > 0 and self.batch * 2 <= MAX_BATCH)
    @rule()
    def repeat(self) -> None:
        self.layer.batch_repeat_interleave(2)
        self.ref.map_batch(lambda t: t.repeat_interleave(2, dim=0))
        self.batch *= 2

    @rule()
    def deepcopy(self) -> None:
        self.layer = copy.deepcopy(self.layer)

    @rule()
    def reset(self) -> None:
        self.layer.reset()
        self.ref.clear()
        self.peak, self.short_window_ok, self.recorded, self.pending = 0, False, 0, 0

    @rule(sizes=st.lists(st.integers(1, 12), min_size=4, max_size=16))
    def recording_left_on(self, sizes: list[int]) -> None:
        """What assisted decoding leaves behind (recording on, never turned off), then many plain updates: each
        update's tokens are pending for one update only, so the window stays bounded and blocks keep closing."""
        self.layer.activate_past_recording()
        quantized = self.layer.key_store.blocks.length
        for n in sizes:
            self.update(n, 1.0)
            window = self.layer.key_store.window.length
            assert window < self.layer.residual_length + BLOCK + n, "recording let the window grow"
        if sum(sizes) >= self.layer.residual_length + 2 * BLOCK + max(sizes):
            assert self.layer.key_store.blocks.length > quantized, "nothing was quantized while recording"

    @rule(on=st.booleans())
    def recording(self, on: bool) -> None:
        if on:
            self.layer.activate_past_recording()
        else:
            self.layer.record_past = False  # what generate does when it hands the cache back
            self.recorded = 0

    @precondition(lambda self: self.layer.key_store.blocks.length > 0)
    @rule(q_len=st.integers(1, 16))
    def attend(self, q_len: int) -> None:
        """The fused attention over the codes equals the attention over the dense read-out."""
        g = torch.Generator().manual_seed(self.seed)
        self.layer.return_views = True
        empty = torch.zeros(self.batch, H, 0, D)
        key, value = self.layer.update(empty, empty)
        self.layer.return_views = False
        assert isinstance(key, QuantizedKV)
        n = key.shape[2]
        q_len = min(q_len, n)  # every query row sees at least itself, as in a model
        q = torch.randn(self.batch, H * 2, q_len, D, generator=g)
        mask = torch.ones(q_len, n, dtype=torch.bool).tril(n - q_len)[None, None]
        got = fused_attention(q, key, value, mask, D**-0.5)
        kd, vd = key.dense().repeat_interleave(2, 1).double(), value.dense().repeat_interleave(2, 1).double()
        # the reference in float64: float32 SDPA itself is only ~80 dB from it when logits reach 1e4
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), kd, vd, mask, scale=D**-0.5)
        assert sqnr_db(want.transpose(1, 2), got) > 80  # float32 rounding only (logits reach 1e5 with the largest tokens)

    # ------------------------------------------------------------------ checks
    @invariant()
    def lengths_agree(self) -> None:
        if not hasattr(self, "layer"):
            return
        assert self.layer.get_seq_length() == self.ref.length
        assert self.layer.get_mask_sizes(5) == (self.ref.length + 5, 0)
        ks, vs = self.layer.key_store, self.layer.value_store
        for store in (ks, vs):
            assert store.sinks.length + store.blocks.length + store.window.length == self.ref.length
            assert store.blocks.length % BLOCK == 0 and store.sinks.length <= self.sinks
            blocks = store.blocks.codes
            self.peak = max(self.peak, blocks.length)
            if blocks.data is not None:  # one growth step beyond the most ever held, at most
                assert blocks.data.shape[2] <= self.peak + store.blocks.max_step

    @invariant()
    def window_bounded(self) -> None:
        if hasattr(self, "layer"):
            window = self.layer.key_store.window.length
            assert window < self.layer.residual_length + BLOCK + self.pending, "the window outgrew its bound"

    @invariant()
    def contents_agree(self) -> None:
        if not hasattr(self, "layer") or not self.layer.is_initialized or self.ref.length == 0:
            return
        empty = torch.zeros(self.batch, H, 0, D)
        self._check_readout(*self.layer.update(empty, empty))

    def _bounds(self, ns: int, nq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Error bounds of the quantized region ``[ns, ns + nq)`` from the reference."""
        layer = self.layer
        region = slice(ns, ns + nq)
        bk = error_bound(self.ref.k[:, :, region], layer.key_store.spec, BLOCK, self.key_absmax,
                         self.ref.budget_k[:, :, region])
        bv = error_bound(self.ref.v[:, :, region], layer.value_store.spec, BLOCK, slack=self.ref.budget_v[:, :, region])
        return bk, bv

    def _check_readout(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        ks = self.layer.key_store
        ns, nq, n = ks.sinks.length, ks.blocks.length, self.ref.length
        bounds = self._bounds(ns, nq)
        if self.ref.anchors is not None and self.sinks:  # padded rows' own sinks, in the blocks too
            for row, anchor in enumerate(self.ref.anchors.tolist()):
                sinks = slice(anchor, min(anchor + self.sinks, n))
                assert torch.equal(keys[row, :, sinks], self.ref.k[row, :, sinks]), "a padded row's sink key"
                assert torch.equal(values[row, :, sinks], self.ref.v[row, :, sinks]), "a padded row's sink value"
        for got, want, budget, bound in ((keys, self.ref.k, self.ref.budget_k, bounds[0]),
                                         (values, self.ref.v, self.ref.budget_v, bounds[1])):
            assert torch.equal(got[:, :, :ns], want[:, :, :ns]), "sinks are not exact"
            err = (got.float() - want.float()).abs()
            # window: exact, unless a rollback without recording returned the token from a block
            tail = slice(ns + nq, n)
            assert (err[:, :, tail] <= budget[:, :, tail]).all(), "window token beyond its budget"
            newest = budget[:, :, max(ns, n - self.layer.residual_length):]
            window_short = nq and n - ns - nq < min(n - ns, self.layer.residual_length)
            if not window_short:
                self.short_window_ok = False
            elif not (newest.numel() and newest.amax() > 0):
                assert self.short_window_ok, "newest tokens are in a block after an update or a covered rollback"
            # blocks: within the bound of one quantization (plus the budget of an earlier one)
            q = slice(ns, ns + nq)
            assert (err[:, :, q] <= bound + 2 * budget[:, :, q]).all(), "quantized element beyond its error bound"


@pytest.mark.parametrize("key_format, value_bits, sinks, calibrated", tiered(
    COMBOS, {"Kint8-V4-sinks3-calib", "Kint4-V2-sinks0-dyn"}, "the layer machine over the other 46 format combinations "
    "(~10 s of CPU each); fast twin: tests/core/test_fuzz.py::test_layer_against_reference", ids=COMBO_IDS))
def test_layer_against_reference(key_format, value_bits, sinks, calibrated, single_thread):
    machine = type("Machine", (LayerMachine,), dict(key_format=key_format, value_bits=value_bits, sinks=sinks,
                                                    calibrated=calibrated))
    run_state_machine_as_test(machine, settings=FUZZ_SETTINGS)


@pytest.mark.parametrize("key_format, key_symmetric, key_rotation, value_bits, value_rotation, sinks, calibrated",
                         PRESET_COMBOS, ids=PRESET_IDS)
def test_preset_formats_against_reference(key_format, key_symmetric, key_rotation, value_bits, value_rotation, sinks,
                                          calibrated, single_thread):
    machine = type("Machine", (LayerMachine,), dict(
        key_format=key_format, key_symmetric=key_symmetric, key_rotation=key_rotation, value_bits=value_bits,
        value_rotation=value_rotation, sinks=sinks, calibrated=calibrated))
    run_state_machine_as_test(machine, settings=FUZZ_SETTINGS)


# ------------------------------------------------------------------------------------------------ the cache
class CacheMachine(RuleBasedStateMachine):
    """A whole `AsymKVCache` (2 full-attention layers of a tiny Llama config) through the `Cache` API, each layer
    against its own reference; the per-layer checks are :class:`LayerMachine`'s."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = AsymKVCache(llama_config(), residual_length=3, key_block_size=BLOCK, sink_tokens=1,
                                 max_growth_tokens=8)
        self.refs = [Reference() for _ in self.cache.layers]
        self.batch, self.seed = 2, 0
        self.heads, self.head_dim = 2, 16

    @rule(n=st.integers(1, 40))
    def update(self, n: int) -> None:
        for i, ref in enumerate(self.refs):
            self.seed += 1
            g = torch.Generator().manual_seed(self.seed)
            k, v = (torch.randn(self.batch, self.heads, n, self.head_dim, generator=g) for _ in range(2))
            keys, _ = self.cache.update(k, v, i)
            ref.append(k, v)
            assert keys.shape[2] == ref.length

    @rule(n=st.integers(0, 12))
    def crop(self, n: int) -> None:
        self.cache.crop(-n)
        for ref in self.refs:
            ref.keep(max(0, ref.length - n))

    @precondition(lambda self: self.refs[0].length > 0)
    @rule(data=st.data())
    def reorder(self, data) -> None:
        perm = torch.tensor(data.draw(st.permutations(range(self.batch))))
        self.cache.reorder_cache(perm)
        for ref in self.refs:
            ref.map_batch(lambda t: t.index_select(0, perm))

    @precondition(lambda self: self.refs[0].length > 0 and self.batch * 2 <= MAX_BATCH)
    @rule()
    def repeat(self) -> None:
        self.cache.batch_repeat_interleave(2)
        for ref in self.refs:
            ref.map_batch(lambda t: t.repeat_interleave(2, dim=0))
        self.batch *= 2

    @precondition(lambda self: self.refs[0].length > 0 and self.batch > 1)
    @rule()
    def select_first(self) -> None:
        idx = torch.tensor([0])
        self.cache.batch_select_indices(idx)
        for ref in self.refs:
            ref.map_batch(lambda t: t[idx])
        self.batch = 1

    @rule()
    def deepcopy(self) -> None:
        self.cache = copy.deepcopy(self.cache)

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        for ref in self.refs:
            ref.clear()

    @rule()
    def record(self) -> None:
        self.cache.activate_past_recording()

    @invariant()
    def agree(self) -> None:
        assert self.cache.get_seq_length() == self.refs[0].length
        for layer, ref in zip(self.cache.layers, self.refs):
            assert isinstance(layer, AsymKVLayer)
            ks = layer.key_store
            assert ks.sinks.length + ks.blocks.length + ks.window.length == ref.length
            if not ref.length:
                continue
            empty = torch.zeros(self.batch, self.heads, 0, self.head_dim)
            keys, values = layer.update(empty, empty)
            ns = ks.sinks.length
            assert torch.equal(keys[:, :, :ns], ref.k[:, :, :ns])
            if layer.stats["requantized_tokens"] == 0:  # no inexact rollback happened: the window is exact
                tail = slice(ns + ks.blocks.length, ref.length)
                assert torch.equal(keys[:, :, tail], ref.k[:, :, tail])
                assert torch.equal(values[:, :, tail], ref.v[:, :, tail])
            assert sqnr_db(ref.k, keys) > 30 and sqnr_db(ref.v, values) > 10  # int8 keys, int4 values


# The machine mixes multi-token updates and decode steps freely, which is what a new prompt on a used cache looks
# like to the reuse rule (hf_asymkv.core.reuse): its warning is expected here and checked in test_cache_reuse.py.
@pytest.mark.filterwarnings("ignore::hf_asymkv.core.reuse.CacheReuseWarning")
def test_cache_against_reference(single_thread):
    run_state_machine_as_test(CacheMachine, settings=settings(FUZZ_SETTINGS, max_examples=15))


# ------------------------------------------------------------------------------------------------ interrupts
class InterruptedLayerMachine(LayerMachine):
    """:class:`LayerMachine` with interrupts (issue 56) among its operations."""

    @rule(data=st.data(), call=st.sampled_from(["update", "crop", "reorder"]), line=st.integers(1, 700))
    def interrupted(self, data, call: str, line: int) -> None:
        """An update, crop or beam reorder interrupted at the ``line``-th core line it runs: the layer is left as it
        was and the machine goes on with it (a call that ends before that line is dropped, the layer unchanged)."""
        trial = copy.deepcopy(self.layer)
        if call == "update":
            n = data.draw(st.integers(1, 12), label="tokens")
            k, v = _tokens(self.batch, n, self.seed + 1000, 1.0)
            position_ids = (torch.arange(n)[None] - torch.zeros(self.batch, 1, dtype=torch.long)).clamp(min=0)
            op = lambda: trial.update(k, v, kwargs={"position_ids": position_ids})  # noqa: E731
        elif call == "crop":
            n = data.draw(st.integers(0, max(self.ref.length, 1)), label="remove")
            op = lambda: trial.crop(-n)  # noqa: E731
        else:
            perm = torch.tensor(data.draw(st.permutations(range(self.batch)), label="beam_idx"))
            op = lambda: trial.reorder_cache(perm)  # noqa: E731
        before = layer_state(self.layer)
        where = run_interrupted(op, line)
        if where is not None:
            assert_same(layer_state(trial), before, f"{call} interrupted at {where}")
            self.layer = trial


class InterruptedCacheMachine(CacheMachine):
    """:class:`CacheMachine` with interrupts among its operations."""

    @rule(data=st.data(), call=st.sampled_from(["crop", "reorder", "update"]), line=st.integers(1, 900))
    def interrupted(self, data, call: str, line: int) -> None:
        """A crop or beam reorder of the whole cache, or one layer's update, interrupted at a core line: every layer
        and the cache's bookkeeping are left as they were (a call that ends first is dropped)."""
        trial = copy.deepcopy(self.cache)
        if call == "crop":
            n = data.draw(st.integers(1, 12), label="remove")
            op = lambda: trial.crop(-n)  # noqa: E731
        elif call == "reorder":
            perm = torch.tensor(data.draw(st.permutations(range(self.batch)), label="beam_idx"))
            op = lambda: trial.reorder_cache(perm)  # noqa: E731
        else:
            g = torch.Generator().manual_seed(self.seed + 1000)
            k, v = (torch.randn(self.batch, self.heads, 5, self.head_dim, generator=g) for _ in range(2))
            index = data.draw(st.integers(0, len(self.refs) - 1), label="layer")
            op = lambda: trial.update(k, v, index)  # noqa: E731
        before = cache_state(self.cache)
        where = run_interrupted(op, line)
        if where is not None:
            assert_same(cache_state(trial), before, f"{call} interrupted at {where}")
            self.cache = trial


INTERRUPT_SETTINGS = settings(FUZZ_SETTINGS, max_examples=max(EXAMPLES // 4, 1))


def _interrupted_layer_machine(key_format, key_symmetric, key_rotation, value_bits, value_rotation, sinks, calibrated):
    return type("Machine", (InterruptedLayerMachine,), dict(
        key_format=key_format, key_symmetric=key_symmetric, key_rotation=key_rotation, value_bits=value_bits,
        value_rotation=value_rotation, sinks=sinks, calibrated=calibrated))


@pytest.mark.parametrize("key_format, key_symmetric, key_rotation, value_bits, value_rotation, sinks, calibrated",
                         PRESET_COMBOS[1:3], ids=PRESET_IDS[1:3])
def test_interrupted_layer_against_reference(key_format, key_symmetric, key_rotation, value_bits, value_rotation, sinks,
                                             calibrated, single_thread):
    machine = _interrupted_layer_machine(key_format, key_symmetric, key_rotation, value_bits, value_rotation, sinks,
                                         calibrated)
    run_state_machine_as_test(machine, settings=INTERRUPT_SETTINGS)


@pytest.mark.slow(reason="the interrupt machine over every preset format, with the layer machine's examples: ~60 s; "
                         "fast twin: tests/core/test_fuzz.py::test_interrupted_layer_against_reference")
@pytest.mark.parametrize("key_format, key_symmetric, key_rotation, value_bits, value_rotation, sinks, calibrated",
                         PRESET_COMBOS, ids=PRESET_IDS)
def test_interrupted_layer_against_reference_every_format(key_format, key_symmetric, key_rotation, value_bits,
                                                          value_rotation, sinks, calibrated, single_thread):
    machine = _interrupted_layer_machine(key_format, key_symmetric, key_rotation, value_bits, value_rotation, sinks,
                                         calibrated)
    run_state_machine_as_test(machine, settings=FUZZ_SETTINGS)


@pytest.mark.filterwarnings("ignore::hf_asymkv.core.reuse.CacheReuseWarning")
def test_interrupted_cache_against_reference(single_thread):
    run_state_machine_as_test(InterruptedCacheMachine, settings=INTERRUPT_SETTINGS)

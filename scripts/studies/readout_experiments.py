"""Three ways to a faster eager dense read-out that did not work (issue 20, item 6), each patched into this process
only and timed against the unchanged code in the same run:

- ``reused``: each read-out written into one of two buffers kept across steps (K, then V), with room to grow, and
  handed to SDPA as a ``[:, :, :n]`` view; no fresh allocation per step.
- ``one-thread``: the layer update (read-out included) run with one torch thread, the rest of the model with
  ``--threads``.
- ``compiled``: the read-out (prefix, decoded codes, tail in one ``torch.cat``) compiled per storage format with
  ``torch.compile``, the token axis marked dynamic (``dynamic=True`` for every axis fails in inductor's C++ code
  generation on torch 2.13); compiled in an untimed warm-up.

    python scripts/studies/readout_experiments.py --presets compact,balanced --out results/bench/readout_experiments.md

The default model (fp32) at ``--length`` tokens; per round every variant in turn: prefill, 3 untimed steps,
``--steps`` timed steps, median ms per step; three rounds, ratios against DynamicCache in the same round.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from hf_asymkv.core import kv_view
from hf_asymkv.core.fileio import atomic_write_text
from hf_asymkv.core.layer import AsymKVLayer
from hf_asymkv.core.packing import PackedCodes
from hf_asymkv.core.quant import dequantize
from hf_asymkv.core.rotation import dequantize_rotated
from hf_asymkv.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
from key_channel_bits import study_args  # noqa: E402
from update_cost import make, step_times, warmed_up  # noqa: E402

EAGER_DENSE = kv_view.QuantizedKV.dense
EAGER_UPDATE = AsymKVLayer.update
VARIANTS = ("eager", "reused", "one-thread", "compiled")
_buffers: list[torch.Tensor | None] = [None, None]
_calls = [0]


def reused_dense(self) -> torch.Tensor:
    """:meth:`QuantizedKV.dense` into a buffer kept across steps (K and V alternate), as a view."""
    b, h, n, d = self.shape
    slot = _calls[0] % 2
    _calls[0] += 1
    buf = _buffers[slot]
    if buf is None or buf.shape[2] < n or buf.shape[:2] != (b, h) or buf.dtype != self.dtype:
        buf = _buffers[slot] = self.tail.new_empty(b, h, n + 256, d)
    out = buf[:, :, :n]
    ns, nq = self.n_prefix, self.n_quantized
    if ns:
        out[:, :, :ns] = self.prefix
    read = dequantize_rotated if self.spec.rotated else dequantize
    read(self.codes, self.scale, self.zero, self.spec, dtype=out.dtype, out=out[:, :, ns : ns + nq])
    out[:, :, ns + nq :] = self.tail
    return out


def one_thread_update(self, *args, **kwargs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return EAGER_UPDATE(self, *args, **kwargs)
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _compiled(spec, dtype: torch.dtype, with_prefix: bool):
    def read_out(prefix, data, scale, zero, tail):
        codes = PackedCodes(data, spec.bits, spec.layout, spec.block_size)
        read = dequantize_rotated if spec.rotated else dequantize
        middle = read(codes, scale, zero, spec, dtype=dtype)
        return torch.cat([prefix, middle, tail] if with_prefix else [middle, tail], dim=2)

    return torch.compile(read_out, dynamic=False)


def compiled_dense(self) -> torch.Tensor:
    if self.n_quantized == 0 or self.overlay is not None:
        return EAGER_DENSE(self)
    for t in (self.codes.data, self.scale, self.zero, self.tail):
        if t is not None:
            torch._dynamo.mark_dynamic(t, 2)
    read_out = _compiled(self.spec, self.tail.dtype, self.prefix is not None)
    return read_out(self.prefix, self.codes.data, self.scale, self.zero, self.tail)


def use(variant: str) -> None:
    kv_view.QuantizedKV.dense = {"reused": reused_dense, "compiled": compiled_dense}.get(variant, EAGER_DENSE)
    AsymKVLayer.update = one_thread_update if variant == "one-thread" else EAGER_UPDATE


def step_ms(model, ids: torch.Tensor, preset: str | None, variant: str, steps: int) -> float:
    use(variant)
    try:
        cache = make("dynamic" if preset is None else preset, model.config)
        times = step_times(model, warmed_up(model, ids, cache), cache, steps)
    finally:
        use("eager")
    return sorted(times)[steps // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="compact,balanced")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = study_args(ap)
    model, _ = load_model()
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    runs = [(None, "eager")] + [(p, v) for p in args.presets.split(",") for v in VARIANTS]
    for preset in args.presets.split(","):  # untimed: compile each format's read-out
        step_ms(model, ids, preset, "compiled", 2)
    ms: dict[tuple, list[float]] = {run: [] for run in runs}
    for _ in range(args.rounds):
        for run in runs:
            ms[run].append(step_ms(model, ids, *run, args.steps))
    base = ms[(None, "eager")]
    lines = [f"`python scripts/studies/readout_experiments.py --presets {args.presets} --length {args.length} --steps "
             f"{args.steps} --rounds {args.rounds} --threads {args.threads} --out {args.out}` (torch threads: "
             f"{args.threads})", "", f"SmolLM2-135M fp32, {args.length}-token context, median ms per decode step, x "
             "DynamicCache in the same round:", "",
             "| cache | read-out | " + " | ".join(f"round {i + 1}" for i in range(args.rounds)) + " |",
             "|---|---|" + "---:|" * args.rounds]
    for preset, variant in runs:
        cells = [f"{m:.1f} ms, {m / b:.2f}x" for m, b in zip(ms[(preset, variant)], base)]
        lines.append(f"| {preset or 'DynamicCache'} | {variant if preset else '-'} | " + " | ".join(cells) + " |")
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

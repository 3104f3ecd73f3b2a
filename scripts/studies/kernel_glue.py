"""Host time of our own Python around the Triton decode attention, per call, with the two kernels stubbed out.

On the H200 (results/gpu/h200_check) one attention call took ~350 µs more in an eager loop than replayed from a CUDA
graph (`balanced`, 32k: 457 vs 103 µs): host time. This splits off the part that is ours, on any CPU: the
backend choice and the request check (``triton_fused_attention``), the storage-to-regions translation
(``kernel_regions``) and the argument lists of the two launches (``launch_decode_attention`` up to the launch).
The Triton launches themselves (about 100 arguments each) and the driver are what is left of the GPU figure; this
script cannot time them. Llama-3-8B's layer shapes (32 query heads, 8 KV heads of 128 channels), bf16 codes.

    python scripts/studies/kernel_glue.py --presets balanced,compact,max --contexts 4096,32768 --batches 1,8 \
        --out results/gpu/kernel_glue.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from layer_step import best_ms  # noqa: E402


class _Stub:
    """Stands for a Triton kernel: ``kernel[grid](*args, **constexprs)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def best_us(fn, repeats: int) -> float:
    return best_ms(fn, repeats) * 1e3  # best of ``repeats`` calls after 3 warm-up calls


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="balanced,compact,max")
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # the launcher imports Triton; nothing runs on a GPU here
    from hf_asymkv.kernels.interpreter import prepare_interpreter

    prepare_interpreter()
    import torch

    from hf_asymkv.bench import gpu_attention, gpu_runs
    from hf_asymkv.core import backend
    from hf_asymkv.core.fileio import atomic_write_text
    from hf_asymkv.kernels import decode

    torch.set_num_threads(1)
    decode.partial_attention_kernel = decode.merge_partials_kernel = _Stub()
    decode._target_programs = lambda device, launch=None: 4 * 132  # an H200's split count (132 SMs)
    os.environ["HF_ASYMKV_ATTENTION_BACKEND"] = "triton"
    shapes = gpu_runs.ModelShapes(layers=1, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=64,
                                  vocab=128)
    model = gpu_runs.build_model(shapes, torch.float32, torch.device("cpu"))
    rows = []
    for preset in args.presets.split(","):
        for context in map(int, args.contexts.split(",")):
            for batch in map(int, args.batches.split(",")):
                key, value, query = gpu_attention.quantized_kv(model, preset, batch, context, torch.bfloat16)
                calls = {
                    "kernel_regions": lambda: backend.kernel_regions(key, value, None, 1),  # noqa: B023
                    "launch_decode_attention (+ regions)": lambda: decode.launch_decode_attention(  # noqa: B023
                        query, 0.1, quantized=(r := backend.kernel_regions(key, value, None, 1))[0],  # noqa: B023
                        exact=r[1], kv_len=key.shape[2]),  # noqa: B023
                    "triton_fused_attention (all of ours)": lambda: backend.triton_fused_attention(  # noqa: B023
                        query, key, value, None, 0.1, None),  # noqa: B023
                }
                for name, fn in calls.items():
                    rows.append((preset, context, batch, name, best_us(fn, args.repeats)))
                    print(*rows[-1][:4], f"{rows[-1][4]:.0f} µs", flush=True)
    lines = [f"`python scripts/studies/kernel_glue.py --presets {args.presets} --contexts {args.contexts} --batches "
             f"{args.batches} --out {args.out}` (one torch thread, best of {args.repeats} calls, kernels stubbed)", "",
             "| preset | context | batch | our host code up to the launches | µs per call |", "|---|---:|---:|---|---:|"]
    lines += [f"| {p_} | {c} | {b} | {n} | {us:.0f} |" for p_, c, b, n, us in rows]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

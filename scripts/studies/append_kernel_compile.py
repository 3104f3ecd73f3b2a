"""Compile the Triton append kernel for a GPU target on a machine without a GPU and report its resources.

For every preset's key and value formats (and fp8 keys), the kernel (``hf_asymkv/kernels/triton_append.py``) is
compiled through ``triton.compile`` for ``--arch`` (default sm_90, an H100/H200) with bf16 inputs and ``--head-dim``
channels, then the wheel's ``cuobjdump --dump-resource-usage`` reads registers, spills and shared memory from the
cubin. It checks that every served format compiles for the GPU (the CPU tests run the same kernel under Triton's
interpreter, which does not) and that no variant spills.

    python scripts/studies/append_kernel_compile.py --head-dim 128 --out results/gpu/append_kernel_compile.md
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_asymkv.core.append import block_format
from hf_asymkv.core.presets import PRESETS
from hf_asymkv.kernels import append as launcher
from hf_asymkv.kernels.triton_append import append_blocks_kernel

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def formats(head_dim: int) -> dict[str, object]:
    out = {}
    for name, config in PRESETS.items():
        resolved = config.resolved([head_dim])
        out[f"{name} keys"], out[f"{name} values"] = resolved.key_spec(), resolved.value_spec()
    fp8 = PRESETS["balanced"].replace(key_format="fp8_e4m3").resolved([head_dim])
    out["fp8_e4m3 keys"] = fp8.key_spec()
    return out


def compile_one(spec, head_dim: int, arch: int, dtype: torch.dtype, calibrated: bool, slots: bool):
    fmt = block_format(spec, head_dim)
    finfo = torch.finfo(fmt.meta_dtype)
    planes = fmt.planes + (0,)
    ptr = {"x_ptr": f"*{_TYPES[dtype]}", "calib_ptr": f"*{_TYPES[fmt.meta_dtype]}", "codes_ptr": "*u8",
           "scale_ptr": f"*{_TYPES[fmt.meta_dtype]}", "zero_ptr": f"*{_TYPES[fmt.meta_dtype]}", "bits_ptr": "*u8",
           "chan_ptr": "*u8", "slots_ptr": "*i64", "valid_ptr": "*u8", "counts_ptr": "*i64"}
    constexprs = dict(
        BS=fmt.block_size, D=head_dim, BITS=fmt.bits, FP8=launcher._FP8[fmt.fp8], SYMMETRIC=fmt.symmetric,
        QMAX=fmt.qmax, OFFSET=fmt.offset, TOKEN_GROUPS=fmt.granularity == "token", CG=fmt.group_size,
        META=launcher._META[fmt.meta_dtype], TINY=finfo.tiny, MAX=finfo.max, TOKENS_LAYOUT=fmt.tokens_layout,
        W0=planes[0], W1=planes[1], ROTATED=fmt.rotated, ROT_SCALE=1 / math.sqrt(head_dim), CALIBRATED=calibrated,
        STEPS=fmt.two_means_steps, WIDE=fmt.wide, WIDE_QMAX=fmt.wide_qmax, WIDE_OFFSET=fmt.wide_offset, SLOTS=slots)
    signature = {}
    for name in append_blocks_kernel.arg_names:
        signature[name] = "constexpr" if name in constexprs else ptr.get(name, "i32")
    source = ASTSource(fn=append_blocks_kernel, signature=signature,
                       constexprs={(append_blocks_kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    warps = launcher._warps(fmt.block_size, head_dim, fmt.wide)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": warps, "enable_fp_fusion": False})
    return kernel, warps


def resources(kernel) -> dict[str, int]:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k: int(v) for k, v in found.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    lines = [f"Append kernel compiled for sm_{args.arch}, head_dim {args.head_dim}, bf16 inputs "
             f"(`python scripts/studies/append_kernel_compile.py --head-dim {args.head_dim} --arch {args.arch}`)", "",
             "| format | spec | warps | registers | stack | local (spills) | shared |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, spec in formats(args.head_dim).items():
        variants = [(False, False), (False, True)]
        if spec.granularity == "channel" and spec.symmetric and not spec.rotated:
            variants.append((True, False))  # a calibrated key range
        for calibrated, slots in variants:
            kernel, warps = compile_one(spec, args.head_dim, args.arch, torch.bfloat16, calibrated, slots)
            r = resources(kernel)
            label = name + (", calibrated" if calibrated else "") + (", static slots" if slots else "")
            short = dataclasses.replace(spec, scale_dtype=spec.scale_dtype)
            lines.append(f"| {label} | {short.fmt} {short.granularity} bs={short.block_size} | {warps} | "
                         f"{r.get('REG', '?')} | {r.get('STACK', '?')} | {r.get('LOCAL', '?')} | {r.get('SHARED', '?')} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()

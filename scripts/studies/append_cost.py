"""Operations, Triton launches, host syncs and time of one flushed block per tensor kind, on each append backend
(``hf_asymkv/bench/append_cost.py``). On a machine without a GPU the kernel runs under Triton's interpreter: the
counts hold, the kernel's times mean nothing.

    python scripts/studies/append_cost.py --out results/append/append_cost_cpu.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=None, help="default: every preset")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--flushes", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():  # before anything imports the kernel
        from hf_asymkv.kernels.interpreter import prepare_interpreter

        prepare_interpreter()
    from hf_asymkv.bench.append_cost import append_cost_rows, write_report
    from hf_asymkv.core.presets import PRESETS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    rows = append_cost_rows(args.presets or list(PRESETS), device, dtype, batch=args.batch, heads=args.heads,
                            head_dim=args.head_dim, flushes=args.flushes)
    command = "python scripts/studies/append_cost.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (kernel interpreted)",
                dtype=str(dtype).removeprefix("torch."), batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                command=command, threads=torch.get_num_threads())
    print(write_report(rows, args.out, meta))


if __name__ == "__main__":
    main()

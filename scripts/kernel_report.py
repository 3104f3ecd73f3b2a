"""What the Triton decode kernels issue per byte of K/V, on CUDA cards this machine does not have (issue 37).

Compiles the decode kernels for sm_90a, sm_89 and sm_80 through Triton's JIT (a stub driver answers the target; no GPU
needed) with the launch settings the launcher picks, for every preset x bf16/fp16 x head_dim 64/128/256 x query rows
(GQA 1 and 4 with 1 query token, GQA 4 with 5), plus the shapes that ask the most shared memory (float32 and bf16,
head_dim 256, 128 query rows); disassembles them with the wheel's cuobjdump and writes results/gpu/kernel_report.{md,json}:
registers, spills, shared memory, and the main loop's warp instructions per K/V byte by class, beside the budget of
an H100 and an H200. See :mod:`hf_asymkv.bench.kernel_report`.

Usage:
    python scripts/kernel_report.py                                    # everything (about 15 minutes on one core)
    python scripts/kernel_report.py --arches sm_90a --dtypes bf16 --head-dims 128 --rows gqa4-q1 --no-shared
    python scripts/kernel_report.py --configs balanced-bf16-d128-gqa4-q1-sm_90a --lines 12 --out /tmp/report
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

# ----------------------------------------------------------------------------- defaults
OUT = Path(__file__).resolve().parents[1] / "results" / "gpu"  # kernel_report.{md,json}
THREADS = 1  # torch CPU threads (building the caches); compiling is one process anyway


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from hf_asymkv.bench import kernel_report as kr
    from hf_asymkv.core.presets import preset_names

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=preset_names(), choices=preset_names())
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(kr.DTYPES))
    p.add_argument("--head-dims", type=int, nargs="+", default=list(kr.HEAD_DIMS))
    p.add_argument("--rows", nargs="+", default=list(kr.QUERY_ROWS), choices=list(kr.QUERY_ROWS) + list(kr.WIDEST_ROWS),
                   help="query heads per KV head and query tokens")
    p.add_argument("--arches", nargs="+", default=list(kr.SM_COUNT), choices=list(kr.SM_COUNT))
    p.add_argument("--no-shared", action="store_true", help="skip the largest shapes (the shared-memory worst cases)")
    p.add_argument("--configs", nargs="+", default=None, metavar="NAME",
                   help="exactly these configurations (e.g. balanced-bf16-d128-gqa4-q1-sm_90a), instead of the grid")
    p.add_argument("--context", type=int, default=kr.CONTEXT, help="tokens in the cache (default: %(default)s)")
    p.add_argument("--out", type=Path, default=OUT, help="output folder (default: results/gpu)")
    p.add_argument("--guard-into", type=Path, default=None, metavar="JSON",
                   help="also record this run's instructions per byte for the installed Triton in JSON (the CI guard's "
                        "committed figures, results/gpu/kernel_guard.json)")
    p.add_argument("--baseline", type=Path, default=None, metavar="JSON",
                   help="an earlier kernel_report.json: its figures go beside this run's (the before column)")
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--quiet", action="store_true", help="no line per configuration")
    p.add_argument("--lines", type=int, default=0, metavar="N",
                   help="also print (and keep in the JSON) the N source lines of each configuration's code loop that "
                        "issue the most instructions (nvdisasm's line table)")
    args = p.parse_args(argv)
    bad = [h for h in args.head_dims if not 1 <= h <= 256]
    if bad:
        p.error(f"--head-dims must be in [1, 256], got {bad}")
    if args.baseline is not None and not args.baseline.is_file():
        p.error(f"--baseline {args.baseline}: no such file (an earlier kernel_report.json expected)")
    if args.baseline is not None:  # read before the compiles, so that a wrong file fails in a second, not minutes
        try:
            args.baseline_figures = kr.baseline(args.baseline)
        except ValueError as exc:
            p.error(f"--baseline {exc}")
    if args.lines < 0:
        p.error(f"--lines must be >= 0 (source lines to print per configuration), got {args.lines}")
    if args.context < 512:
        p.error(f"--context must be >= 512 (every preset then quantizes blocks), got {args.context}")
    try:
        args.configs = None if args.configs is None else [kr.Config.parse(name) for name in args.configs]
    except ValueError as exc:
        p.error(str(exc))
    return args


def _commit() -> str:
    """The checkout's commit, ``+changes`` when the package's files differ from it: taken when the run starts, the
    code its compiles read (a run takes minutes; a commit made meanwhile is not what it measured)."""
    here = Path(__file__).resolve().parent
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=here)
        changed = subprocess.run(["git", "status", "--porcelain", "--", "hf_asymkv"], capture_output=True, text=True,
                                 check=True, cwd=here.parent)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def main(argv: list[str] | None = None) -> dict:
    if os.environ.get("TRITON_INTERPRET") == "1":  # kernels defined under the interpreter cannot be compiled
        raise SystemExit("kernel_report.py: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)")
    args = parse_args(argv)
    import torch
    import triton

    from hf_asymkv.bench import kernel_report as kr

    torch.set_num_threads(args.threads)
    configs = args.configs or kr.grid(args.presets, args.dtypes, args.head_dims, args.rows, args.arches)
    if not args.no_shared and args.configs is None:
        configs += [c for c in kr.shared_cases(args.presets, args.arches) if c not in configs]
    started, commit = time.monotonic(), _commit()

    def progress(row: dict) -> None:
        if not args.quiet:
            print(f"{row['name']}: {row['per_byte']:.3f} warp instr/byte, {row['registers']} registers, "
                  f"shared {row['shared_bytes']} B", flush=True)
        for entry in row.get("lines", []):
            top = ", ".join(f"{op} {n}" for op, n in sorted(entry["opcodes"].items(), key=lambda kv: -kv[1])[:5])
            print(f"  {entry['instructions']:5d}  {entry['file']}:{entry['line']}  ({top})", flush=True)

    rows = kr.measure(configs, args.context, progress, args.lines)
    command = "python " + " ".join(shlex.quote(a) for a in ["scripts/kernel_report.py", *(argv or sys.argv[1:])])
    meta = {"command": command, "triton": triton.__version__, "torch": torch.__version__, "commit": commit,
            "context": args.context, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "seconds": round(time.monotonic() - started, 1)}
    report = {"meta": meta, "cards": [dict(name=c.name, arch=c.arch, budget=c.budget) for c in kr.CARDS],
              "targets": kr.TARGETS, "rows": rows}
    if args.baseline is not None:
        report["baseline"] = args.baseline_figures
    paths = kr.write(args.out, report)
    if args.guard_into is not None:
        paths.append(kr.record_guard(args.guard_into, report))
    for path in paths:
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()

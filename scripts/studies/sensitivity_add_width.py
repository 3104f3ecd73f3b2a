"""Add key widths that a committed sensitivity file lacks (measured on that file's own calibration window).

``results/protection/smollm2_qwen/sensitivity*.json`` were measured before the ``int4w`` key width (compact's keys
with wide channels) existed; an allocation from them could not choose it. This measures the missing widths with
:func:`~hf_asymkv.calibration.sensitivity.layer_sensitivity` on the same window each file names (``text``: the
first 2048 tokens of the built-in text, 16 queries; ``needle7``: the multikey needle prompt of seed 7, 32 queries)
on the same stress model, and writes them into the file (atomically; the other widths are kept as they are).

    python scripts/studies/sensitivity_add_width.py --widths int4w \\
        --file results/protection/smollm2_qwen/sensitivity.json:text \\
        --file results/protection/smollm2_qwen/sensitivity_needle.json:needle7
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_asymkv.calibration.sensitivity import KEY_WIDTHS, layer_sensitivity
from hf_asymkv.core.fileio import atomic_write_text
from hf_asymkv.evals.evaluate import encode_prompt
from hf_asymkv.evals.haystack import load_text
from hf_asymkv.evals.needle import make_task
from hf_asymkv.evals.ppl import text_windows
from hf_asymkv.evals.stress import stress_model
from hf_asymkv.models import load_model

WINDOWS = {
    "text": lambda tok: text_windows(tok, load_text(None)[0], 2048, 1)[0],
    "needle7": lambda tok: encode_prompt(tok, make_task(tok, "multikey", 2048, 0.5, 7, "noise")),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", required=True, help="comma-separated key widths of KEY_WIDTHS to add")
    ap.add_argument("--file", action="append", required=True, help="PATH:WINDOW, WINDOW one of " + ", ".join(WINDOWS))
    ap.add_argument("--stress", default="qwen")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    widths = args.widths.split(",")
    if unknown := sorted(set(widths) - set(KEY_WIDTHS)):
        ap.error(f"--widths: unknown {unknown}; known: {list(KEY_WIDTHS)}")
    files = []
    for item in args.file:
        path, _, window = item.rpartition(":")
        if window not in WINDOWS or not Path(path).is_file():
            ap.error(f"--file {item!r}: expected an existing PATH and a WINDOW of {list(WINDOWS)}")
        files.append((Path(path), window))
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    stress_model(model, tok, args.stress)
    for path, window in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        new = layer_sensitivity(model, WINDOWS[window](tok), data["queries"], key_widths=widths, value_widths=[])
        if new["layers"] != data["layers"] or new["tokens"] != data["tokens"]:
            raise SystemExit(f"{path}: its window ({data['tokens']} tokens, layers {data['layers']}) is not the one "
                             f"measured now ({new['tokens']} tokens, layers {new['layers']})")
        for width in widths:
            data["keys"][width] = new["keys"][width]
            data["widths"][width] = KEY_WIDTHS[width]
        data["command"] += f"; key widths {widths} added by scripts/studies/sensitivity_add_width.py"
        atomic_write_text(path, json.dumps(data, indent=1) + "\n")
        print(f"{path}: added {widths}: " + ", ".join(f"{w} mean {sum(new['keys'][w]) / len(new['keys'][w]):.3g}"
                                                    for w in widths))


if __name__ == "__main__":
    main()

"""Check an `hf-asymkv export-vllm --model` folder with the real parsers available without a GPU: compressed-tensors
validates its ``quantization_config``, transformers loads it, and greedy generation matches the source model.

    hf-asymkv export-vllm --scales results/calibration/kv_scales_2k.safetensors --model smollm2-135m-instruct \
        --out /tmp/smollm2-fp8kv --strategy attn_head
    python scripts/check_serving_export.py /tmp/smollm2-fp8kv --source smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PROMPT = "The three primary colors are"  # any fixed prompt
NEW_TOKENS = 24  # greedy tokens compared


def main() -> None:
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_asymkv.models import DEFAULT_MODEL, default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("serve_dir", type=Path, help="the export folder")
    p.add_argument("--source", default=DEFAULT_MODEL, help="the checkpoint it was exported from")
    args = p.parse_args()
    source = default_model_path() if args.source == DEFAULT_MODEL else Path(args.source)
    qc = json.loads((args.serve_dir / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(qc).kv_cache_scheme
    print(f"compressed-tensors: quantization_config valid; kv_cache_scheme strategy={scheme.strategy} "
          f"num_bits={scheme.num_bits} type={scheme.type} symmetric={scheme.symmetric}")
    tokenizer = AutoTokenizer.from_pretrained(args.serve_dir)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    outputs = []
    for folder in (source, args.serve_dir):
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
        with torch.no_grad():
            outputs.append(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:])
        print(f"{folder}: loaded, missing {len(info['missing_keys'])}, unexpected {len(info['unexpected_keys'])} "
              f"({sorted(info['unexpected_keys'])[:2]} ...)")
    same = torch.equal(outputs[0], outputs[1])
    print(f"greedy {NEW_TOKENS} tokens identical: {same}: {tokenizer.decode(outputs[1])!r}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

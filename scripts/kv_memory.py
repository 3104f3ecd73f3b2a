"""Thin wrapper: `python scripts/kv_memory.py [--lengths 4096 ...]` == `hf-asymkv memory ...`.

Counts the real tensor bytes each cache holds after a prefill (bf16 model by default) and prints the ratio
against DynamicCache. The README's memory table comes from:
    python scripts/kv_memory.py --lengths 1024,4096,8192 --decode-tokens 64 --out results/memory/smollm2.json
"""

import sys

from hf_asymkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["memory", *sys.argv[1:]]))

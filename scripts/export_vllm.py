"""Thin wrapper: `python scripts/export_vllm.py ...` == `hf-asymkv export-vllm ...` (see `--help`)."""

import sys

from hf_asymkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["export-vllm", *sys.argv[1:]]))

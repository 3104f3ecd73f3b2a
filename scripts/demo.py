"""Thin wrapper: `python scripts/demo.py [--context 3000 ...]` == `hf-asymkv demo ...`."""

import sys

from hf_asymkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))

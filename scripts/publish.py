"""Thin wrapper: `python scripts/publish.py ...` == `hf-asymkv publish ...` (see `--help`)."""

import sys

from hf_asymkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["publish", *sys.argv[1:]]))

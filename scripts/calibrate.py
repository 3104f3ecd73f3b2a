"""Thin wrapper: `python scripts/calibrate.py ...` == `hf-asymkv calibrate ...` (see `--help`)."""

import sys

from hf_asymkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["calibrate", *sys.argv[1:]]))

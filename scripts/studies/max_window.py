"""`max`'s exact window: 32 (the preset), 48 and 64 tokens, through the evaluation commands.

`max` (int3 keys with wide channels, 1-bit rotated values) keeps the last 32 tokens exact. Its 1-bit values hurt
most where the next token depends on the recent past, which the long-decode measure sees. This registers two
schemes, ``max-w48`` and ``max-w64`` (`max` with that ``residual_length``), and runs ``hf-asymkv`` with the
arguments given, so any evaluation can put them beside ``asymkv-max``:

    python scripts/studies/max_window.py eval long-decode --prompts 2 --schemes dynamic,max-w48,max-w64 \\
        --threads 2 --quiet --out results/presets/max_window/long_decode
    python scripts/studies/max_window.py eval frontier --schemes dynamic,asymkv-max,max-w48,max-w64 --lengths 2048 \\
        --depths 0.25,0.5,0.75 --tasks single,multikey --attention-length 2048 --bytes-length 4096 --threads 2 \\
        --quiet --out results/presets/max_window/frontier

(The result files quote the ``hf-asymkv`` command line this script ran, with the ``--out`` it was given.)
"""

from __future__ import annotations

import sys

from hf_asymkv import PRESETS, AsymKVCache
from hf_asymkv.bench import schemes
from hf_asymkv.cli.app import main

WINDOWS = (48, 64)

if __name__ == "__main__":
    for window in WINDOWS:
        config = PRESETS["max"].replace(residual_length=window)
        schemes.SCHEMES[f"max-w{window}"] = (f"max with a {window}-token window",
                                             lambda model_config, c=config: AsymKVCache(model_config, c))
    sys.exit(main(sys.argv[1:]))

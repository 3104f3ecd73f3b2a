"""48-prompt needle grid for a compact candidate registered at run time (same grid as results/eval/smollm2_presets)."""
import sys
from hf_asymkv.bench.schemes import SCHEMES
from hf_asymkv.core.cache import AsymKVCache
SCHEMES["cand-compact-k4a64-w64"] = ("candidate compact: K int4 asym 64-token groups, V int3 rotated, window 64",
    lambda c: AsymKVCache(c, key_format="int4", key_symmetric=False, key_block_size=64, value_bits=3,
                          value_rotation=True, sink_tokens=4, residual_length=64))
from hf_asymkv.cli import main
sys.exit(main(["eval", "needle", "--lengths", "1024,2048,4096,8192", "--depths", "0.1,0.5,0.9", "--samples", "1",
               "--threads", "1", "--quiet", "--schemes", "cand-compact-k4a64-w64", "--out", "results/eval/smollm2_compact_candidate"]))

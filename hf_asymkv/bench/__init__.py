"""Benchmarks (tools over the core): named cache schemes, real byte counts, memory and speed per scheme.

- :mod:`.schemes`: every cache the measurements compare, by name (ours, baselines, transformers' own).
- :mod:`.memory`: the real bytes behind any `transformers.Cache`.
- :mod:`.kv_memory`: KV bytes per scheme beside DynamicCache (``hf-asymkv memory``).
- :mod:`.speed`: prefill/decode time, bytes and peak RSS per scheme (``hf-asymkv bench``).
"""

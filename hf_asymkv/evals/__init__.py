"""Model-level evaluations of the cache schemes (the ``hf-asymkv eval`` subcommands).

- :mod:`.haystack`: filler text for long prompts (repeated noise, distractor needles, local natural text).
- :mod:`.needle`: RULER-style retrieval prompts (single, multi-key, multi-value, multi-query) and scoring.
- :mod:`.retrieval`: the needle grid (length x depth x task) over every scheme, from one shared prefill.
- :mod:`.attention`: per-layer attention KL and top-k overlap of the last queries against full precision.
- :mod:`.ppl`: perplexity on long text, scored through each scheme's quantized history.
- :mod:`.report`: markdown tables and the JSON/PNG output folder; :mod:`.plots`: figures (matplotlib).
- :mod:`.common`: run metadata, progress bars, the shared-prefill scheme loop.

Nothing here is imported by the library proper; the plots need the ``eval`` extra.
"""

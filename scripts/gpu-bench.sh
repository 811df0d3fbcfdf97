#!/bin/sh
# The GPU-side benchmarks, as run on the H200 (see docs/benchmarks.md). Expects mlx[cuda] and the
# project's dependencies importable, OUT set to a results folder, and DATA holding
# tinycoder-draft-4m/ and tinycoder-dev.jsonl.
set -u
OUT=${OUT:-bench/results/gpu}; DATA=${DATA:-../shared}
mkdir -p "$OUT"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
python3 -m bench.make_random_model --shape llama-3.2-1b --bits 4 /tmp/llama1b-4bit
timeout ${SWEEP_S:-300} python3 -m bench serve-sweep --model /tmp/llama1b-4bit \
  --concurrency 1,4,16,64 --peers mlx_lm --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; tail -n 25 "$OUT/sweep.log"
timeout ${SPEC_S:-200} python3 -m bench.spec --draft-model "$DATA/tinycoder-draft-4m" \
  --data "$DATA/tinycoder-dev.jsonl" --dtype bfloat16 --concurrency 1,4,16 --out "$OUT/spec" \
  > "$OUT/spec.log" 2>&1
echo "spec rc=$?"; tail -n 25 "$OUT/spec.log"

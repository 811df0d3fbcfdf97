#!/usr/bin/env bash
# The GPU benchmarks of docs/benchmarks.md as run on an H100 or H200, stage by stage:
#
#   scripts/gpu-bench.sh [STAGE ...]     (default: every stage, in this order)
#
# coldstart (first: it needs a machine that has compiled nothing yet), prefill, sweep (1,024-token
# prompts at c=64), short (128-token prompts at c=4, 16, 64), agent (16 x 8), agent64 (64 x 4),
# stagger (16 x 8 with starts spread out and tool time between turns; mlxd alone), attention,
# switch, qmm, spec (the 8B twin in 4-bit), spec16 (in bf16), specmany (the 4-bit twin at 16 and
# 64 streams, with step traces), specpred (predicted outputs, the server's default),
# specjson (rows under a JSON schema speculating). Each stage runs under its own
# time limit (LIMIT_<STAGE>=seconds overrides it); its log goes to $OUT/<stage>.log, its JSON
# and PNG to $OUT/<stage>/, and after every stage $OUT is packed into $PACK (default
# $OUT.tgz), so that a run cut short keeps what finished.
# PEERS (default mlx_lm) are the servers sweep, short, agent and agent64 run beside mlxd ("" for none);
# WRAP, when set, prefixes every stage's command (a profiler, e.g. `py-spy record ... --`);
# MLXD_ARGS are passed to mlxd serve in sweep, short and the agent stages (e.g. "--trace-steps
# $OUT/steps.jsonl": where each engine step's time goes).
# Expects mlx[cuda] and mlxd's dependencies importable; DATA must hold tinycoder-draft-4m/ and
# tinycoder-dev.jsonl (the spec stages); the models are written to /tmp on first use.
set -u
OUT=${OUT:-.bench/gpu}; DATA=${DATA:-../shared}; PACK=${PACK:-$OUT.tgz}; PEERS=${PEERS-mlx_lm}
MODEL=/tmp/llama-1b-32k; TWIN=/tmp/twin-8b4; TWIN16=/tmp/twin-8b16
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"

need_model() {
  [ -f "$MODEL/config.json" ] || python3 -m bench random-model "$MODEL" --shape llama-3.2-1b \
    --bits 4 --context 32768 --vocab 128256 > "$OUT/model.log" 2>&1
}

need_twin() {  # dir log wide-twin-args...: the 8B-cost twin of tinycoder-16m, built once
  local dir=$1 log=$2; shift 2
  [ -f "$dir/config.json" ] || python3 -m bench wide-twin mlxd/models/tinycoder-16m "$dir" \
    --hidden 4608 --layers 32 --intermediate 14336 --heads 48 --kv-heads 16 "$@" > "$log" 2>&1
}

run() {  # stage default_limit command...
  local stage=$1 limit=$2; shift 2
  local var="LIMIT_${stage^^}"; limit=${!var:-$limit}
  local t0; t0=$(date +%s)
  echo "=== $stage (limit ${limit} s)"
  # shellcheck disable=SC2086  # WRAP is a command line
  timeout "$limit" ${WRAP:-} "$@" > "$OUT/$stage.log" 2>&1
  echo "--- $stage rc=$? in $(( $(date +%s) - t0 )) s"
  grep -v -e '^\[transformers\]' "$OUT/$stage.log" | tail -n 25
  tar czf "$PACK" -C "$(dirname "$OUT")" "$(basename "$OUT")"
}

stage() {
  case $1 in
    coldstart) need_model; run coldstart 180 python3 -m bench coldstart --model "$MODEL" \
                 --prompt-tokens 1024 --burst 16 --out "$OUT/coldstart" ;;
    prefill) need_model; run prefill 140 python3 -m bench prefill --model "$MODEL" --peers "" \
               --sizes 1024,8192,32768 --repeats 2 --out "$OUT/prefill" ;;
    sweep) need_model; run sweep 230 python3 -m bench sweep --model "$MODEL" --peers "$PEERS" \
             --prompt-tokens 1024 --output-tokens 128 --concurrency 64 --requests-per-level 128 \
             --level-deadline 60 --mlxd-args "${MLXD_ARGS:-}" --out "$OUT/sweep" ;;
    short) need_model; run short 200 python3 -m bench sweep --model "$MODEL" --peers "$PEERS" \
             --prompt-tokens 128 --output-tokens 128 --concurrency 4,16,64 --requests-per-level 64 \
             --level-deadline 40 --mlxd-args "${MLXD_ARGS:-}" --out "$OUT/short" ;;
    agent) need_model; run agent 300 python3 -m bench agent --model "$MODEL" --peers "$PEERS" \
             --sessions 16 --turns 8 --tool-tokens 200,2000 --deadline 60 --no-raw \
             --calib-repeats 1 --mlxd-args "${MLXD_ARGS:-}" --out "$OUT/agent" ;;
    agent64) need_model; run agent64 400 python3 -m bench agent --model "$MODEL" --peers "$PEERS" \
               --sessions 64 --turns 4 --tool-tokens 200,2000 --deadline 80 --no-raw \
               --calib-repeats 1 --mlxd-args "${MLXD_ARGS:-}" --out "$OUT/agent64" ;;
    stagger) need_model; run stagger 200 python3 -m bench agent --model "$MODEL" --peers "" \
               --sessions 16 --turns 8 --tool-tokens 200,2000 --stagger 16 --tool-seconds 0.5,4 \
               --deadline 120 --no-raw --calib-repeats 1 --mlxd-args "${MLXD_ARGS:-}" \
               --out "$OUT/stagger" ;;
    attention) run attention 120 python3 -m bench attention --out "$OUT/attention" ;;
    switch) need_model; run switch 70 python3 -m bench switch \
              --model coder=mlxd/models/tinycoder-16m --model "big=$MODEL" --rounds 2 \
              --out "$OUT/switch" ;;
    qmm) run qmm 170 python3 -m bench qmm --random-shape llama-3-8b --out "$OUT/qmm" ;;
    spec)
      need_twin "$TWIN" "$OUT/twin.log" --bits 4
      run spec 270 python3 -m bench spec --model "$TWIN" --draft-model "$DATA/tinycoder-draft-4m" \
        --data "$DATA/tinycoder-dev.jsonl" --dtype bfloat16 --workloads chat,code --concurrency 1,4 \
        --edit-concurrency 1,4 --max-tokens 256 --requests-per-stream 2 --edit-requests 4 --modes plain,draft,ngram \
        --edit-modes plain,ngram,draft --warmup --seconds 3 --repeats 2 --budget-s 190 --log \
        --out "$OUT/spec" ;;
    spec16)
      need_twin "$TWIN16" "$OUT/twin16.log" --bits 16 --dtype bfloat16
      run spec16 420 python3 -m bench spec --model "$TWIN16" \
        --draft-model "$DATA/tinycoder-draft-4m" --data "$DATA/tinycoder-dev.jsonl" \
        --dtype bfloat16 --workloads chat,code --concurrency 1,4 --modes plain,draft,ngram \
        --edit-modes plain,ngram --edit-concurrency 1,4 --edit-requests 8 \
        --requests-per-stream 2 --max-tokens 256 --warmup --repeats 1 --budget-s 330 \
        --out "$OUT/spec16" ;;
    specmany)
      need_twin "$TWIN" "$OUT/twin.log" --bits 4
      run specmany 330 python3 -m bench spec --model "$TWIN" --draft-model "$DATA/tinycoder-draft-4m" \
        --data "$DATA/tinycoder-dev.jsonl" --dtype bfloat16 --workloads chat --concurrency 16,64 \
        --edit-concurrency "" --max-tokens 128 --modes plain,ngram,draft --warmup --seconds 6 \
        --repeats 2 --budget-s 270 --trace-steps "$OUT/specmany/trace" --log --out "$OUT/specmany" ;;
    specpred)
      need_twin "$TWIN" "$OUT/twin.log" --bits 4
      run specpred 300 python3 -m bench spec --model "$TWIN" --data "$DATA/tinycoder-dev.jsonl" \
        --dtype bfloat16 --workloads chat --concurrency 1,4 --modes plain,prediction \
        --edit-concurrency 1 --edit-modes plain,prediction,ngram --edit-requests 8 \
        --requests-per-stream 2 --max-tokens 256 --warmup --repeats 2 --budget-s 240 \
        --trace-steps "$OUT/specpred/trace" --log --out "$OUT/specpred" ;;
    specjson)
      need_twin "$TWIN" "$OUT/twin.log" --bits 4
      run specjson 240 python3 -m bench spec --model "$TWIN" --data "$DATA/tinycoder-dev.jsonl" \
        --dtype bfloat16 --workloads json --concurrency 1,4 --modes plain,ngram \
        --edit-concurrency "" --requests-per-stream 3 --max-tokens 96 --warmup --repeats 2 \
        --budget-s 190 --log --out "$OUT/specjson" ;;
    *) echo "unknown stage $1" >&2; return 2 ;;
  esac
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(coldstart prefill sweep short agent agent64 stagger attention switch qmm spec spec16 specmany specpred specjson)
for s in "${stages[@]}"; do stage "$s"; done

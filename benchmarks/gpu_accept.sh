#!/usr/bin/env bash
# The device acceptance check (issue #41): one command on a lent GPU machine says whether omnirelay
# works there and how fast its decode step is, in at most 8 minutes on one H100.
#
#   bash benchmarks/gpu_wheels.sh                  # here, once, where pip reaches the index
#   bash benchmarks/gpu_accept.sh                  # on the device (run's carry: [".gpu-wheels"])
#   bash benchmarks/gpu_accept.sh --dry-run        # the same stages on the CPU at toy sizes (CI, < 2 min)
#
# The device has python3 with torch and transformers but no network: the check installs what the
# Python lacks (msgspec, pyzmq, … as benchmarks/gpu_wheels.txt lists) from the carried .gpu-wheels/ and
# the project itself (--no-deps), both into a private folder (never the Python's own packages, never
# torch; nothing is installed where everything already imports, as in the project's venv). Stages,
# each under its own time bound (and all of them under GPU_ACCEPT_BUDGET_S, 450 s on the device, 115 s
# dry), each in its own process group that is killed when the stage ends, so no omni-serve outlives
# its stage holding GPU memory:
#   device      torch, CUDA, the GPUs (on the device a Python without CUDA stops the check here);
#   install     the missing wheels and the project (benchmarks/gpu_accept.py install);
#   models      the tiny Qwen2 / Qwen3 / Qwen3-MoE and, on the device, `omni-make-model
#               shape-qwen2.5-0.5b` (Qwen2.5-0.5B's geometry, random bf16 weights);
#   parity      the tiny models through the prefill and decode engines on the device against
#               transformers on the same device: float32 greedy exact, bf16 within
#               tests/engine/test_bf16.py's tolerance; layerwise KV over the shared-memory connector
#               equal to the whole export;
#   serve       omni-serve on the tiny Qwen2, one chat through /v1/chat/completions, SIGTERM, nothing left;
#   kv-handoff  benchmarks/kv_transfer.py: prefill → shared memory → decode, whole vs layerwise
#               (device: the 0.5B geometry in bf16, prompts of 512 and 2,048 tokens);
#   decode      benchmarks/decode_profile.py: decode step time by op at batch 1 and 8 × context 512
#               (device: the 0.5B geometry, bf16 and float32; host issue time vs GPU time per step);
#   tp-ep       benchmarks/moe_step.py: TP=2 and TP=2 + EP=2 over NCCL — needs two GPUs, skipped
#               (saying so) with one; the dry run takes the same layouts over gloo.
# Output: everything is teed to $OUT/gpu_accept.log, the summary goes to $OUT/gpu_accept.json (every
# stage's status, time and figures) and its table is printed last. $OUT defaults to a new temporary
# folder. Exit status 0 when every stage passed or was skipped for a stated reason.
# Not here (run by hand where a device has time): the spoken-answer sweeps (benchmarks/audio_ttfp.py,
# benchmarks/speech_batching.py --device cuda), which the earlier gpu_check.sh ran.
set -u -o pipefail

MODE=gpu
case "${1:-}" in
    --dry-run) MODE=dry-run ;;
    "") ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac   # absolute, links kept
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-$(mktemp -d -t omnirelay-gpu-accept-out-XXXXXX)}
mkdir -p "$OUT"
WORK=$(mktemp -d -t omnirelay-gpu-accept-XXXXXX)
if [ "$MODE" = gpu ]; then BUDGET_S=${GPU_ACCEPT_BUDGET_S:-450}; else BUDGET_S=${GPU_ACCEPT_BUDGET_S:-115}; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Stages run from $WORK: a `python -m omnirelay…` (omni-serve's children, the TP ranks) started in the
# repository root would import its bare omnirelay/ folder ahead of the installed package.
cd "$WORK"
STAGES=$WORK/stages.tsv
: >"$STAGES"
: >"$WORK/pgids"   # process groups a stage started apart from its own (omni-serve's)

exec > >(tee "$OUT/gpu_accept.log") 2>&1
TEE_PID=$!
STAGE_PGID=
cleanup() {
    [ -n "$STAGE_PGID" ] && kill -KILL -- "-$STAGE_PGID" 2>/dev/null
    while read -r pgid; do kill -KILL -- "-$pgid" 2>/dev/null; done <"$WORK/pgids"
    [ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK"
    exec 1>&- 2>&-
    wait "$TEE_PID" 2>/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT TERM

record() {   # record NAME STATUS RC SECONDS LIMIT NOTE
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$STAGES"
}

stage() {   # stage NAME LIMIT_S CMD...: run CMD in its own process group under min(LIMIT_S, budget left)
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - SECONDS - 5))
    if [ "$left" -lt 10 ]; then
        echo "=== $name: not run, ${left} s left of the ${BUDGET_S} s budget"
        record "$name" fail 0 0 0 "not run: no time left in the ${BUDGET_S} s budget"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo
    echo "=== $name (at most ${limit} s; $((SECONDS)) s into the run)"
    local start=$SECONDS
    GPU_ACCEPT_STAGE_LIMIT_S=$limit setsid -w timeout --kill-after=5 "$limit" "$@" &
    STAGE_PGID=$!
    wait "$STAGE_PGID"
    local rc=$?
    kill -KILL -- "-$STAGE_PGID" 2>/dev/null   # whatever the stage left in its group
    while read -r pgid; do kill -KILL -- "-$pgid" 2>/dev/null; done <"$WORK/pgids"
    STAGE_PGID=
    local took=$((SECONDS - start)) status=pass note=""
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=fail; note="timed out after ${limit} s"
    elif [ "$rc" != 0 ]; then status=fail; note="exit $rc"; fi
    echo "--- $name: $status in ${took} s${note:+ ($note)}"
    record "$name" "$status" "$rc" "$took" "$limit" "$note"
    [ "$status" = pass ]
}

skip() {   # skip NAME REASON
    echo
    echo "=== $1: skipped: $2"
    record "$1" skip 0 0 0 "$2"
}

json_get() {   # json_get FILE KEY
    "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"
}

STEPS=("$PY" "$REPO/benchmarks/gpu_accept.py")
echo "gpu_accept: $MODE run, python $PY, budget ${BUDGET_S} s, log and summary in $OUT"

# --- device: what this Python runs on
DEVICE_PY='
import json, sys, torch
cuda = torch.cuda.is_available()
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count() if cuda else 0,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
json.dump(info, open(sys.argv[1], "w"))
print(info)
sys.exit(0 if cuda or sys.argv[2] == "dry-run" else 3)'
if ! stage device 60 "$PY" -c "$DEVICE_PY" "$WORK/device.json" "$MODE"; then
    echo "gpu_accept: no CUDA device visible to $PY; --dry-run runs the CPU path" >&2
fi
GPUS=0
[ -s "$WORK/device.json" ] && GPUS=$(json_get "$WORK/device.json" gpus)
if [ "$MODE" = gpu ] && [ "$GPUS" = 0 ]; then
    for s in install models parity serve kv-handoff decode tp-ep; do skip "$s" "no CUDA device"; done
else
    # --- install: what the Python lacks, from the carried wheels; then the project
    if stage install 90 "${STEPS[@]}" install --wheels "$REPO/.gpu-wheels" --site "$WORK/site" --json "$WORK/install.json"; then
        for d in "$WORK/site/deps" "$WORK/site/project"; do
            [ -d "$d" ] && export PYTHONPATH="$d${PYTHONPATH:+:$PYTHONPATH}"
        done
    fi
    if [ "$MODE" = gpu ]; then
        DEVICE=cuda:0
        stage models 120 "${STEPS[@]}" models --shape "$WORK/shape-qwen2.5-0.5b" --json "$WORK/models.json"
    else
        DEVICE=cpu
        stage models 60 "${STEPS[@]}" models --json "$WORK/models.json"
    fi
    if [ ! -s "$WORK/models.json" ]; then
        for s in parity serve kv-handoff decode tp-ep; do skip "$s" "no models (the models stage failed)"; done
    else
        TINY=$(json_get "$WORK/models.json" qwen2)
        # The dry run: every family in float32, bf16 on the MoE one, 3 prompts × 8 tokens (the engine tests
        # hold the CPU to the full check); on the device every family in both dtypes, 6 prompts × 16 / 24 tokens
        SIZE=(--cases qwen2:float32,qwen2:bfloat16,qwen3:float32,qwen3:bfloat16,qwen3-moe:float32,qwen3-moe:bfloat16)
        [ "$MODE" = gpu ] || SIZE=(--cases qwen2:float32,qwen3:float32,qwen3-moe:float32,qwen3-moe:bfloat16
                                   --prompts 3 --tokens 8)
        stage parity 150 "${STEPS[@]}" parity --models "$WORK/models.json" --device "$DEVICE" "${SIZE[@]}" \
            --work "$WORK" --json "$WORK/parity.json"
        stage serve 120 "${STEPS[@]}" serve --model "$TINY" --work "$WORK" --json "$WORK/serve.json" \
            --ready-timeout 100 --pgid-file "$WORK/pgids"
        if [ "$MODE" = gpu ]; then
            SHAPE=$(json_get "$WORK/models.json" shape)
            stage kv-handoff 60 "$PY" "$REPO"/benchmarks/kv_transfer.py --model "$SHAPE" --device "$DEVICE" --dtype bfloat16 \
                --prompt-lens 512 2048 --repeats 3 --backends shared_memory --json "$WORK/kv-handoff.json"
            stage decode 90 "$PY" "$REPO"/benchmarks/decode_profile.py --model "$SHAPE" --device "$DEVICE" --batch 1,8 \
                --context 512 --steps 20 --dtypes bfloat16,float32 --paths fast --json "$WORK/decode.json"
            if [ "$GPUS" -ge 2 ]; then
                stage tp-ep 90 "$PY" "$REPO"/benchmarks/moe_step.py --devices cuda --repeats 3 --check-hf \
                    --json "$WORK/tp-ep.json"
            else
                skip tp-ep "TP=2 and EP=2 need two GPUs; $GPUS visible (NCCL needs a device per rank)"
            fi
        else
            stage kv-handoff 30 "$PY" "$REPO"/benchmarks/kv_transfer.py --model "$TINY" --prompt-lens 64 --repeats 1 \
                --backends shared_memory --json "$WORK/kv-handoff.json"
            stage decode 30 "$PY" "$REPO"/benchmarks/decode_profile.py --model "$TINY" --batch 1,8 --context 64 --steps 5 \
                --dtypes float32 --paths fast --json "$WORK/decode.json"
            stage tp-ep 45 "$PY" "$REPO"/benchmarks/moe_step.py --devices cpu --repeats 1 --prompts 2 --prompt-len 16 \
                --check-hf --json "$WORK/tp-ep.json"
        fi
    fi
fi

if [ "$MODE" = gpu ] && command -v nvidia-smi >/dev/null; then
    echo
    echo "=== GPU memory held after the stages (should be none):"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
fi
"${STEPS[@]}" summary --stages "$STAGES" --work "$WORK" --mode "$MODE" --total-s "$SECONDS" \
    --budget-s "$BUDGET_S" --json "$OUT/gpu_accept.json"
exit $?

#!/usr/bin/env bash
# GPU check of the compact model's parallel paths on CUDA/NCCL, for a lent device machine.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine (needs CUDA; TP/EP need 2 GPUs)
#   bash benchmarks/gpu_check.sh --dry-run  # the same steps on the CPU over gloo (no GPU needed)
#
# Self-contained: builds the tiny models it needs into a private directory (offline), then
#   1. Qwen3-MoE step times and greedy parity: 1 rank vs TP=2 vs TP=2 + EP=2 (benchmarks/moe_step.py;
#      rank i on cuda:i, NCCL between ranks), one rank also against transformers;
#   2. the same for the dense tiny Qwen2 and tiny Qwen3 on one rank against transformers;
#   3. the layerwise KV export on the device: tests/engine/test_layerwise_kv.py (its CUDA cases run where
#      CUDA is present) and the Qwen3 engine parity test;
#   4. (GPU only) the spoken-answer sweep: audio TTFP/RTF, streamed vs sequential stage hand-off.
# Prints parity and step times; exits non-zero on any parity failure. Every step has a time bound
# (STEP_TIMEOUT_S, default 240 s) and the whole run stays under ~9 minutes on an H200.
set -u -o pipefail

DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-240}
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python}
[ -x "$REPO/.venv/bin/python" ] && PY="$REPO/.venv/bin/python"
WORK=$(mktemp -d -t omnirelay-gpu-check-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
export OMNIRELAY_CACHE_DIR="$WORK/cache" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

if [ "$DRY_RUN" = 1 ]; then
    DEVICES=cpu
    echo "gpu_check: dry run on the CPU (gloo); the GPU run uses --devices cuda"
else
    DEVICES=cuda
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: CUDA is not available here; run with --dry-run for the CPU path" >&2
        exit 2
    fi
    "$PY" -c "import torch; print('gpu_check: torch', torch.__version__, 'CUDA', torch.version.cuda, '|',
        torch.cuda.device_count(), 'GPU(s):', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
fi

FAILED=()
step() {   # step NAME CMD...: run with a time bound, record a failure
    local name=$1; shift
    echo
    echo "=== $name"
    local start=$SECONDS
    timeout --kill-after=10 "$STEP_TIMEOUT_S" "$@"
    local rc=$?
    echo "--- $name: exit $rc in $((SECONDS - start)) s"
    [ "$rc" = 0 ] || FAILED+=("$name (exit $rc)")
}

step "build tiny models" "$PY" -c "
from omnirelay.deploy.builders.qwen3 import cached_qwen3
from omnirelay.deploy.builders.llm import default_model_dir
print(default_model_dir()); print(cached_qwen3(moe=False)); print(cached_qwen3(moe=True))"

step "Qwen3-MoE: 1 rank vs TP=2 vs TP=2 EP=2 ($DEVICES), parity + step times" \
    "$PY" benchmarks/moe_step.py --devices "$DEVICES" --repeats 5 --check-hf --json "$WORK/moe_step.json"

for kind in qwen2 qwen3; do
    step "$kind dense: one rank on $DEVICES against transformers" "$PY" - "$kind" "$DEVICES" <<'EOF'
import sys, time, torch
from transformers import AutoModelForCausalLM
from omnirelay.deploy.builders.llm import default_model_dir
from omnirelay.deploy.builders.qwen3 import cached_qwen3
from omnirelay.workers.llm.models.llama import LlamaModel
kind, device = sys.argv[1], ("cuda:0" if sys.argv[2] == "cuda" else "cpu")
path = str(default_model_dir() if kind == "qwen2" else cached_qwen3(moe=False))
ours = LlamaModel(path, device=device)
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ids = torch.randint(3, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ref = hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[:, 32:].tolist()
ok = True
for row in range(4):
    seq, got = ids[row].tolist(), []
    start = time.perf_counter()
    for _ in range(8):
        logits, _ = ours.prefill(seq)
        got.append(int(logits.argmax())); seq.append(got[-1])
    ms = (time.perf_counter() - start) * 1000 / 8
    print(f"{kind} prompt {row}: parity {'ok' if got == ref[row] else 'MISMATCH'} ({ms:.1f} ms per cache-free step)")
    ok &= got == ref[row]
sys.exit(0 if ok else 1)
EOF
done

for kind in qwen3 qwen3-moe; do
    step "$kind: layerwise KV export on $DEVICES equals the whole export, decode equals transformers" \
        "$PY" - "$kind" "$DEVICES" "$WORK/shm-$kind" <<'EOF'
import os, sys, time, torch
sys.path.insert(0, "tests")
from transformers import AutoModelForCausalLM, AutoTokenizer
from omnirelay.connectors import create_connector
from omnirelay.deploy.builders.qwen3 import cached_qwen3
from omnirelay.workers.llm.decode import DecodeEngine
from omnirelay.workers.kv.export import import_kv
from omnirelay.workers.llm.model_runner import local_runner
from omnirelay.workers.llm.models.llama import LlamaModel
from omnirelay.workers.llm.prefill import PrefillEngine
from engine_support import NEW_TOKENS, QUESTIONS, chat_ids, run_decode, run_prefill
kind, device, shm = sys.argv[1], ("cuda:0" if sys.argv[2] == "cuda" else "cpu"), sys.argv[3]
path = str(cached_qwen3(moe=kind == "qwen3-moe"))
os.makedirs(shm)
conn = create_connector("shared_memory", {"shm_dir": shm})
tok = AutoTokenizer.from_pretrained(path)
prompts = [chat_ids(tok, q) for q in QUESTIONS]
model = LlamaModel(path, device=device)
def prefill(mode):
    runner = local_runner(model, block_size=16, budget_bytes=64 << 20)
    engine = PrefillEngine(runner, conn, max_model_len=2048, max_batched_tokens=64, kv_transfer=mode)
    start = time.perf_counter()
    out = run_prefill(engine, prompts)
    return out, engine, (time.perf_counter() - start) * 1000
whole, _, whole_ms = prefill("whole")
kv_whole = {k: import_kv(conn, r.outputs["kv_key"], r.outputs["kv_handle"], timeout=10) for k, r in whole.items()}
layer, engine, layer_ms = prefill("layerwise")
assert engine.stats["kv_layerwise_handoffs"] == len(prompts), engine.stats
ok = all(layer[k].token == whole[k].token for k in layer)
decode = DecodeEngine(local_runner(model, block_size=16, budget_bytes=64 << 20), conn, max_num_seqs=16,
                      max_model_len=2048, transfer_timeout_s=10)
outputs = run_decode(decode, prompts, layer)
again, _, _ = prefill("layerwise")   # a fresh pool (no prefix hit): the same steps as the whole run
same_kv = all(torch.equal(import_kv(conn, r.outputs["kv_key"], r.outputs["kv_handle"], timeout=10), kv_whole[k])
              for k, r in again.items())
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
parity = []
for i, ids in enumerate(prompts):
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids], device=device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False)[0, len(ids):].tolist()
    parity.append(outputs[f"r{i}"] == ref)
conn.close()
print(f"{kind} on {device}: layerwise first tokens {'ok' if ok else 'MISMATCH'}, KV layerwise == whole "
      f"{'ok' if same_kv else 'MISMATCH'}, decode parity with transformers {sum(parity)}/{len(parity)}; "
      f"prefill of {len(prompts)} prompts: whole {whole_ms:.0f} ms, layerwise {layer_ms:.0f} ms")
sys.exit(0 if ok and same_kv and all(parity) else 1)
EOF
done

if [ "$DRY_RUN" = 0 ]; then
    # Spoken answers, streamed vs sequential hand-off (issue #25): audio TTFP and RTF at answer lengths
    # 16/64/256 x concurrency 1/8 on the tiny Qwen3-Omni, the talker's codes capped to bound the time.
    step "build tiny Qwen3-Omni" "$PY" -c "import sys; from omnirelay.deploy.builders.llm import main; sys.exit(main(['tiny-qwen3-omni', '$WORK/tiny-qwen3-omni']))"
    STEP_TIMEOUT_S=420 step "audio TTFP sweep (benchmarks/audio_ttfp.py)" "$PY" benchmarks/audio_ttfp.py \
        --model qwen3-omni="$WORK/tiny-qwen3-omni" --lengths 16,64,256 --concurrency 1,8 --max-audio-tokens 300
    # The batched talker in process: 8 requests alone vs held together, each family (bitwise as alone?).
    step "batched talker (benchmarks/speech_batching.py)" "$PY" benchmarks/speech_batching.py \
        --models "$WORK" --device cuda --requests 8 --codes 200
    step "tests/engine/test_devices.py CUDA case (Qwen2 placement, TP=2 over NCCL when 2 GPUs)" \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/engine/test_devices.py -k cuda_placement
fi

echo
if [ -f "$WORK/moe_step.json" ]; then
    echo "moe_step result:"; cat "$WORK/moe_step.json"
fi
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${FAILED[*]}"
    exit 1
fi
echo "gpu_check: all checks passed ($DEVICES)"

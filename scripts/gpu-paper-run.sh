#!/usr/bin/env bash
# The paper's experiment on one GPU, in absolute time: 4 nodes sharing one GPU, the Qwen2.5-0.5B
# architecture (random weights, bf16), MMLU 5-shot with a BPE tokenizer trained on MMLU itself
# (realistic prompt lengths), the paper's one-request-at-a-time schedule, policies none / paper
# / cost at Δcomm 2 ms and 200 ms (uniform) and 2 ms (skewed), interleaved.
#
#   scripts/gpu-paper-run.sh [OUT]          # default OUT=runs/gpu-paper
#
# Needs: Python with PyTorch (CUDA build) and this project's dependencies importable. On a
# machine that cannot download, `make gpu-bundle MMLU=DIR` (on a machine that can) puts the
# missing wheels and a copy of MMLU into .gpu-bundle/ (git-ignored); this script installs the
# wheels into /tmp/radixmesh-site when the HTTP stack is missing, and runs from the source tree
# without installing the project.
#
# Environment (defaults): DEVICE=cuda DTYPE=bfloat16 PRESET=qwen2.5-0.5b VOCAB=32000
# REQUESTS=500 MMLU=.gpu-bundle/mmlu MODEL_DIR=/tmp/radixmesh-gpu-model PYTHON=python3
# MEM_FRACTION=0.07 (each of the 12 node processes that run at once: 3 policies x 4 nodes).
# A CPU dry run: DEVICE=cpu DTYPE=float32 PRESET=tiny VOCAB=8000 REQUESTS=8 MEM_FRACTION=0
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu-paper}}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PRESET=${PRESET:-qwen2.5-0.5b}
VOCAB=${VOCAB:-32000}
REQUESTS=${REQUESTS:-500}
MMLU=${MMLU:-.gpu-bundle/mmlu}
MODEL_DIR=${MODEL_DIR:-/tmp/radixmesh-gpu-model}
MEM_FRACTION=${MEM_FRACTION:-0.07}
PY=${PYTHON:-python3}

if ! "$PY" -c "import fastapi, uvicorn, zmq, pydantic" 2>/dev/null; then
  if [ -d .gpu-bundle/whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/radixmesh-site .gpu-bundle/whl/*.whl
    export PYTHONPATH=/tmp/radixmesh-site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "error: the HTTP stack (fastapi, uvicorn, pyzmq) is missing and there is no" \
      ".gpu-bundle/whl (make gpu-bundle)" >&2
    exit 2
  fi
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - start )) s] $*"; }

stamp "environment"
"$PY" - "$DEVICE" >"$OUT/env.json" <<'PYEOF'
import json, platform, sys, datetime
import torch, transformers
dev = sys.argv[1]
info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "device": dev}
if dev.startswith("cuda"):
    info["gpu"] = torch.cuda.get_device_name(0)
    info["cuda"] = torch.version.cuda
print(json.dumps(info, indent=2))
PYEOF
cat "$OUT/env.json"

stamp "model directory ($PRESET, BPE vocab $VOCAB trained on MMLU)"
"$PY" -m radixmesh.bench.modeldir --mmlu-dir "$MMLU" --preset "$PRESET" --vocab-size "$VOCAB" \
  --out "$MODEL_DIR" | tee "$OUT/model.json"

stamp "engine micro-benchmark"
RADIXMESH_MMLU="$MMLU" RADIXMESH_BENCH_MODEL="$MODEL_DIR" RADIXMESH_BENCH_DEVICE="$DEVICE" \
  RADIXMESH_BENCH_DTYPE="$DTYPE" "$PY" -m radixmesh microbench --only engine --json \
  | tee "$OUT/microbench.json"

common=(--out "$OUT/bench" --mmlu-dir "$MMLU" --model "$MODEL_DIR" --device "$DEVICE"
        --dtype "$DTYPE" --gpu-memory-fraction "$MEM_FRACTION" --policy none,paper,cost
        --requests "$REQUESTS" --interleave --no-progress)
stamp "bench: uniform, Δcomm 2 ms and 200 ms"
"$PY" -m radixmesh bench "${common[@]}" --skew uniform --net-delay 2ms,200ms
stamp "bench: skewed, Δcomm 2 ms"
"$PY" -m radixmesh bench "${common[@]}" --skew skewed --net-delay 2ms --resume

cp "$OUT/bench/summary.json" "$OUT/bench/report.md" "$OUT/" 2>/dev/null || true
stamp "done: $OUT (summary.json, report.md, figures under $OUT/bench)"

#!/usr/bin/env bash
# The GPU path's first proof: one command on a machine with one NVIDIA GPU, under 8 minutes.
#
#   bench/gpu.sh                 check the GPU (models from build/gpu-models; exported first
#                                when missing and torch is installed)
#   bench/gpu.sh --export-only   only export the models (on any machine with torch), to bring
#                                them to a GPU machine that has no torch
#   bench/gpu.sh --dry-run       the same checks on CPU with small models and short runs, GPU
#                                parts skipped (CI runs this, so the script cannot rot)
#
# It downloads nothing: it uses the Python in $PYTHON, else .venv/bin/python, else python3,
# which must have onnxruntime-gpu 1.31.1 with its CUDA 13 / cuDNN 9 / cuBLAS wheels
# (constraints-gpu.txt), numpy, onnx and the server's packages (bench/gpu_preflight.py checks
# them first, in seconds); wheels it lacks can be carried in build/gpu-bundle
# (bench/gpu_bundle.sh). It prints what it found.
# It never falls back to CPU: no driver >= 580, no CUDA provider, or any session placed on
# CPU fails it with the reason. After the server's load it scrapes /metrics: the GPU's NVML
# series (utilization, memory used and total, power) must be there, and every process's CPU
# and memory series. Results: stdout, and $OUT/gpu-check.json when $OUT is set
# (else build/gpu-check.json).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
MODE=${1:-check}
case "$MODE" in
    check | --export-only) MODELS=${GPU_MODELS:-build/gpu-models} D=512 H=8
        ARGS=(--max-batch-size 32 --max-seq-len 512 --inflight-calls 40) ;;
    --dry-run) MODELS=${GPU_MODELS:-build/gpu-models-dry} D=32 H=4
        ARGS=(--dry-run --max-batch-size 4 --max-seq-len 64 --inflight-calls 8) ;;
    *) echo "usage: bench/gpu.sh [--dry-run | --export-only]" >&2; exit 2 ;;
esac
RESULT=${OUT:-build}/gpu-check.json
mkdir -p "$(dirname "$RESULT")"

echo "== python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
if [[ "$MODE" != --dry-run ]] && command -v nvidia-smi >/dev/null; then
    echo "== nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
fi

# Wheels carried to a machine whose Python lacks them (bench/gpu_bundle.sh makes the folder;
# a wheel over the carry limit comes in NAME.whl.part-NN pieces): installed beside, not into,
# that Python.
BUNDLE=${GPU_BUNDLE:-build/gpu-bundle}
if [[ "$MODE" == check ]] &&
    { compgen -G "$BUNDLE/*.whl*" >/dev/null || compgen -G "$BUNDLE/small/*.whl" >/dev/null; }; then
    SITE=${GPU_SITE:-/tmp/gpu-site} WHEELS=$(mktemp -d)
    for part in "$BUNDLE"/*.whl.part-00; do
        [[ -e "$part" ]] && cat "${part%.part-00}".part-* >"$WHEELS/$(basename "${part%.part-00}")"
    done
    cp "$BUNDLE"/*.whl "$BUNDLE"/small/*.whl "$WHEELS"/ 2>/dev/null || true
    echo "== installing carried wheels into $SITE: $(cd "$WHEELS" && ls | tr '\n' ' ')"
    started=$SECONDS
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "== installed in $((SECONDS - started)) s"
fi
if [[ "$MODE" == check && -x "$BUNDLE/small/attention-gateway" ]]; then
    export ATTENTION_GRPC_GATEWAY_BINARY=$(cd "$BUNDLE/small" && pwd)/attention-gateway
    echo "== gRPC gateway: $ATTENTION_GRPC_GATEWAY_BINARY"
fi
if [[ "$MODE" == check ]]; then
    # Seconds, before any export or measurement: onnxruntime-gpu, the driver, the imports.
    "$PY" -m bench.gpu_preflight || exit 1
    LIBS=$("$PY" -m bench.gpu_preflight --nvidia-lib-dirs)
    echo "== NVIDIA wheel libraries: ${LIBS:-none found}"
    export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

if [[ ! -f "$MODELS/mha/1/model.fused.onnx" || ! -f "$MODELS/mha16/1/model.fused.onnx" ]]; then
    if ! "$PY" -c "import torch" 2>/dev/null; then
        echo "GPU CHECK FAILED: no models in $MODELS and no torch here to export them; run" \
            "bench/gpu.sh --export-only where torch is, and bring $MODELS" >&2
        exit 2
    fi
    timeout 300 "$PY" -m export --name mha --embed-dim "$D" --num-heads "$H" --out "$MODELS" \
        --version 1 --force
    timeout 300 "$PY" -m export --name mha16 --embed-dim "$D" --num-heads "$H" --dtype float16 \
        --out "$MODELS" --version 1 --force
fi
[[ "$MODE" == --export-only ]] && exit 0

# 450 s for the check itself: with the exports above and start-up, under 8 minutes.
exec timeout 450 "$PY" -m bench.gpu_check --models "$MODELS" "${ARGS[@]}" --json "$RESULT"

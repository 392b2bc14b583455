#!/usr/bin/env bash
# What bench/gpu.sh needs on a GPU machine whose Python lacks it, prepared here (this project's
# device machine has Python 3.12 with torch 2.11 and a CPU-only onnxruntime 1.30, the NVIDIA
# CUDA 13 wheels, and no package index; each call carries at most 64 MiB):
#   - the models, exported here (build/gpu-models, ~20 MiB);
#   - cp3XX wheels of onnxruntime-gpu and the gRPC packages, pinned by constraints*.txt, in
#     build/gpu-bundle; a wheel over GPU_PART_MIB (default 56) is split into NAME.whl.part-NN.
# bench/gpu.sh reassembles and installs them with --target, beside that Python's own packages.
#
#   bench/gpu_bundle.sh [PYTHON_VERSION]     (default 3.12; needs pip and the package index)
#
# It prints the carry list of each device call: the pieces first, one call each, back to back
# (ignored files stay on a machine while it is held; it is given back ~30 s after a call), and
# the last call runs the check.
set -euo pipefail
cd "$(dirname "$0")/.."

PYV=${1:-3.12}
BUNDLE=${GPU_BUNDLE:-build/gpu-bundle}
PART_MIB=${GPU_PART_MIB:-56}
PY=${PYTHON:-.venv/bin/python}
MODELS=${GPU_MODELS:-build/gpu-models}

[[ -f "$MODELS/mha16/1/model.fused.onnx" ]] || bash bench/gpu.sh --export-only
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -c constraints.txt -c constraints-gpu.txt -d "$BUNDLE" \
    onnxruntime-gpu grpcio grpcio-health-checking grpcio-reflection protobuf prometheus-client nvidia-ml-py
for wheel in "$BUNDLE"/*.whl; do
    if (($(stat -c %s "$wheel") > PART_MIB * 1048576)); then
        split -b "${PART_MIB}M" -d -a 2 "$wheel" "$wheel.part-"
        rm "$wheel"
    fi
done

# The wheels that need no splitting and the gateway travel as one folder (a device call
# carries at most 8 paths).
mkdir -p "$BUNDLE/small"
mv "$BUNDLE"/*.whl "$BUNDLE/small/"

# The gRPC gateway (Go, static), so the check serves through it as a default install does.
GO=$(cd "$(dirname "$PY")" && pwd)/go
if [[ -x "$GO" ]]; then
    out=$(cd "$BUNDLE/small" && pwd)/attention-gateway
    (cd service/gateway && CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local GOPROXY=off \
        GOARCH=amd64 "$GO" build -trimpath -ldflags='-s -w' -o "$out" .)
else
    echo "no Go toolchain beside $PY (make setup installs it): the check will run without" \
        "the gateway, Python serving the gRPC port" >&2
fi

# The last piece travels with the models, the small wheels and the gateway (under 60 MiB).
parts=("$BUNDLE"/*.part-*)
last=${parts[-1]}
echo "device calls, back to back (sizes below; each call's carry under 64 MiB with the"
echo "~2 MiB working tree):"
call=0
for part in "${parts[@]::${#parts[@]}-1}"; do
    call=$((call + 1))
    echo "  $call: carry [\"$part\"]  command: ls -l $BUNDLE"
done
echo "  $((call + 1)): carry [\"$MODELS\", \"$BUNDLE/small\", \"$last\"]  command:" \
    "PYTHONUNBUFFERED=1 bash bench/gpu.sh  (timeout_s 540)"
du -sh "$MODELS" "$BUNDLE"/* "$BUNDLE"/small/* | sed 's/^/    /'

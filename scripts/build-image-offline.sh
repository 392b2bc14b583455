#!/usr/bin/env bash
# Builds the serving image from the repository's Dockerfile with no network inside the build:
# a Debian bookworm base made from Debian's packages (mmdebstrap, once per machine) and every
# Python package from ./wheelhouse (pip download, on the host). docs/deployment.md: "Building offline".
#
#   scripts/build-image-offline.sh            # podman; IMAGE=attention-serving:offline
#   ENGINE=docker scripts/build-image-offline.sh
#
# Environment (defaults): ENGINE (podman), IMAGE (attention-serving:offline),
# BASE_IMAGE (localhost/attention-base:bookworm), ONNXRUNTIME (onnxruntime-gpu==1.31.1: runs on
# the CPU and without the 3 GB of NVIDIA wheels; "onnxruntime-gpu[cuda,cudnn]==1.31.1" for GPU
# nodes), PIP (.venv/bin/python -m pip when there is one), SKIP_WHEELHOUSE=1 (use the wheels
# already there, e.g. copied in from a connected machine), TORCH_INDEX (PyTorch's CPU index, as
# scripts/torch_index.py names it; used only when it answers within a few seconds; empty = none).
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${ENGINE:-podman}
IMAGE=${IMAGE:-attention-serving:offline}
BASE_IMAGE=${BASE_IMAGE:-localhost/attention-base:bookworm}
ONNXRUNTIME=${ONNXRUNTIME:-onnxruntime-gpu==1.31.1}
if [[ -z "${PIP:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PIP=".venv/bin/python -m pip"; else PIP="python3 -m pip"; fi
fi
# Rootless-friendly limits: podman here may lower limits but not raise them.
ENGINE_FLAGS=()
if [[ "$ENGINE" == podman ]]; then
    ENGINE_FLAGS=(--runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --format docker)
fi

# 1. Wheels for both stages: the serving dependencies (pyproject.toml: base + server extra) and the export
#    stage's torch/onnx, pinned by constraints.txt. Wheels must match the base's CPython (3.11
#    on bookworm) and architecture; pip's cache makes a second run quick.
if [[ "${SKIP_WHEELHOUSE:-0}" != 1 ]]; then
    # torch's CPU build (~190 MB) is on PyTorch's CPU index; PyPI's torch is the CUDA build
    # (several GB with NVIDIA's wheels). The index is added when it answers within a few
    # seconds; otherwise one line says so and pip takes torch from its indexes and find-links.
    torch_index=$(python3 scripts/torch_index.py)
    torch_index_args=()
    if [[ -n "$torch_index" ]]; then torch_index_args=(--extra-index-url "$torch_index"); fi
    # The base dependencies (the client's), the server extra and the gateway's Go toolchain,
    # as the Dockerfile installs them.
    mapfile -t serving < <(python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["server"] + p["optional-dependencies"]["gateway"]))')
    read -ra onnxruntime_reqs <<< "$ONNXRUNTIME"  # space-separated, as the Dockerfile's ARG
    # shellcheck disable=SC2086
    $PIP download --quiet --dest wheelhouse "${torch_index_args[@]}" --constraint constraints.txt \
        --constraint constraints-gpu.txt "${serving[@]}" "${onnxruntime_reqs[@]}" \
        torch onnx onnxscript "setuptools>=68"
fi

# 2. The base: Debian's python3 from Debian's packages, made once and kept in the image store.
if ! "$ENGINE" image exists "$BASE_IMAGE" 2>/dev/null \
    && ! "$ENGINE" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    tarball=$(mktemp --suffix=.tar)
    trap 'rm -f "$tarball"' EXIT
    mmdebstrap --quiet --variant=apt --include=python3,python3-venv \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' bookworm "$tarball"
    "$ENGINE" import "$tarball" "$BASE_IMAGE" >/dev/null
fi

# 3. The image, from the same Dockerfile as everyone else's, with the offline arguments.
"$ENGINE" build "${ENGINE_FLAGS[@]}" --target serve --tag "$IMAGE" \
    --build-arg PYTHON_IMAGE="$BASE_IMAGE" \
    --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheelhouse --build-arg TORCH_INDEX= \
    --build-arg ONNXRUNTIME="$ONNXRUNTIME" .

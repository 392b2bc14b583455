# syntax=docker/dockerfile:1
# Serving image: GPU-capable (onnxruntime-gpu with CUDA 13 / cuDNN 9 from NVIDIA's wheels),
# runs on CPU when no GPU is visible. torch exists only in the export stage.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- export: build and verify the default model ---------------------------------------
FROM ${PYTHON_IMAGE} AS export
WORKDIR /src
COPY constraints.txt ./
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
 && pip install --no-cache-dir -c constraints.txt onnx onnxscript onnxruntime-gpu numpy
COPY export ./export
ARG MODEL_NAME=mha
ARG EMBED_DIM=512
ARG NUM_HEADS=8
RUN python -m export --name "${MODEL_NAME}" --embed-dim "${EMBED_DIM}" --num-heads "${NUM_HEADS}" --out /models

# --- serve: no torch ---------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS serve
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ATTENTION_HOST=0.0.0.0 \
    ATTENTION_GRPC_PORT=8001 \
    ATTENTION_METRICS_PORT=8002 \
    ATTENTION_MODEL_REPOSITORY=/models
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY service ./service
RUN pip install --no-cache-dir -c constraints.txt "onnxruntime-gpu[cuda,cudnn]==1.31.1" . \
 && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin attention
COPY --from=export --chown=10001:10001 /models /models
USER 10001
EXPOSE 8001 8002
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "service.healthcheck", "--target", "127.0.0.1:8001"]
ENTRYPOINT ["python", "-m", "service"]

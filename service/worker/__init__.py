"""The ONNX Runtime worker: model registry, batcher, sessions and model control."""

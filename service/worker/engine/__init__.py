"""ONNX Runtime models: loading, verification, batch caps, the registry of versions."""

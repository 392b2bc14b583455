"""Build the multi-head self-attention module and export it to an ONNX model repository."""

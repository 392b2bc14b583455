"""gRPC serving of the exported attention model (no torch on this side)."""

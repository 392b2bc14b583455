"""The process: server assembly, lifecycle, metrics, memory and gRPC options."""

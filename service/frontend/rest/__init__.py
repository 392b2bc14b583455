"""The HTTP/REST front end: KServe V2 REST on the same V2Plane as gRPC."""

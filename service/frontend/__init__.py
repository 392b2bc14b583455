"""The front end: gRPC servicers, validation and admission; per-request protocol work."""

"""The gRPC surface: servicers, wire codecs, validation and admission into the batcher."""

"""Metrics (and later tracing): leaves that every layer may import."""

"""Process memory: glibc malloc settings and the queued-bytes budget."""

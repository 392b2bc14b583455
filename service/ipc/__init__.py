"""What a front end and the worker share between processes: the shared-memory slab that holds
tensors, and the small control messages that name parts of it."""

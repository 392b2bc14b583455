"""Dynamic batching: queues, batch choice, deadlines, statistics."""

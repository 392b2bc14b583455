"""Peer servers measured side by side with ours (python -m bench --peers)."""

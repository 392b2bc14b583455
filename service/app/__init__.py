"""The top of the stack: process assembly, lifecycle and the supervisor."""

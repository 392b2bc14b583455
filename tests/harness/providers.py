"""The execution provider a test server really runs on here: CUDA on a machine with a usable
GPU and onnxruntime-gpu, else CPU. Tests assert this, never a hard-coded CPU."""

from __future__ import annotations

import functools

from service.worker.engine.cuda import choose_providers


@functools.cache
def serving_provider(preference: str = "auto") -> str:
    """What `python -m service --provider PREFERENCE` puts the models on, on this machine."""
    return choose_providers(preference)[0]

"""The worker's registry holds its ONNX Runtime models (the lookup itself is shared)."""

from __future__ import annotations

from service.catalog import SERVER_LABEL, ModelRegistry

__all__ = ["SERVER_LABEL", "ModelRegistry"]

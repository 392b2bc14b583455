"""An MLServer runtime for the attention graph: one ONNX Runtime session, the same options as
our server's engine. Runs inside MLServer's own virtualenv (bench/peers/mlserver.py)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OrtAttention(MLModel):
    async def load(self) -> bool:
        extra = (self.settings.parameters.extra or {}) if self.settings.parameters else {}
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(extra.get("intra_op_threads", 0))
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        self._session = ort.InferenceSession(
            self.settings.parameters.uri, options, providers=["CPUExecutionProvider"]
        )
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        # Adaptive batching has already concatenated the requests along the first axis.
        embeddings = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32, copy=False)
        mask = np.zeros(embeddings.shape[:2], dtype=bool)
        (output,) = self._session.run(
            ["output"], {"embeddings": embeddings, "key_padding_mask": mask}
        )
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[NumpyCodec.encode_output(name="output", payload=output)],
        )

"""The echo floor's model: the graph contract of the real one with no compute, built with the
onnx helper API into a model repository, so the real server (supervisor, front ends, IPC,
batcher) serves it and floor and server differ only by the model.

    output            = Identity(embeddings)                     [b, s, d]
    attention_weights = zeros [b, h, s, s] (in model.with_weights.onnx only)

The metadata is what the server reads (service/worker/engine/onnx_model.py `_read_spec`). No
golden.npz: the server serves it unverified and logs a warning saying so."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from service.worker.engine.repository import OUTPUT_GRAPH, WEIGHTS_GRAPH

OPSET = 17
IR_VERSION = 8  # read by every ONNX Runtime the project supports
SOURCE = "bench echo model: output = embeddings, attention weights = zeros (no compute)"


def metadata(name: str, embed_dim: int, num_heads: int, graph: str) -> dict[str, str]:
    return {
        "model_name": name,
        "embed_dim": str(embed_dim),
        "num_heads": str(num_heads),
        "causal": "false",
        "bias": "false",
        "dtype": "float32",
        "weights_sha256": "",
        "weights_source": SOURCE,
        "opset": str(OPSET),
        "graph": graph,
    }


def echo_graph(name: str, embed_dim: int, num_heads: int, *, with_weights: bool) -> onnx.ModelProto:
    """One graph of the contract: inputs embeddings [b, s, d] float32 and key_padding_mask
    [b, s] bool; output = embeddings, and zero attention weights [b, h, s, s] if asked."""
    inputs = [
        helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", "seq", embed_dim]),
        helper.make_tensor_value_info("key_padding_mask", TensorProto.BOOL, ["batch", "seq"]),
    ]
    outputs = [
        helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "seq", embed_dim])
    ]
    nodes = [helper.make_node("Identity", ["embeddings"], ["output"])]
    initializers = []
    if with_weights:
        outputs.append(
            helper.make_tensor_value_info(
                "attention_weights", TensorProto.FLOAT, ["batch", num_heads, "seq", "seq"]
            )
        )
        # The mask's shape is [b, s]: the weights' shape is [b, h, s, s] from its pieces.
        initializers = [
            helper.make_tensor("index_b", TensorProto.INT64, [1], [0]),
            helper.make_tensor("index_s", TensorProto.INT64, [1], [1]),
            helper.make_tensor("heads", TensorProto.INT64, [1], [num_heads]),
        ]
        nodes += [
            helper.make_node("Shape", ["key_padding_mask"], ["mask_shape"]),
            helper.make_node("Gather", ["mask_shape", "index_b"], ["b"], axis=0),
            helper.make_node("Gather", ["mask_shape", "index_s"], ["s"], axis=0),
            helper.make_node("Concat", ["b", "heads", "s", "s"], ["weights_shape"], axis=0),
            helper.make_node(
                "ConstantOfShape",
                ["weights_shape"],
                ["attention_weights"],
                value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]),
            ),
        ]
    kind = "output+attention_weights" if with_weights else "output"
    graph = helper.make_graph(nodes, f"echo_{kind}", inputs, outputs, initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="bench.echo_model",
        ir_version=IR_VERSION,
    )
    for key, value in sorted(metadata(name, embed_dim, num_heads, kind).items()):
        model.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(model, full_check=True)
    return model


def write_repository(
    repository: Path, name: str, embed_dim: int, num_heads: int, version: int = 1
) -> Path:
    """<repository>/<name>/<version>/ with both graphs, published by an atomic rename as the
    exporter does; returns the version folder."""
    final = repository / name / str(version)
    staging = repository / name / f".staging-{version}"
    staging.mkdir(parents=True, exist_ok=True)
    for file, with_weights in ((OUTPUT_GRAPH, False), (WEIGHTS_GRAPH, True)):
        graph = echo_graph(name, embed_dim, num_heads, with_weights=with_weights)
        onnx.save(graph, str(staging / file))
    staging.rename(final)
    return final

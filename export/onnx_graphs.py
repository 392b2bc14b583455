"""Export the layer to the two ONNX graphs of the contract and stamp their metadata."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from export.model import FusedOutputOnly, MultiHeadSelfAttention, OutputOnly, WithWeights

OPSET = 18
# ONNX's own Attention op (what scaled_dot_product_attention exports to) arrived in opset 23.
FUSED_OPSET = 23
INPUT_NAMES = ["embeddings", "key_padding_mask"]
OUTPUT_FILE = "model.onnx"
WITH_WEIGHTS_FILE = "model.with_weights.onnx"
FUSED_FILE = "model.fused.onnx"  # service/worker/engine reads the same name


@dataclass(frozen=True)
class GraphFiles:
    """The graphs of one model version; the fused output-only graph is optional."""

    output_only: Path
    with_weights: Path
    fused: Path | None = None


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """The torch.export-based exporter is chatty (progress lines, warnings about optional
    packages); keep the CLI's output to what it wrote and how well it matched."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _export_one(
    module: torch.nn.Module,
    path: Path,
    output_names: list[str],
    embed_dim: int,
    opset: int = OPSET,
) -> None:
    dtype = next(module.parameters()).dtype
    example = (torch.randn(2, 3, embed_dim, dtype=dtype), torch.zeros(2, 3, dtype=torch.bool))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    with quiet_exporter():
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=INPUT_NAMES,
            output_names=output_names,
            dynamic_shapes={
                "embeddings": {0: batch, 1: seq},
                "key_padding_mask": {0: batch, 1: seq},
            },
            opset_version=opset,
            dynamo=True,
            external_data=False,
            optimize=True,
            verbose=False,
        )


def _stamp(path: Path, metadata: dict[str, str], graph_kind: str) -> None:
    """Write metadata properties, then prove the file is a valid model."""
    model = onnx.load(str(path))
    del model.metadata_props[:]
    for key, value in sorted({**metadata, "graph": graph_kind}.items()):
        model.metadata_props.add(key=key, value=value)
    model.producer_name = "attention-serving-export"
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))


def export_graphs(
    attention: MultiHeadSelfAttention,
    folder: Path,
    metadata: dict[str, str],
    *,
    fused: bool = True,
) -> GraphFiles:
    """Write the graphs into folder; the output-only ones never compute an extra output."""
    files = GraphFiles(
        folder / OUTPUT_FILE, folder / WITH_WEIGHTS_FILE, folder / FUSED_FILE if fused else None
    )
    _export_one(OutputOnly(attention), files.output_only, ["output"], attention.embed_dim)
    _export_one(
        WithWeights(attention),
        files.with_weights,
        ["output", "attention_weights"],
        attention.embed_dim,
    )
    _stamp(files.output_only, metadata, "output")
    _stamp(files.with_weights, metadata, "output+attention_weights")
    if files.fused is not None:
        _export_one(
            FusedOutputOnly(attention), files.fused, ["output"], attention.embed_dim, FUSED_OPSET
        )
        _stamp(files.fused, {**metadata, "opset": str(FUSED_OPSET)}, "output(fused)")
    return files

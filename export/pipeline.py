"""One export: build the layer, write both graphs, verify them, publish the version."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import torch

from export.onnx_graphs import OPSET, OUTPUT_FILE, WITH_WEIGHTS_FILE, GraphFiles, export_graphs
from export.repository import next_version, write_version
from export.verify import ParityReport, reference_layer, verify_graphs
from export.weights import build_module, weights_sha256


@dataclass(frozen=True)
class ExportRequest:
    """What to export and where; mirrors the CLI flags."""

    name: str = "mha"
    embed_dim: int = 512
    num_heads: int = 8
    bias: bool = True
    causal: bool = False
    state_dict: Path | None = None
    seed: int = 0
    version: int | None = None
    out: Path = Path("models")
    force: bool = False
    dtype: str = "float32"
    tolerance: float | None = None  # None: DEFAULT_TOLERANCE[dtype]


DTYPES = {"float32": torch.float32, "float16": torch.float16}
# float16 keeps ~3 significant digits; the bound is on outputs of order 1.
DEFAULT_TOLERANCE = {"float32": 1e-5, "float16": 1e-2}


@dataclass(frozen=True)
class ExportResult:
    """What was written and how well it matched the reference."""

    folder: Path
    files: GraphFiles
    weights_sha256: str
    parity: ParityReport


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_metadata(request: ExportRequest, weights_hash: str, source: str) -> dict[str, str]:
    """Everything the server and an auditor need, so no side file is required."""
    return {
        "model_name": request.name,
        "embed_dim": str(request.embed_dim),
        "num_heads": str(request.num_heads),
        "causal": str(request.causal).lower(),
        "bias": str(request.bias).lower(),
        "dtype": request.dtype,
        "weights_sha256": weights_hash,
        "weights_source": source,
        "opset": str(OPSET),
        "exporter": f"torch.onnx(dynamo) torch={torch.__version__} "
        f"onnx={_package_version('onnx')} onnxscript={_package_version('onnxscript')}",
    }


def run_export(request: ExportRequest) -> ExportResult:
    """Export, verify, then publish atomically; nothing is written if verification fails."""
    module, state, source = build_module(
        request.embed_dim,
        request.num_heads,
        bias=request.bias,
        causal=request.causal,
        state_dict_path=request.state_dict,
        seed=request.seed,
    )
    if request.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {request.dtype!r}")
    module = module.to(DTYPES[request.dtype])
    tolerance = request.tolerance
    if tolerance is None:
        tolerance = DEFAULT_TOLERANCE[request.dtype]
    weights_hash = weights_sha256(state)
    metadata = build_metadata(request, weights_hash, source.description)
    reference = reference_layer(state, request.embed_dim, request.num_heads, bias=request.bias)
    model_folder = request.out / request.name
    version = request.version if request.version is not None else next_version(model_folder)
    outcome: dict[str, object] = {}

    def fill(staging: Path) -> None:
        files = export_graphs(module, staging, metadata)
        outcome["parity"] = verify_graphs(
            files,
            reference,
            causal=request.causal,
            tolerance=tolerance,
            dtype=request.dtype,
        )

    folder = write_version(model_folder, version, fill, force=request.force)
    parity = outcome["parity"]
    assert isinstance(parity, ParityReport)
    files = GraphFiles(folder / OUTPUT_FILE, folder / WITH_WEIGHTS_FILE)
    return ExportResult(folder, files, weights_hash, parity)

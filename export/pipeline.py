"""One export: build the layer, write both graphs, verify them, publish the version."""

from __future__ import annotations

import copy
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import torch

from export.golden import write_golden
from export.model import MultiHeadSelfAttention
from export.onnx_graphs import (
    FUSED_FILE,
    OPSET,
    OUTPUT_FILE,
    WITH_WEIGHTS_FILE,
    GraphFiles,
    export_graphs,
)
from export.repository import next_version, write_version
from export.verify import (
    DEFAULT_TOLERANCE,
    ParityReport,
    Reference,
    Tolerance,
    multihead_reference,
    reference_layer,
    verify_graphs,
)
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
    tolerance: float | None = None  # rtol; None: DEFAULT_TOLERANCE[dtype]
    hf_model: Path | None = None  # a Hugging Face BERT-style folder; d and h come from it
    hf_layer: int = 0
    fused: bool = True  # also write model.fused.onnx (opset-23 Attention, output only)


DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class Source:
    """The layer to export, its ground truth, and the resolved d and h."""

    module: MultiHeadSelfAttention
    state: dict[str, torch.Tensor]
    reference: Reference
    embed_dim: int
    num_heads: int
    description: str


@dataclass(frozen=True)
class ExportResult:
    """What was written and how well it matched the reference."""

    folder: Path
    files: GraphFiles
    weights_sha256: str
    parity: ParityReport
    embed_dim: int
    num_heads: int


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_metadata(
    request: ExportRequest, weights_hash: str, source: str, embed_dim: int, num_heads: int
) -> dict[str, str]:
    """Everything the server and an auditor need, so no side file is required."""
    return {
        "model_name": request.name,
        "embed_dim": str(embed_dim),
        "num_heads": str(num_heads),
        "causal": str(request.causal).lower(),
        "bias": str(request.bias).lower(),
        "dtype": request.dtype,
        "weights_sha256": weights_hash,
        "weights_source": source,
        "opset": str(OPSET),
        # 1/sqrt(d/h) lives in the q rows of the projection weights (fold_query_scale), so a
        # reader of the weights (bench/gpu_probe.py) must not apply it again.
        "query_scale_folded": "true",
        "exporter": f"torch.onnx(dynamo) torch={torch.__version__} "
        f"onnx={_package_version('onnx')} onnxscript={_package_version('onnxscript')}",
    }


def load_source(request: ExportRequest) -> Source:
    """Weights from a Hugging Face folder, a state dict or the seeded init, with the module
    they are checked against (the source block itself, or torch.nn.MultiheadAttention)."""
    if request.hf_model is None:
        module, state, origin = build_module(
            request.embed_dim,
            request.num_heads,
            bias=request.bias,
            causal=request.causal,
            state_dict_path=request.state_dict,
            seed=request.seed,
        )
        layer = reference_layer(state, request.embed_dim, request.num_heads, bias=request.bias)
        reference = multihead_reference(layer, causal=request.causal)
        return Source(
            module, state, reference, request.embed_dim, request.num_heads, origin.description
        )
    if request.causal or not request.bias or request.state_dict is not None:
        raise ValueError(
            "--hf-model takes its weights and masking from the model folder; "
            "it cannot be combined with --causal, --no-bias or --state-dict"
        )
    # Imported here: safetensors is needed only for --hf-model (the Docker export stage,
    # which builds the default model, does not install it).
    from export.hf_bert import block_reference, load_hf_layer

    hf = load_hf_layer(request.hf_model, request.hf_layer)
    module = MultiHeadSelfAttention(hf.embed_dim, hf.num_heads)
    module.load_state_dict(hf.state, strict=True)
    return Source(
        module.eval(),
        hf.state,
        block_reference(hf.source),
        hf.embed_dim,
        hf.num_heads,
        hf.description,
    )


def run_export(request: ExportRequest) -> ExportResult:
    """Export, verify, then publish atomically; nothing is written if verification fails."""
    if request.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {request.dtype!r}")
    source = load_source(request)
    module = copy.deepcopy(source.module)
    module.fold_query_scale()  # in float32, before any cast
    module = module.to(DTYPES[request.dtype])
    tolerance = DEFAULT_TOLERANCE[request.dtype]
    if request.tolerance is not None:
        tolerance = Tolerance(rtol=request.tolerance, atol=tolerance.atol)
    weights_hash = weights_sha256(source.state)
    metadata = build_metadata(
        request, weights_hash, source.description, source.embed_dim, source.num_heads
    )
    model_folder = request.out / request.name
    version = request.version if request.version is not None else next_version(model_folder)
    outcome: dict[str, object] = {}

    def fill(staging: Path) -> None:
        files = export_graphs(module, staging, metadata, fused=request.fused)
        outcome["parity"] = verify_graphs(
            files,
            source.reference,
            embed_dim=source.embed_dim,
            tolerance=tolerance,
            dtype=request.dtype,
        )
        write_golden(staging, source.reference, embed_dim=source.embed_dim, dtype=request.dtype)

    folder = write_version(model_folder, version, fill, force=request.force)
    parity = outcome["parity"]
    assert isinstance(parity, ParityReport)
    fused = folder / FUSED_FILE if request.fused else None
    files = GraphFiles(folder / OUTPUT_FILE, folder / WITH_WEIGHTS_FILE, fused)
    return ExportResult(folder, files, weights_hash, parity, source.embed_dim, source.num_heads)

"""python -m export: write a verified model version into the model repository."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from export.pipeline import DTYPES, ExportRequest, run_export
from export.repository import MAX_VERSION, VersionExistsError, existing_versions
from export.verify import ParityError
from export.weights import StateDictError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m export",
        description="Export multi-head self-attention to ONNX (two graphs: with and without "
        "attention weights), verify it against torch.nn.MultiheadAttention, and publish it "
        "as models/<name>/<version>/.",
    )
    parser.add_argument("--name", default="mha", help="model name (default: %(default)s)")
    parser.add_argument("--embed-dim", type=int, help="d (default: 512, or --hf-model's)")
    parser.add_argument("--num-heads", type=int, help="h (default: 8, or --hf-model's)")
    parser.add_argument(
        "--state-dict",
        type=Path,
        help="torch.save()d nn.MultiheadAttention(d, h, batch_first=True).state_dict(); "
        "without it a seeded random init is used",
    )
    parser.add_argument(
        "--hf-model",
        type=Path,
        help="a Hugging Face BERT-style model folder (config.json, model.safetensors): export "
        "the self-attention block (query/key/value + attention.output.dense) of --hf-layer",
    )
    parser.add_argument(
        "--hf-layer", type=int, default=0, help="layer of --hf-model (default: %(default)s)"
    )
    parser.add_argument("--causal", action="store_true", help="mask future positions")
    parser.add_argument("--no-bias", action="store_true", help="projections without bias")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init")
    parser.add_argument("--version", type=int, help="version number (default: newest + 1)")
    parser.add_argument("--out", type=Path, default=Path("models"), help="model repository")
    parser.add_argument("--force", action="store_true", help="replace an existing version")
    parser.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when the model already has a version (used by make serve)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="compute dtype of the graphs; float16 is for GPU builds (default: %(default)s)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        help="rtol: error allowed against the float64 reference, as a fraction of the largest "
        "|reference| value, plus a small floor (default: 1e-4 float32, 1e-2 float16)",
    )
    parser.add_argument(
        "--no-fused",
        action="store_true",
        help="skip model.fused.onnx, the output-only graph with ONNX's fused Attention op "
        "(opset 23) that a CUDA server may choose when its load-time check finds it faster",
    )
    return parser.parse_args(argv)


def name_problem(name: str) -> str:
    """What is wrong with a model name ("" if nothing): it is one folder of the repository,
    and the name clients call it by; the server skips folders whose name starts with a dot."""
    if not name:
        return "is empty"
    if "/" in name or "\\" in name or name in (".", ".."):
        return "must be a single folder name (no / or \\, not . or ..)"
    if name.startswith("."):
        return "starts with a dot: the server skips such folders"
    if any(not ch.isprintable() or ch.isspace() for ch in name):
        return "must not hold spaces or control characters"
    return ""


def usage_problem(args: argparse.Namespace) -> str:
    """What is wrong with the arguments themselves ("" if nothing): a usage error, exit 2."""
    name = name_problem(args.name)
    problems = [
        (
            args.version is not None and not 1 <= args.version <= MAX_VERSION,
            f"--version must be 1..{MAX_VERSION}, got {args.version}",
        ),
        (
            args.hf_model is not None
            and (args.embed_dim is not None or args.num_heads is not None),
            "--hf-model reads d and h from its config.json",
        ),
        (args.hf_layer != 0 and args.hf_model is None, "--hf-layer needs --hf-model"),
        (
            args.tolerance is not None
            and not (math.isfinite(args.tolerance) and args.tolerance > 0),
            f"--tolerance must be a number > 0, got {args.tolerance}",
        ),
        (bool(name), f"--name {args.name!r} {name}"),
    ]
    return next((text for wrong, text in problems if wrong), "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = usage_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.if_missing and existing_versions(args.out / args.name):
        print(f"{args.out / args.name} already has a version; nothing to do")
        return 0
    request = ExportRequest(
        name=args.name,
        embed_dim=512 if args.embed_dim is None else args.embed_dim,
        num_heads=8 if args.num_heads is None else args.num_heads,
        hf_model=args.hf_model,
        hf_layer=args.hf_layer,
        bias=not args.no_bias,
        causal=args.causal,
        state_dict=args.state_dict,
        seed=args.seed,
        version=args.version,
        out=args.out,
        force=args.force,
        dtype=args.dtype,
        tolerance=args.tolerance,
        fused=not args.no_fused,
    )
    started = time.monotonic()
    try:
        result = run_export(request)
    except (ValueError, StateDictError, VersionExistsError, ParityError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # --out not a writable folder, a file that cannot be read, ...
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"exported {args.name} version {result.folder.name} in {time.monotonic() - started:.1f}s")
    for path in (result.files.output_only, result.files.with_weights, result.files.fused):
        if path is None:
            continue
        print(f"  {path}  {path.stat().st_size / 1e6:.2f} MB")
    parity = result.parity
    reference = "the source BERT block" if args.hf_model else "torch.nn.MultiheadAttention"
    print(
        f"  d={result.embed_dim} h={result.num_heads} causal={args.causal} dtype={args.dtype} "
        f"weights_sha256={result.weights_sha256}"
    )
    print(
        f"  parity vs {reference} (float64) over {parity.cases} padded batches "
        f"(seq up to {parity.max_seq}): max abs error output={parity.max_abs_error_output:.2e} "
        f"(relative {parity.max_rel_error_output:.1e} of max |output| {parity.output_scale:.3g}) "
        f"attention_weights={parity.max_abs_error_weights:.2e}"
        + (
            f" fused output={parity.max_abs_error_fused:.2e}"
            if parity.max_abs_error_fused is not None
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m export: write a verified model version into the model repository."""

from __future__ import annotations

import argparse
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
    parser.add_argument("--embed-dim", type=int, default=512, help="d (default: %(default)s)")
    parser.add_argument("--num-heads", type=int, default=8, help="h (default: %(default)s)")
    parser.add_argument(
        "--state-dict",
        type=Path,
        help="torch.save()d nn.MultiheadAttention(d, h, batch_first=True).state_dict(); "
        "without it a seeded random init is used",
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
        help="max abs error allowed against torch (default: 1e-5 float32, 1e-2 float16)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.version is not None and not 1 <= args.version <= MAX_VERSION:
        print(f"error: --version must be 1..{MAX_VERSION}, got {args.version}", file=sys.stderr)
        return 2
    if args.if_missing and existing_versions(args.out / args.name):
        print(f"{args.out / args.name} already has a version; nothing to do")
        return 0
    request = ExportRequest(
        name=args.name,
        embed_dim=args.embed_dim,
        num_heads=args.num_heads,
        bias=not args.no_bias,
        causal=args.causal,
        state_dict=args.state_dict,
        seed=args.seed,
        version=args.version,
        out=args.out,
        force=args.force,
        dtype=args.dtype,
        tolerance=args.tolerance,
    )
    started = time.monotonic()
    try:
        result = run_export(request)
    except (ValueError, StateDictError, VersionExistsError, ParityError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"exported {args.name} version {result.folder.name} in {time.monotonic() - started:.1f}s")
    for path in (result.files.output_only, result.files.with_weights):
        print(f"  {path}  {path.stat().st_size / 1e6:.2f} MB")
    print(
        f"  d={args.embed_dim} h={args.num_heads} causal={args.causal} dtype={args.dtype} "
        f"weights_sha256={result.weights_sha256}"
    )
    print(
        f"  parity vs torch.nn.MultiheadAttention over {result.parity.cases} padded batches "
        f"(seq up to 256): max abs error output={result.parity.max_abs_error_output:.2e} "
        f"attention_weights={result.parity.max_abs_error_weights:.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

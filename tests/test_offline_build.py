"""scripts/build-image-offline.sh on a connected machine with pip's defaults: constraints.txt
pins torch's CPU build (+cpu), which PyPI does not have, so the wheelhouse download must ask
PyTorch's CPU index too (before: pip's ResolutionImpossible for torch==2.13.0 unless the
machine's own pip config happened to find the wheel)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts/build-image-offline.sh"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _pinned_torch() -> str:
    (pin,) = re.findall(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    return pin


def _download_command(env: dict[str, str]) -> str:
    """The script's pip download line as bash expands it (a PIP that echoes, nothing run)."""
    probe = (
        'set -euo pipefail; PIP="echo pip"; source <(sed -n "/^TORCH_INDEX=/,/^fi$/p" '
        f'"{SCRIPT}"); $PIP download "${{TORCH_INDEX_ARGS[@]}}" torch'
    )
    done = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return done.stdout.strip()


def test_the_wheelhouse_download_asks_the_pytorch_cpu_index_by_default() -> None:
    assert _pinned_torch().endswith("+cpu")
    assert _download_command({}) == f"pip download --extra-index-url {TORCH_CPU_INDEX} torch"


def test_an_empty_torch_index_leaves_pip_to_its_own_configuration() -> None:
    assert _download_command({"TORCH_INDEX": ""}) == "pip download torch"

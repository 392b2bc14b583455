"""Which package index torch's CPU build comes from, decided in a few seconds.

PyTorch publishes torch's CPU build (no CUDA libraries, ~190 MB instead of several GB) on its
own wheel index; PyPI has only the CUDA build. `make setup`, the Dockerfile's export stage and
scripts/build-image-offline.sh ask this script which index to add for torch:

    python3 scripts/torch_index.py            # TORCH_INDEX from the environment, else DEFAULT
    python3 scripts/torch_index.py URL        # that index ('' = none)

It prints the index when its torch page answers within --timeout-s (default 4), and nothing
otherwise, with one line on stderr saying why: then pip takes torch from wherever it finds it
(PyPI's build, or a wheel in pip's find-links). It always exits 0, so a caller can write
`index=$(python3 scripts/torch_index.py)` and `${index:+--extra-index-url "$index"}`.
Standard library only: it runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DEFAULT = "https://download.pytorch.org/whl/cpu"
ENV = "TORCH_INDEX"
TIMEOUT_S = 4.0


@dataclass(frozen=True)
class Decision:
    """The index to use ('' = none) and, when there is none, why."""

    index: str
    reason: str = ""


def _context() -> ssl.SSLContext:
    """The certificates pip would use when the environment names them, else the system's."""
    cafile = os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE") or None
    return ssl.create_default_context(cafile=cafile)


def _fetch(url: str, timeout_s: float, answer: list[object]) -> None:
    """The torch page's HTTP status (or the exception) into answer; runs in a thread."""
    request = urllib.request.Request(url, headers={"Accept": "text/html"}, method="GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=_context()) as response:
            answer.append(response.status)  # the page itself is not read
    except Exception as error:
        answer.append(error)


def _why(error: object) -> str:
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} for its torch page"
    if isinstance(error, urllib.error.URLError):
        return str(error.reason)
    return f"{type(error).__name__}: {error}"


def probe(index: str, timeout_s: float = TIMEOUT_S) -> Decision:
    """Decision for index: usable when its PEP 503 page for torch answers 2xx within
    timeout_s (name resolution included: the request runs in a thread that is abandoned
    when the time is up)."""
    index = index.strip().rstrip("/")
    if not index:
        return Decision("", "no index given")
    parsed = urllib.parse.urlparse(index)
    if parsed.scheme == "file":
        page = Path(urllib.request.url2pathname(parsed.path)) / "torch"
        return Decision(index) if page.exists() else Decision("", f"no {page}")
    if parsed.scheme not in ("http", "https"):
        return Decision("", f"not an http(s) or file URL: {index}")
    answer: list[object] = []
    thread = threading.Thread(
        target=_fetch, args=(f"{index}/torch/", timeout_s, answer), daemon=True
    )
    thread.start()
    thread.join(timeout_s)
    if not answer:
        return Decision("", f"no answer within {timeout_s:g} s")
    status = answer[0]
    if isinstance(status, int) and 200 <= status < 300:
        return Decision(index)
    return Decision("", _why(status))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "index",
        nargs="?",
        default=os.environ.get(ENV, DEFAULT),
        help=f"the index ('' = none); default ${ENV}, else {DEFAULT}",
    )
    parser.add_argument("--timeout-s", type=float, default=TIMEOUT_S)
    args = parser.parse_args(argv)
    if not args.index.strip():
        return 0  # asked for none: pip's own configuration decides, nothing to say
    decision = probe(args.index, args.timeout_s)
    if decision.index:
        sys.stdout.write(decision.index + "\n")
    else:
        sys.stderr.write(
            f"torch index {args.index} skipped ({decision.reason}): torch comes from pip's own "
            f"indexes and find-links (PyPI's Linux build brings CUDA: several GB); "
            f"{ENV}=URL names another index\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

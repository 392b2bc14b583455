"""Hypothesis strategies over a gRPC call's headers: te (or none), custom, binary and
gRPC's own headers with values gRPC core takes, and at most one it refuses."""

from __future__ import annotations

import base64

from hypothesis import strategies as st

from tests.harness.h2_raw import Headers

GRPC_TIMEOUTS = [
    "30S",
    " 20S",
    "99999999S",
    "1000000000S",  # past 10^9 units: no deadline, as gRPC core reads it
    # Past on arrival. A deadline that passes while the call is served (core reads "1n" as
    # 1 ms) ends one way or another by chance, on either path: none is generated.
    "0n",
    "0S",
]
# Headers gRPC core reads with a meaning of their own, with values it takes.
SPECIAL_HEADERS = [
    ("user-agent", "generated/1.0"),
    ("grpc-accept-encoding", "gzip"),
    ("grpc-encoding", "identity"),
    ("grpc-encoding", "gzip"),  # refused: the server takes none (unless identity follows)
    ("grpc-status", "3"),
    ("grpc-previous-rpc-attempts", "+1"),
    ("grpc-retry-pushback-ms", "-5"),
    ("grpc-tags-bin", "AAA"),
    ("lb-cost-bin", base64.b64encode(b"12345678cost").decode()),
    ("lb-token", "x"),
    ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
]
# Headers gRPC core refuses (INTERNAL "Error parsing '<name>' metadata"), and a te it refuses.
REFUSED_HEADERS = [
    ("grpc-timeout", "1.5S"),
    ("grpc-timeout", ""),
    ("grpc-timeout", "S"),
    ("grpc-encoding", "bogus"),
    ("grpc-encoding", ""),
    ("grpc-internal-encoding-request", "Identity"),
    ("grpc-status", "-1"),
    ("grpc-previous-rpc-attempts", "0x1"),
    ("grpc-retry-pushback-ms", "x"),
    ("grpclb_client_stats", "x"),
    ("lb-cost-bin", "YWJj"),  # base64, but shorter than the cost (a double) core reads
    *(("x-key-bin", value) for value in ["YR", "Y", "!!", "YW Jj", "_-8"]),
    ("-bin", "!!"),  # a binary header with an empty name before its suffix
    # HTTP/2 allows these characters in a name, gRPC's metadata keys do not.
    *((f"x{c}key", "v") for c in "~!|'*+^`%&$#"),
    ("te", ""),
]


@st.composite
def metadata(draw: st.DrawFn) -> tuple[str, str]:
    """A header gRPC core takes: custom (lower case: Go's HTTP/2 server refuses upper-case
    names, docs/architecture.md), binary (base64, padded or not), or one with a meaning."""
    kind = draw(st.sampled_from(["text", "binary", "special"]))
    if kind == "special":
        return draw(st.sampled_from(SPECIAL_HEADERS))
    key = "x-" + draw(st.from_regex(r"[a-z0-9_.]([a-z0-9_.-]{0,6}[a-z0-9_.])?", fullmatch=True))
    if kind == "text":
        key += "t" if key.endswith("-bin") else ""  # a text header, not a binary one
        # Visible ASCII and spaces inside: control characters close Go's connection.
        value = draw(st.from_regex(r"[!-~]([ -~]{0,10}[!-~])?", fullmatch=True))
        return key, value
    raw = base64.b64encode(draw(st.binary(max_size=5))).decode()
    return key + "-bin", draw(st.sampled_from([raw, raw.rstrip("=")]))


@st.composite
def call_headers(draw: st.DrawFn) -> Headers:
    """A call's headers: te (or none), any headers core takes, and at most one it refuses.
    Core names the first header it refuses in the order sent, which the gateway cannot see
    (docs/architecture.md, "Where it differs"): two would be a coin toss."""
    pairs = list(draw(st.lists(metadata(), max_size=3)))
    if draw(st.booleans()):
        timeout = draw(st.sampled_from(GRPC_TIMEOUTS))
        if timeout.startswith("0"):
            # Past its deadline and in an encoding the server takes none of, a call is
            # refused for either by gRPC core (on both paths) as its timer happens to fire.
            pairs = [pair for pair in pairs if pair != ("grpc-encoding", "gzip")]
        pairs.append(("grpc-timeout", timeout))
    te: str | None = draw(st.sampled_from(["trailers"] * 8 + [None]))
    if draw(st.integers(0, 3)) == 0:
        refused = draw(st.sampled_from(REFUSED_HEADERS))
        if refused[0] == "te":
            te = refused[1]
        else:
            pairs.insert(draw(st.integers(0, len(pairs))), refused)
    return Headers(te, tuple(pairs))

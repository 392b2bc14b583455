"""Status messages the Python front end and the Go gateway both write, word for word. The
gateway's are generated from this module (scripts/go_contract.py writes
service/gateway/contract_gen.go), so the two cannot drift; a {placeholder} is a number (or
a header's name, or a request id as service/text.py shows it), filled in by str.format here
and by a generated Go function there. The queue's refusals live with the status page that
decides them (service/ipc/status_page.py).
"""

from __future__ import annotations

# Admission: the server is starting up or draining (the worker's batcher says so too).
NOT_ACCEPTING = "server is not accepting requests (starting up or shutting down); retry"
# The worker process went away, or is not back yet.
WORKER_GONE = "the ONNX Runtime worker stopped while this request was in flight; retry"
WORKER_RESTARTING = "the ONNX Runtime worker is restarting; retry"
# The drain's grace period ended with the request still waiting or computing.
GRACE_PERIOD_ENDED = "the grace period ended before it was computed; retry"
# A stream that shutdown ended.
STREAM_CLOSED = (
    "server shutting down: every request read from this stream was answered; "
    "send the rest to another replica"
)
# The undelivered-answers bounds (--max-undelivered-bytes, and per connection): each process
# that holds answers (a front end, its gateway) has a share of each, named as such.
ANSWERS_BACKLOGGED_BY_SERVER = (
    "answers computed for clients but not yet read by them hold {total} bytes here, and this "
    "one needs about {nbytes} more than this process's share of --max-undelivered-bytes "
    "({max_bytes} bytes) allows; retry shortly, or ask for less (no attention weights)"
)
ANSWERS_BACKLOGGED_BY_CONNECTION = (
    "this connection has {held} bytes of answers it has not read yet; this one needs about "
    "{nbytes} more than this process's share of --max-undelivered-bytes-per-connection "
    "({max_bytes_per_connection} bytes) allows: read the answers, or spread the calls over "
    "more connections"
)
# A call's header block over --max-metadata-bytes, in gRPC core's words (which the Python
# front end's answer has, followed there by each header's size in the order received).
METADATA_TOO_LARGE = "received metadata size exceeds hard limit ({size} vs. {limit})"
# A front end's shared memory for tensors (--shared-memory-bytes).
SLAB_TOO_SMALL = (
    "this request needs {need} bytes of shared memory for its tensors (input, output and any "
    "weights), more than the front end has ({size}, --shared-memory-bytes); send fewer or "
    "shorter sequences per request, or raise the setting"
)
SLAB_FULL = (
    "shared memory full: {used} of {size} bytes hold tensors of requests in flight, this one "
    "needs {need} more (--shared-memory-bytes); retry with backoff"
)

# An unexpected error (the worker's included): what went wrong is in the server's log, under
# the request id named here (the request's own, shown; or a new one), never in the answer.
INTERNAL_ERROR = "internal error; request_id={request_id} is in the server log"

# Written by the gateway alone: its own front end's protocol process is away.
BACKEND_GONE = "this front end's protocol process is restarting; retry"
STREAM_ENDED_WITHOUT_STATUS = "the stream's protocol process ended it without a status"

# gRPC core's words: the Python front end's server (gRPC core) writes them itself, the gateway
# as core does (tests/gateway/test_grpc_differential.py compares the two).
DEADLINE_EXCEEDED = "Deadline Exceeded"
BAD_TIMEOUT = "Error parsing 'grpc-timeout' metadata"
BAD_TE = "Error parsing 'te' metadata"
# Any other header core parses into a typed value (grpc-encoding, grpc-status, ...) with a
# value it cannot parse; {name} is the header's name.
BAD_METADATA = "Error parsing '{name}' metadata"
# A header name with a character gRPC's metadata keys do not have (0-9 a-z _ - .).
ILLEGAL_HEADER_KEY = "Illegal header key: {name}"
# A binary header (a name ending in -bin) whose value is not base64 as gRPC core decodes it
# (standard alphabet, '=' padding optional, unused bits zero); {name} is the header's name.
BAD_BINARY_HEADER = "Error parsing '{name}' metadata: illegal base64 encoding"
TOO_MANY_PINGS = "too_many_pings"  # the debug data of a GOAWAY for pinging too often

# A message whose compressed-flag byte is neither 0 nor 1 (gRPC defines no other): the gateway
# ends the call INTERNAL in grpc-go's words. gRPC core, serving the Python front end without
# the gateway, has no answer of its own (docs/architecture.md, "Where it differs").
UNEXPECTED_PAYLOAD_FORMAT = "grpc: received unexpected payload format {flag}"

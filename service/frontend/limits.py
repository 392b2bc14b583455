"""gRPC message limits that follow the largest legal call of the models served."""

from __future__ import annotations

from collections.abc import Iterable

from service.catalog import ServedModel
from service.settings import Settings
from service.transport.grpc_options import GRPC_MAX_MESSAGE_BYTES

ENVELOPE_BYTES = 1 << 20
# With no model served at start (explicit mode, an empty repository in poll mode) the limits
# assume a layer this large: BERT-large and most 7B-class layers fit (d 1024..4096), and a
# client cannot make the server receive gRPC's largest message (2 GiB) before any model exists.
UNSEEN_EMBED_DIM = 4096
UNSEEN_NUM_HEADS = 32


def message_limits(served: Iterable[ServedModel], settings: Settings) -> tuple[int, int]:
    """(receive, send) byte limits from the largest legal request and response of the models
    served at start, or of an UNSEEN_EMBED_DIM layer when there is none yet."""
    models = list(served)
    largest_d = max((model.spec.embed_dim for model in models), default=UNSEEN_EMBED_DIM)
    largest_h = max((model.spec.num_heads for model in models), default=UNSEEN_NUM_HEADS)
    positions = settings.max_batch_size * settings.max_seq_len
    request = positions * largest_d * 4 + ENVELOPE_BYTES
    weights = positions * largest_h * settings.max_seq_len * 4
    return min(request, GRPC_MAX_MESSAGE_BYTES), min(request + weights, GRPC_MAX_MESSAGE_BYTES)

"""gRPC message limits follow the largest legal call, also before any model is served."""

from __future__ import annotations

from service.frontend.limits import UNSEEN_EMBED_DIM, message_limits
from service.settings import Settings
from service.transport.grpc_options import GRPC_MAX_MESSAGE_BYTES


def test_no_model_at_start_still_bounds_what_a_client_can_send() -> None:
    """Before: explicit mode with nothing loaded accepted 2 GiB messages until a restart."""
    settings = Settings()
    receive, send = message_limits([], settings)
    largest_request = settings.max_batch_size * settings.max_seq_len * UNSEEN_EMBED_DIM * 4
    assert largest_request <= receive < GRPC_MAX_MESSAGE_BYTES // 4
    assert receive < send <= GRPC_MAX_MESSAGE_BYTES

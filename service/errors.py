"""Domain errors. Each one says what was wrong and what was expected; service/frontend/status.py is
the one place that maps them to gRPC status codes."""


class ServingError(Exception):
    """Base of every error a client is allowed to see the message of."""


class InvalidInput(ServingError):
    """The request is malformed: wrong shape, dtype, byte length, d, or values."""


class NonFiniteOutput(InvalidInput):
    """Finite inputs whose result is not (values too large for the model's arithmetic)."""


class ModelNotFound(ServingError):
    """No such model, or no such version of it. unlisted: the message without the models
    or versions served, for a caller not allowed to see them (--restricted-api metadata)."""

    def __init__(self, message: str, unlisted: str = "") -> None:
        super().__init__(message)
        self.unlisted = unlisted or message


class QueueFull(ServingError):
    """The batcher's queue is at max_queue_size; retry later or elsewhere."""


class DeadlineExpired(ServingError):
    """The request's deadline passed before it could be computed."""


class ShuttingDown(ServingError):
    """The server is draining or not ready yet; retry on another replica."""


class NotSupported(ServingError):
    """A valid call this server does not implement."""


class ModelLoadFailed(InvalidInput):
    """An explicit load found the model's files but could not serve a version of them
    (Triton answers a failed load with INVALID_ARGUMENT too)."""


class ModelControlDisabled(ServingError):
    """A repository load or unload in a model control mode that does not allow it."""


class PermissionDenied(ServingError):
    """A call in a restricted API group without its header, or with a wrong value; the
    message names the header, never the value."""


class AnswersBacklogged(ServingError):
    """The answers this server (or this connection) has computed but clients have not yet
    read are at their bound (--max-undelivered-bytes); retry once they are read."""


class CompressedTooLarge(ServingError):
    """A compressed request that inflates past the receive limit (refused while inflating)."""


class RegionNotFound(ServingError):
    """No client shared-memory region of that name (never registered, or unregistered)."""


class RegionExists(ServingError):
    """A client shared-memory region of that name is registered already."""


class RegionsExhausted(ServingError):
    """Registering one more client shared-memory region would pass the server's bounds."""

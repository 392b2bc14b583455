"""The words of the control messages' JSON form, defined once: each message's type (the
value of Key.TYPE), the keys of the messages and those of a served model. codec.py and
messages.py write and read them; scripts/go_wire_contract.py generates the gateway's Go from
them (service/gateway/wire_gen.go), so the two sides cannot spell one differently.

Keys stay as short as the wire always had them; their names here say what they hold.
"""

from __future__ import annotations

from typing import Final


class MessageType:
    """What Key.TYPE holds: the kind of a JSON message."""

    # front end (or gateway) -> worker
    INFER: Final = "infer"
    CANCEL: Final = "cancel"
    CALL: Final = "call"
    SYNCED: Final = "synced"
    # worker -> front end (or gateway)
    DONE: Final = "done"
    FAIL: Final = "fail"
    REPLY: Final = "reply"
    SYNC: Final = "sync"
    MODELS: Final = "models"
    WELCOME: Final = "welcome"


class Key:
    """The keys of the messages' JSON objects."""

    TYPE: Final = "t"
    ID: Final = "id"  # the request's, the call's or the SYNC's
    # HELLO (the first message on a link, without a type)
    NAME: Final = "name"
    PID: Final = "pid"
    # INFER
    MODEL: Final = "model"  # the model's key, name/version
    WITH_WEIGHTS: Final = "w"
    SHAPE: Final = "shape"
    DTYPE: Final = "dtype"
    INPUT_OFFSET: Final = "in"  # in the slab; absent: none
    OUTPUT_OFFSET: Final = "out"
    WEIGHTS_OFFSET: Final = "wout"
    INPUT_REF: Final = "iref"  # in a client's region: [region, offset, byte size, where, dtype]
    OUTPUT_REF: Final = "oref"
    WEIGHTS_REF: Final = "wref"
    DEADLINE: Final = "deadline"
    TAG: Final = "tag"  # [trace id, span id, flags]
    # CALL
    OP: Final = "op"
    ARGS: Final = "args"
    # DONE
    QUEUE_S: Final = "q"
    COMPUTE_S: Final = "c"
    BATCH_SIZE: Final = "b"
    STARTED_AT: Final = "s"
    PADDING: Final = "p"
    BATCH_ID: Final = "i"
    TAGS: Final = "tags"
    # FAIL and a failed REPLY
    ERROR_KIND: Final = "kind"
    ERROR_MESSAGE: Final = "msg"
    # REPLY
    RESULT: Final = "ok"
    # MODELS and WELCOME
    MODELS: Final = "models"
    READY: Final = "ready"
    DEFAULT_MODEL: Final = "default_model"


class ModelKey:
    """The keys of one served version in MODELS and WELCOME."""

    KEY: Final = "key"
    NAME: Final = "name"
    VERSION: Final = "version"
    EMBED_DIM: Final = "embed_dim"
    NUM_HEADS: Final = "num_heads"
    CAUSAL: Final = "causal"
    DTYPE: Final = "dtype"
    WEIGHTS_SHA256: Final = "weights_sha256"
    WEIGHTS_SOURCE: Final = "weights_source"
    PROVIDER: Final = "provider"
    CAPS: Final = "caps"
    HAS_WEIGHTS_GRAPH: Final = "has_weights_graph"


def words(namespace: type) -> dict[str, str]:
    """A namespace's words by their names, in the order defined."""
    return {name: value for name, value in vars(namespace).items() if name.isupper()}

"""Hand-framed tensor bytes parse exactly as protobuf's own serialization does."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

# Triton's own descriptors beside ours (our V2 protos live in a pool of their own).
from tritonclient.grpc import service_pb2 as triton

from service.frontend.v2_codec import RAW_OUTPUT_CONTENTS
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.inference import grpc_service_pb2 as ours
from service.transport.codec import encode_tensor, encode_tensor_wire
from service.transport.wire import WireMessage, array_bytes, serializer_for

shapes = st.lists(st.integers(0, 9), min_size=1, max_size=4)
dtypes = st.sampled_from([np.float32, np.float16])


def _array(shape: list[int], dtype) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape).astype(dtype)


@given(shapes, dtypes, st.text(max_size=20))
def test_attend_response_parses_as_the_generated_code_builds_it(shape, dtype, request_id) -> None:
    output = _array(shape, dtype)
    weights = _array([*shape, 3], np.float32)
    header = pb.AttendResponse(
        model="mha", request_id=request_id, timing=pb.ServerTiming(queue_us=7)
    )
    wire = (
        WireMessage.of(header)
        .add_message(1, encode_tensor_wire(output))
        .add_message(2, encode_tensor_wire(weights))
    )
    expected = pb.AttendResponse()
    expected.CopyFrom(header)
    expected.output.CopyFrom(encode_tensor(output))
    expected.attention_weights.CopyFrom(encode_tensor(weights))
    parsed = pb.AttendResponse.FromString(wire.serialize())
    assert parsed == expected
    assert wire.nbytes == len(wire.serialize())
    # A stream envelope around it (oneof field 2) is still one well-formed message.
    envelope = WireMessage.of(pb.AttendStreamResponse(request_id=request_id)).add_message(2, wire)
    stream = pb.AttendStreamResponse.FromString(envelope.serialize())
    assert stream.WhichOneof("result") == "response"
    assert stream.response == expected


@given(st.lists(shapes, min_size=1, max_size=3))
def test_v2_raw_outputs_keep_their_order(output_shapes) -> None:
    """Built with our V2 protos, parsed with tritonclient's: both live in one process."""
    arrays = [_array(shape, np.float32) for shape in output_shapes]
    header = ours.ModelInferResponse(model_name="mha", id="x")
    for array in arrays:
        header.outputs.add(name="output", datatype="FP32", shape=list(array.shape))
    wire = WireMessage.of(header)
    for array in arrays:
        wire.add_bytes(RAW_OUTPUT_CONTENTS, array_bytes(array))
    parsed = triton.ModelInferResponse.FromString(wire.serialize())
    assert [bytes(raw) for raw in parsed.raw_output_contents] == [a.tobytes() for a in arrays]
    assert [(o.name, list(o.shape)) for o in parsed.outputs] == [
        (o.name, list(o.shape)) for o in header.outputs
    ]
    assert ours.ModelInferResponse.FromString(wire.serialize()).id == "x"


def test_big_lengths_use_multi_byte_varints() -> None:
    data = bytes(300_000)
    parsed = pb.Tensor.FromString(WireMessage().add_bytes(3, data).serialize())
    assert parsed.data == data


def test_array_bytes_are_little_endian_and_row_major() -> None:
    big_endian = np.arange(6, dtype=">f4").reshape(2, 3)
    assert bytes(array_bytes(big_endian)) == np.arange(6, dtype="<f4").tobytes()
    transposed = np.arange(6, dtype=np.float32).reshape(2, 3).T
    assert bytes(array_bytes(transposed)) == np.ascontiguousarray(transposed).tobytes()


def test_serializer_passes_plain_messages_to_protobuf() -> None:
    serialize = serializer_for(lambda message: message.SerializeToString())
    message = pb.StreamError(code=3, message="bad")
    assert serialize(message) == message.SerializeToString()
    assert serialize(WireMessage.of(message)) == message.SerializeToString()

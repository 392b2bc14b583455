"""KServe V2 REST bodies <-> the V2 protobuf messages the V2Plane takes and returns.

An infer body is JSON, or JSON followed by binary tensors (Triton's binary tensor extension:
the JSON's length in the Inference-Header-Content-Length header, each binary input's length
in its binary_data_size parameter). Both become one ModelInferRequest with the tensor bytes
in raw_input_contents, so the checks of the gRPC path (service/frontend/v2_codec.py) apply
unchanged.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from service.errors import InvalidInput
from service.frontend import shm_tensors
from service.frontend.rest import pieces
from service.frontend.v2_codec import V2_DATATYPES
from service.generated.inference import grpc_service_pb2 as v2
from service.text import shown
from service.transport.codec import checked_shape
from service.transport.wire import array_bytes

MAX_DIM = 1 << 31  # far above any legal tensor (the body is bounded first)
HEADER_LENGTH = "Inference-Header-Content-Length"
# A byte count as the header may spell it: ASCII digits, few enough for int() and far more
# than any body (str.isdigit() takes "²", which int() refuses).
BYTE_COUNT = re.compile(r"[0-9]{1,20}")
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"
INT64_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


@dataclass(frozen=True)
class InferBody:
    """A decoded infer request and how its answer is to be written."""

    request: v2.ModelInferRequest
    binary_outputs: dict[str, bool]  # per output asked for: binary_data
    binary_default: bool  # the request's binary_data_output (no per-output choice)


def json_response(value: Any, status: int = 200) -> web.Response:
    """value as a JSON answer typed exactly application/json: the KServe SDK shows an error's
    text only then (aiohttp's json_response adds "; charset=utf-8")."""
    return web.Response(body=json.dumps(value).encode(), status=status, content_type=JSON_TYPE)


def error_response(status: int, message: str) -> web.Response:
    """The V2 REST error body: {"error": "..."}."""
    return json_response({"error": message}, status)


def _json(text: bytes, what: str) -> Any:
    try:
        return pieces.loads(text)
    except UnicodeDecodeError as err:
        raise InvalidInput(f"{what} is not UTF-8 JSON ({err.reason} at byte {err.start})") from err
    except json.JSONDecodeError as err:
        raise InvalidInput(
            f"{what} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
        ) from err
    except pieces.HookFree as err:
        _nesting(text[: pieces.INLINE_BYTES], what)  # deep nesting: the clearer message
        raise InvalidInput(f"{what} {err}") from None
    except RecursionError as err:
        raise InvalidInput(
            f"{what} nests arrays or objects too deeply; expected the flat V2 JSON layout"
        ) from err
    except ValueError as err:  # the one left: an integer past Python's digit limit
        raise InvalidInput(
            f"{what} holds an integer of more than {sys.get_int_max_str_digits()} digits; "
            "expected numbers a tensor's datatype or a 64-bit count can hold"
        ) from err


def _nesting(head: bytes, what: str) -> None:
    """InvalidInput if the start of a JSON text nests too deeply (a short parse)."""
    try:
        json.loads(head)
    except RecursionError as err:
        raise InvalidInput(
            f"{what} nests arrays or objects too deeply; expected the flat V2 JSON layout"
        ) from err
    except ValueError:
        pass  # the start of a longer text: no whole JSON


def json_length(header_length: str | None) -> int | None:
    """The JSON's length that Inference-Header-Content-Length gives, if it is a byte count."""
    if header_length is None or not BYTE_COUNT.fullmatch(header_length):
        return None
    return int(header_length)


def json_object(body: bytes, what: str, *, empty_ok: bool = False) -> dict[str, Any]:
    """The body as a JSON object ({} for an empty body where that is allowed)."""
    if empty_ok and not body.strip():
        return {}
    value = _json(body, what)
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} is a JSON {type(value).__name__}; expected a JSON object")
    return value


def _typed(value: Any, kind: type | tuple[type, ...], where: str, expected: str) -> Any:
    # bool is an int in Python; JSON true is never a valid number or size here.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise InvalidInput(f"{where} is {shown(json.dumps(value))}; expected {expected}")
    if isinstance(value, str):
        _text(value, where)
    return value


def _text(value: str, where: str) -> str:
    """value, if protobuf can hold it: JSON's \\u escapes can spell a lone UTF-16 surrogate
    (\\ud800), which is no Unicode text, and a protobuf string field refuses it."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidInput(
                f"{where} holds a lone UTF-16 surrogate at character {err.start} (a \\u escape "
                "from d800 to dfff without its pair); expected Unicode text"
            ) from None
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Counts the byte bound does not limit (a 24 MiB body holds a million parameters), bounded
# before any of them reaches protobuf or the event loop. Far above what V2 requests use.
MAX_PARAMETERS = 64  # of a request, an input or an output
MAX_TENSORS = 64  # inputs of a request; outputs asked for
MAX_SHAPE = 64  # a shape's dimensions (checked_shape then allows 2 or 3)


def counted(items: Any, bound: int, what: str, setting: str = "") -> None:
    """InvalidInput when a JSON list or object holds more than bound items."""
    if isinstance(items, (list, dict)) and len(items) > bound:
        raise InvalidInput(
            f"{what} has {len(items)} entries; this server takes at most {bound}{setting}"
        )


def _set_parameters(target: Any, parameters: Any, where: str) -> None:
    """JSON parameters into an InferParameter map (v2_codec then refuses unknown names)."""
    counted(parameters, MAX_PARAMETERS, f"{where} parameters")
    for key, value in _typed(parameters, dict, f"{where} parameters", "an object").items():
        _text(key, f"{where} parameter name")
        if isinstance(value, bool):
            target[key].bool_param = value
        elif isinstance(value, int):
            if not INT64_MIN <= value <= INT64_MAX:
                raise InvalidInput(
                    f"{where} parameter {shown(key)} is {value}; expected a 64-bit integer"
                )
            target[key].int64_param = value
        elif isinstance(value, float) and math.isfinite(value):
            target[key].double_param = value  # as Triton's HTTP server reads a fraction
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            target[key].string_param = _text(text, f"{where} parameter {shown(key)}")


def _json_data(tensor: dict[str, Any], shape: list[int], where: str) -> bytes:
    """JSON "data" (flat row-major, or nested) as little-endian bytes of the tensor's dtype."""
    dtype = V2_DATATYPES.get(tensor.get("datatype", ""))
    if dtype is None:
        return b""  # v2_codec names the datatypes accepted
    try:
        arrays = list(pieces.flat_pieces(tensor["data"]))
    except (ValueError, TypeError, RecursionError) as err:  # ragged nesting
        raise InvalidInput(f"{where} data is not a regular array of numbers: {err}") from err
    kinds = {array.dtype.kind for array in arrays}
    if not kinds <= set("fiu"):
        raise InvalidInput(
            f"{where} data holds {'booleans' if 'b' in kinds else 'non-numbers'}; "
            f"expected {math.prod(shape)} numbers (row-major) for datatype {tensor['datatype']}"
        )
    size = sum(array.size for array in arrays)
    if size != math.prod(shape):
        raise InvalidInput(
            f"{where} data has {size} values; shape {shape} needs {math.prod(shape)}"
        )
    return b"".join(array_bytes(_cast(array, dtype, where, tensor["datatype"])) for array in arrays)


def _cast(array: np.ndarray, dtype: np.dtype[Any], where: str, datatype: str) -> np.ndarray:
    """JSON numbers in the tensor's dtype; InvalidInput for a finite number the dtype cannot
    hold (1e39 in FP32 would become inf, and then read as a non-finite input)."""
    with np.errstate(over="ignore", invalid="ignore"):
        cast = array.astype(dtype, copy=False)
    if cast.dtype.kind == "f" and cast is not array and not np.isfinite(cast).all():
        outside = ~np.isfinite(cast) & np.isfinite(array)
        if outside.any():
            raise InvalidInput(
                f"{where} data holds {int(np.count_nonzero(outside))} numbers outside "
                f"{datatype}'s range (such as {float(array[outside][0]):g}; largest "
                f"{float(np.finfo(cast.dtype).max):g}); expected finite {datatype} values"
            )
    return cast


def _add_input(
    request: v2.ModelInferRequest, tensor: Any, index: int, binary: memoryview, offset: int
) -> int:
    """One JSON input into request (with its bytes in raw_input_contents); the new offset."""
    where = f"input {index}"
    tensor = _typed(tensor, dict, where, "an object with name, shape, datatype and data")
    name = _typed(tensor.get("name"), str, f"{where} name", "a string")
    where = f"input {shown(name)}"
    raw_shape = _typed(tensor.get("shape"), list, f"{where} shape", "a list of integers")
    counted(raw_shape, MAX_SHAPE, f"{where} shape")
    shape = checked_shape([_typed(s, int, f"{where} shape", "integers") for s in raw_shape], where)
    if any(dim > MAX_DIM for dim in shape):  # protobuf's int64 would refuse it, unexplained
        raise InvalidInput(f"{where} shape {shape[:4]} has a dimension above {MAX_DIM}")
    datatype = _typed(tensor.get("datatype"), str, f"{where} datatype", "a string, e.g. FP32")
    target = request.inputs.add(name=name, shape=shape, datatype=datatype)
    _set_parameters(target.parameters, tensor.get("parameters", {}), where)
    size = tensor.get("parameters", {}).get("binary_data_size")
    if shm_tensors.PARAMETERS.intersection(target.parameters):
        if "data" in tensor or size is not None:
            raise InvalidInput(f"{where} names a shared-memory region and carries data; send one")
        return offset  # v2_codec reads it from the region
    if size is not None:
        size = _typed(size, int, f"{where} binary_data_size", "a byte count")
        if "data" in tensor:
            raise InvalidInput(f"{where} has both binary_data_size and data; send one")
        if size < 0:
            raise InvalidInput(f"{where} binary_data_size is {size}; expected a byte count >= 0")
        if size > len(binary) - offset:
            raise InvalidInput(
                f"{where} binary_data_size is {size}, but only {len(binary) - offset} bytes "
                f"of binary data follow the {HEADER_LENGTH} bytes of JSON"
            )
        request.raw_input_contents.append(bytes(binary[offset : offset + size]))
        return offset + size
    if "data" not in tensor:
        raise InvalidInput(f"{where} has no data; send data or binary_data_size")
    request.raw_input_contents.append(_json_data(tensor, shape, where))
    return offset


def _add_outputs(request: v2.ModelInferRequest, outputs: Any) -> dict[str, bool]:
    binary = {}
    counted(outputs, MAX_TENSORS, "outputs")
    for index, output in enumerate(_typed(outputs, list, "outputs", "a list of objects")):
        where = f"output {index}"
        output = _typed(output, dict, where, 'an object with a "name"')
        name = _typed(output.get("name"), str, f"{where} name", "a string")
        target = request.outputs.add(name=name)
        parameters = output.get("parameters", {})
        _set_parameters(target.parameters, parameters, f"output {shown(name)}")
        binary[name] = _flag(parameters, "binary_data", f"output {shown(name)}")
    return binary


def _flag(parameters: Any, name: str, where: str) -> bool:
    """A boolean parameter (false when absent); InvalidInput for anything but true or false
    ("no" was taken as true, "true" as false)."""
    value = parameters.get(name, False) if isinstance(parameters, dict) else False
    if not isinstance(value, bool):
        raise InvalidInput(
            f"{where} parameter {name} is {shown(json.dumps(value))}; expected true or false"
        )
    return value


def decode_infer(body: bytes, header_length: str | None, model: str, version: str) -> InferBody:
    """The ModelInferRequest an infer body asks for; InvalidInput saying what is malformed."""
    json_end = len(body)
    if header_length is not None:
        declared = json_length(header_length)
        if declared is None or declared > len(body):
            raise InvalidInput(
                f"{HEADER_LENGTH} is {shown(header_length)}; expected the JSON's length in "
                f"bytes, at most the body's {len(body)}"
            )
        json_end = declared
    view = memoryview(body)
    header = json_object(body[:json_end], "the inference request")
    request = v2.ModelInferRequest(model_name=model, model_version=version)
    request.id = _typed(header.get("id", ""), str, "id", "a string")
    _set_parameters(request.parameters, header.get("parameters", {}), "request")
    offset = json_end
    counted(header.get("inputs"), MAX_TENSORS, "inputs")
    for index, tensor in enumerate(_typed(header.get("inputs"), list, "inputs", "a list")):
        offset = _add_input(request, tensor, index, view, offset)
    if offset != len(body):
        raise InvalidInput(
            f"{len(body) - offset} bytes of binary data follow the inputs' binary_data_size "
            "total; expected none"
        )
    binary_outputs = _add_outputs(request, header.get("outputs", []))
    binary_default = _flag(header.get("parameters", {}), "binary_data_output", "request")
    return InferBody(request, binary_outputs, binary_default)


def _ints(value: Any, descriptor: Descriptor) -> Any:
    """MessageToDict's output with 64-bit integers as JSON numbers (proto3 JSON writes them as
    strings; Triton's REST answers, and tritonclient's readers, use numbers)."""
    for key, item in value.items():
        field = descriptor.fields_by_name.get(key)
        if field is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            inner = field.message_type.fields_by_name["value"]
            if inner.message_type is not None:
                for entry in item.values():
                    _ints(entry, inner.message_type)
        elif field.message_type is not None:
            for entry in item if isinstance(item, list) else [item]:
                _ints(entry, field.message_type)
        elif field.type in INT64_TYPES:
            value[key] = [int(v) for v in item] if isinstance(item, list) else int(item)
    return value


def message_json(message: Message) -> dict[str, Any]:
    """A V2 response message as Triton's REST API writes it."""
    as_dict = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _ints(as_dict, message.DESCRIPTOR)

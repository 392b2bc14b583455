package main

import "encoding/binary"

// Field numbers of KServe V2's messages (grpc_service.proto) that the echo reads and writes.
const (
	requestModelName = 1 // ModelInferRequest.model_name
	requestID        = 3 // ModelInferRequest.id
	requestInputs    = 5 // ModelInferRequest.inputs (InferInputTensor)
	requestRawInputs = 7 // ModelInferRequest.raw_input_contents
	tensorName       = 1 // InferInputTensor.name, InferOutputTensor.name
	tensorDatatype   = 2
	tensorShape      = 3
	answerModelName  = 1 // ModelInferResponse.model_name
	answerVersion    = 2 // ModelInferResponse.model_version
	answerID         = 3 // ModelInferResponse.id
	answerOutputs    = 5 // ModelInferResponse.outputs (InferOutputTensor)
	answerRawOutputs = 6 // ModelInferResponse.raw_output_contents
	wireVarint       = 0
	wireFixed64      = 1
	wireBytes        = 2
	wireFixed32      = 5
	outputTensorName = "output"
	answeredVersion  = "1"
)

// field is one field of a protobuf message: its number, wire type, and for a length-delimited
// one its payload.
type field struct {
	number, wire int
	payload      []byte
	raw          []byte // the whole field, tag included
}

// fields splits a protobuf message into its fields; ok is false where it is not one.
func fields(message []byte, each func(field) bool) bool {
	for len(message) > 0 {
		start := message
		tag, n := binary.Uvarint(message)
		if n <= 0 {
			return false
		}
		message = message[n:]
		f := field{number: int(tag >> 3), wire: int(tag & 7)}
		switch f.wire {
		case wireVarint:
			_, n = binary.Uvarint(message)
			if n <= 0 {
				return false
			}
		case wireFixed64:
			n = 8
		case wireFixed32:
			n = 4
		case wireBytes:
			size, m := binary.Uvarint(message)
			if m <= 0 || size > uint64(len(message)-m) {
				return false
			}
			f.payload = message[m : m+int(size)]
			n = m + int(size)
		default:
			return false
		}
		if n > len(message) {
			return false
		}
		message = message[n:]
		f.raw = start[:len(start)-len(message)]
		if !each(f) {
			return false
		}
	}
	return true
}

// echo appends to answer the answer to a ModelInferRequest as bench/grpc_floor.py gives it:
// model name and id back, version "1", one output named "output" with the first input's
// datatype and shape, and the first input's raw contents as the output's.
func echo(request, answer []byte) ([]byte, bool) {
	var name, id, input, raw []byte
	seenInput, seenRaw := false, false
	ok := fields(request, func(f field) bool {
		if f.wire != wireBytes {
			return true
		}
		switch f.number {
		case requestModelName:
			name = f.payload
		case requestID:
			id = f.payload
		case requestInputs:
			if !seenInput {
				input, seenInput = f.payload, true
			}
		case requestRawInputs:
			if !seenRaw {
				raw, seenRaw = f.payload, true
			}
		}
		return true
	})
	if !ok || !seenInput || !seenRaw {
		return nil, false
	}
	tensor := appendBytes(nil, tensorName, []byte(outputTensorName))
	ok = fields(input, func(f field) bool {
		if f.number == tensorDatatype || f.number == tensorShape { // as sent: packed or not
			tensor = append(tensor, f.raw...)
		}
		return true
	})
	if !ok {
		return nil, false
	}
	if len(name) > 0 {
		answer = appendBytes(answer, answerModelName, name)
	}
	answer = appendBytes(answer, answerVersion, []byte(answeredVersion))
	if len(id) > 0 {
		answer = appendBytes(answer, answerID, id)
	}
	answer = appendBytes(answer, answerOutputs, tensor)
	return appendBytes(answer, answerRawOutputs, raw), true
}

func appendBytes(out []byte, number int, payload []byte) []byte {
	out = binary.AppendUvarint(out, uint64(number<<3|wireBytes))
	out = binary.AppendUvarint(out, uint64(len(payload)))
	return append(out, payload...)
}

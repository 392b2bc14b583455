package main

import (
	"bytes"
	"encoding/binary"
	"testing"
)

// request is a ModelInferRequest as the bench sends it: model name, id, one input (name,
// datatype, packed shape) and its raw contents.
func request(raw []byte) []byte {
	shape := binary.AppendUvarint(nil, 1)
	shape = binary.AppendUvarint(shape, 2)
	shape = binary.AppendUvarint(shape, 4)
	input := appendBytes(nil, tensorName, []byte("embeddings"))
	input = appendBytes(input, tensorDatatype, []byte("FP32"))
	input = appendBytes(input, tensorShape, shape)
	out := appendBytes(nil, requestModelName, []byte("mha"))
	out = appendBytes(out, requestID, []byte("call-1"))
	out = appendBytes(out, requestInputs, input)
	return appendBytes(out, requestRawInputs, raw)
}

func TestEchoAnswersWithTheInputAsTheOutput(t *testing.T) {
	raw := bytes.Repeat([]byte{1, 2, 3, 4}, 8)
	answer, ok := echo(request(raw), []byte("pre"))
	if !ok {
		t.Fatal("a well-formed request was not answered")
	}
	if !bytes.HasPrefix(answer, []byte("pre")) {
		t.Fatal("the answer did not go after what the buffer held")
	}
	got := map[int][]byte{}
	if !fields(answer[3:], func(f field) bool { got[f.number] = f.payload; return true }) {
		t.Fatal("the answer is not a protobuf message")
	}
	if string(got[answerModelName]) != "mha" || string(got[answerVersion]) != "1" ||
		string(got[answerID]) != "call-1" || !bytes.Equal(got[answerRawOutputs], raw) {
		t.Fatalf("answer fields: %q", got)
	}
	tensor := map[int][]byte{}
	fields(got[answerOutputs], func(f field) bool { tensor[f.number] = f.payload; return true })
	if string(tensor[tensorName]) != "output" || string(tensor[tensorDatatype]) != "FP32" ||
		!bytes.Equal(tensor[tensorShape], []byte{1, 2, 4}) {
		t.Fatalf("output tensor: %q", tensor)
	}
}

func TestEchoRefusesWhatIsNotARequestWithAnInput(t *testing.T) {
	whole := request([]byte{0, 0, 0, 0})
	for name, message := range map[string][]byte{
		"truncated":       whole[:len(whole)-1],
		"no raw contents": whole[:len(whole)-6],
		"no input":        appendBytes(nil, requestRawInputs, []byte{0, 0, 0, 0}),
		"bad wire type":   {0x0f},
		"length past end": {0x3a, 0x7f, 0x00},
	} {
		if _, ok := echo(message, nil); ok {
			t.Errorf("%s: answered", name)
		}
	}
}

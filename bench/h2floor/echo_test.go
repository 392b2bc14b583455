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

// framedMessage is message after its gRPC prefix (not compressed).
func framedMessage(message []byte) []byte {
	return append(binary.BigEndian.AppendUint32([]byte{0}, uint32(len(message))), message...)
}

func TestReadMessageReadsOneMessageToTheBodysEnd(t *testing.T) {
	message := bytes.Repeat([]byte{7}, 3*readStep+5) // past one read step
	held := new([]byte)
	got, code, why := readMessage(bytes.NewReader(framedMessage(message)), held)
	if code != 0 || !bytes.Equal(got, message) {
		t.Fatalf("code %d (%s), %d bytes read of %d", code, why, len(got), len(message))
	}
	twice := append(framedMessage(message), framedMessage(message)...)
	if _, code, _ := readMessage(bytes.NewReader(twice), held); code != codeInvalidArgument {
		t.Fatalf("two messages on a unary call: code %d", code)
	}
	if _, code, _ := readMessage(bytes.NewReader([]byte{2, 0, 0, 0, 0}), held); code != codeInternal {
		t.Fatalf("compressed flag 2: code %d", code)
	}
}

func TestReadMessageGrowsAsBytesArriveNotAsThePrefixSays(t *testing.T) {
	declared := binary.BigEndian.AppendUint32([]byte{0}, 60<<20) // 60 MiB said, 10 bytes sent
	held := new([]byte)
	_, code, _ := readMessage(bytes.NewReader(append(declared, make([]byte, 10)...)), held)
	if code != codeInvalidArgument {
		t.Fatalf("a message that ended early: code %d", code)
	}
	if cap(*held) > 2*readStep {
		t.Fatalf("%d bytes held for 10 that arrived", cap(*held))
	}
}

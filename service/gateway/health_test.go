package main

import (
	"bytes"
	"testing"
)

func servedSmall() *served {
	return &served{defaultModel: "small", ready: true, models: map[string]map[int64]*modelInfo{
		"small": {1: {Name: "small", Version: 1}, 2: {Name: "small", Version: 2}},
	}}
}

func modelReadyMessage(name, version string) []byte {
	var b []byte
	if name != "" {
		b = appendStringField(b, fieldModelReadyRequestName, name)
	}
	if version != "" {
		b = appendStringField(b, fieldModelReadyRequestVersion, version)
	}
	return b
}

func TestModelReadyAnswersAsPython(t *testing.T) {
	yes := []byte{fieldModelReadyResponseReady << 3, 1}
	for _, c := range []struct {
		name, version string
		ready         bool
		label         string
		answer        []byte
	}{
		{"small", "", true, "small", yes},
		{"", "", true, "small", yes}, // the default model
		{"small", "2", true, "small", yes},
		{"small", "3", true, "small", nil},
		{"small", "02", true, "small", nil},
		{"nope", "", true, unknownModelLabel, nil},
		{"small", "", false, "small", nil}, // not ready: no model is
	} {
		label, answer, plain := modelReady(servedSmall(), c.ready, modelReadyMessage(c.name, c.version))
		if !plain || label != c.label || !bytes.Equal(answer, c.answer) {
			t.Errorf("%+v: got %q %x %v", c, label, answer, plain)
		}
	}
}

func TestHealthMessagesNotReadHereGoToPython(t *testing.T) {
	s := servedSmall()
	for name, message := range map[string][]byte{
		"unknown field":  append(modelReadyMessage("small", ""), 3<<3, 1),
		"name not UTF-8": appendStringField(nil, fieldModelReadyRequestName, "\xff"),
		"name a varint":  {fieldModelReadyRequestName << 3, 1},
		"malformed":      {fieldModelReadyRequestName<<3 | wireBytes, 9},
	} {
		if _, _, plain := modelReady(s, true, message); plain {
			t.Errorf("ModelReady, %s: answered here", name)
		}
	}
	if _, _, plain := serverReady(s, true, []byte{1 << 3, 1}); plain {
		t.Error("ServerReady with a field: answered here")
	}
	if _, answer, plain := serverReady(s, false, nil); !plain || answer != nil {
		t.Errorf("ServerReady, not ready: %x %v", answer, plain)
	}
	if label, answer, plain := serverLive(s, false, nil); !plain || label != serverLabel || len(answer) != 2 {
		t.Errorf("ServerLive: %q %x %v", label, answer, plain)
	}
}

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

func state(ready bool) healthState {
	return healthState{served: servedSmall(), ready: ready, shown: func(name string) bool { return name == "gone" }}
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
		a, plain := modelReady(state(c.ready), modelReadyMessage(c.name, c.version))
		if !plain || a.label != c.label || !bytes.Equal(a.message, c.answer) || a.code != codeOK {
			t.Errorf("%+v: got %+v %v", c, a, plain)
		}
	}
}

func TestHealthMessagesNotReadHereGoToPython(t *testing.T) {
	h := state(true)
	for name, message := range map[string][]byte{
		"unknown field":  append(modelReadyMessage("small", ""), 3<<3, 1),
		"name not UTF-8": appendStringField(nil, fieldModelReadyRequestName, "\xff"),
		"name a varint":  {fieldModelReadyRequestName << 3, 1},
		"malformed":      {fieldModelReadyRequestName<<3 | wireBytes, 9},
	} {
		if _, plain := modelReady(h, message); plain {
			t.Errorf("ModelReady, %s: answered here", name)
		}
		if _, plain := healthCheck(h, message); plain {
			t.Errorf("Check, %s: answered here", name)
		}
	}
	if _, plain := healthCheck(h, append(appendStringField(nil, fieldHealthCheckRequestService, ""), 2<<3, 1)); plain {
		t.Error("Check with an unknown field: answered here")
	}
	if _, plain := serverReady(h, []byte{1 << 3, 1}); plain {
		t.Error("ServerReady with a field: answered here")
	}
	if a, plain := serverReady(state(false), nil); !plain || a.message != nil {
		t.Errorf("ServerReady, not ready: %+v %v", a, plain)
	}
	if a, plain := serverLive(state(false), nil); !plain || a.label != serverLabel || len(a.message) != 2 {
		t.Errorf("ServerLive: %+v %v", a, plain)
	}
}

func TestHealthCheckAnswersAsPythonsHealthService(t *testing.T) {
	status := func(s uint64) []byte { return []byte{fieldHealthCheckResponseStatus << 3, byte(s)} }
	serving, notServing := status(healthServing), status(healthNotServing)
	for _, c := range []struct {
		service         string
		ready, draining bool
		code            int
		answer          []byte
	}{
		{"", true, false, codeOK, serving},
		{"inference.GRPCInferenceService", true, false, codeOK, serving},
		{"attention.v1.AttentionService", false, false, codeOK, notServing},
		{"small", true, false, codeOK, serving},
		{"small", true, true, codeOK, notServing},
		{"", true, true, codeOK, notServing},
		{"gone", true, false, codeOK, notServing}, // served once
		{"nope", true, false, codeNotFound, nil},
	} {
		h := state(c.ready)
		h.draining = c.draining
		message := appendStringField(nil, fieldHealthCheckRequestService, c.service)
		a, plain := healthCheck(h, message)
		if !plain || a.code != c.code || !bytes.Equal(a.message, c.answer) || a.label != "" {
			t.Errorf("%+v: got %+v %v", c, a, plain)
		}
	}
}

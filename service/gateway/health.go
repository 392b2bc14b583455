package main

import (
	"net/http"
	"strings"
	"time"
)

// V2's health calls (ServerLive, ServerReady, ModelReady) are answered here, from what the
// worker publishes to this gateway's link (readiness, the served set) and this gateway's
// drain, by the rules the Python front end answers them by: a probe must not wait for the
// front end's process to be scheduled on a core busy with inference (3x overload, every
// process on one core: ServerReady's p50 2.8-3.0 ms and maximum 28-31 ms through Python,
// 0.8 ms and 18-20 ms answered here).
//
// They are answered here only once the front end has started (it sends SIGUSR1; before, it
// answers "not ready" while it finishes starting), and only for the messages clients send:
// ServerLive's and ServerReady's empty message, ModelReady's name and version. Anything else
// (unknown fields, a malformed message, a compressed one, a deadline already past) goes to
// the Python front end, which answers it as before. A call sampled for tracing gets its span
// from the front end, as the calls computed here do.

// healthCall answers one health call's message: the model label of its metrics, the answer's
// message (without the gRPC prefix), and false when the message is Python's to answer.
type healthCall func(s *served, ready bool, message []byte) (label string, answer []byte, plain bool)

var healthMethods = map[string]healthCall{
	serverLivePath:  serverLive,
	serverReadyPath: serverReady,
	modelReadyPath:  modelReady,
}

func serverLive(_ *served, _ bool, message []byte) (string, []byte, bool) {
	return serverLabel, boolMessage(fieldServerLiveResponseLive, true), len(message) == 0
}

func serverReady(_ *served, ready bool, message []byte) (string, []byte, bool) {
	return serverLabel, boolMessage(fieldServerReadyResponseReady, ready), len(message) == 0
}

// modelReady: the named version (or the newest; the default model when none is named) is
// served and the server is ready.
func modelReady(s *served, ready bool, message []byte) (string, []byte, bool) {
	var name, version string
	plain := true
	err := eachField(message, func(f field) error {
		switch f.num {
		case fieldModelReadyRequestName:
			plain = plain && stringField(f, &name)
		case fieldModelReadyRequestVersion:
			plain = plain && stringField(f, &version)
		default:
			plain = false
		}
		return nil
	})
	if err != nil || !plain {
		return "", nil, false
	}
	label := name
	if label == "" {
		label = s.defaultModel
	}
	if s.models[label] == nil {
		label = unknownModelLabel
	}
	return label, boolMessage(fieldModelReadyResponseReady, ready && s.resolve(name, version) != nil), true
}

// boolMessage is a message of one bool field, as protobuf writes it: empty when false.
func boolMessage(num int, value bool) []byte {
	if !value {
		return nil
	}
	return appendVarint(appendTag(nil, num, wireVarint), 1)
}

// serveHealth answers a health call (message: its message, without the gRPC prefix, read
// before deadline when that is not zero) and reports true, or false when the call is the
// Python front end's to answer. admit checks the call's restricted API key, as for the calls
// answered here; a call it refuses has been answered.
func (fp *fastPath) serveHealth(w http.ResponseWriter, r *http.Request, call healthCall, message []byte,
	deadline time.Time, admit func() bool) bool {
	if !fp.answersHealth.Load() {
		return false
	}
	started := time.Now()
	if !deadline.IsZero() && !started.Before(deadline) {
		return false // Python answers DEADLINE_EXCEEDED
	}
	snapshot := fp.worker.snapshot()
	label, answer, plain := call(snapshot, snapshot.ready && fp.accepting.Load(), message)
	if !plain {
		return false
	}
	if !admit() {
		return true
	}
	trace := fp.sampler.sample(r.Header, started)
	fp.metrics.inFlight(apiV2, 1)
	// Counted OK once the answer exists, as Python counts a call whose answer gRPC writes.
	segments := [][]byte{append(make([]byte, 5, 5+len(answer)), answer...)}
	answered := time.Now() // server time until the answer existed, as Python measures it
	_ = writeMessage(w, segments, func() {})
	fp.metrics.inFlight(apiV2, -1)
	fp.metrics.finished(label, apiV2, codeOK, answered.Sub(started).Seconds())
	fp.spans.record(trace, callSpan{method: strings.TrimPrefix(r.RequestURI, "/"), code: codeOK, answered: answered})
	return true
}

// deadlineIf is deadline when the call has one, else the zero time.
func deadlineIf(limited bool, deadline time.Time) time.Time {
	if !limited {
		return time.Time{}
	}
	return deadline
}

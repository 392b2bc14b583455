package main

import (
	"net/http"
	"strings"
	"time"
)

// V2's health calls (ServerLive, ServerReady, ModelReady) and grpc.health.v1's Check are
// answered here, from what the worker publishes to this gateway's link (readiness, the
// served set) and this gateway's drain, by the rules the Python front end answers them by:
// a probe must not wait for the front end's process to be scheduled on a core busy with
// inference (3x overload, every process on one core: ServerReady's p50 2.8-3.0 ms and
// maximum 28-31 ms through Python, 0.8 ms and 18-20 ms answered here).
//
// They are answered here only once the front end has started (it sends SIGUSR1; before, it
// answers "not ready" while it finishes starting), and only for the messages clients send:
// ServerLive's and ServerReady's empty message, ModelReady's name and version, Check's
// service name (Watch, a stream, stays Python's). Anything else (unknown fields, a
// malformed message, a compressed one, a deadline already past) goes to the Python front
// end, which answers it as before. A V2 call sampled for tracing gets its span from the
// front end, as the calls computed here do.

// healthState is what a health call is answered from.
type healthState struct {
	served   *served
	ready    bool // V2's readiness: the worker is ready and this gateway still accepts calls
	draining bool // SIGTERM came: grpc.health.v1 says NOT_SERVING for every entry
	shown    func(model string) bool
}

// healthAnswer is a health call's answer: its status (and, for OK, its message without the
// gRPC prefix), and the model label of its metrics ("": Python counts none for it).
type healthAnswer struct {
	code    int
	message []byte
	label   string
}

// healthCall answers one health call's message; false when the message is Python's to
// answer.
type healthCall func(h healthState, message []byte) (healthAnswer, bool)

var healthMethods = map[string]healthCall{
	serverLivePath:  serverLive,
	serverReadyPath: serverReady,
	modelReadyPath:  modelReady,
	healthCheckPath: healthCheck,
}

func serverLive(_ healthState, message []byte) (healthAnswer, bool) {
	return healthAnswer{message: boolMessage(fieldServerLiveResponseLive, true), label: serverLabel}, len(message) == 0
}

func serverReady(h healthState, message []byte) (healthAnswer, bool) {
	return healthAnswer{message: boolMessage(fieldServerReadyResponseReady, h.ready), label: serverLabel}, len(message) == 0
}

// modelReady: the named version (or the newest; the default model when none is named) is
// served and the server is ready.
func modelReady(h healthState, message []byte) (healthAnswer, bool) {
	var name, version string
	if !stringFields(message, map[int]*string{fieldModelReadyRequestName: &name, fieldModelReadyRequestVersion: &version}) {
		return healthAnswer{}, false
	}
	label := name
	if label == "" {
		label = h.served.defaultModel
	}
	if h.served.models[label] == nil {
		label = unknownModelLabel
	}
	ready := h.ready && h.served.resolve(name, version) != nil
	return healthAnswer{message: boolMessage(fieldModelReadyResponseReady, ready), label: label}, true
}

// healthCheck is grpc.health.v1's Check as the front end's health service answers it: an
// entry for the server (""), one for each API, and one for each model served since the
// front end started (NOT_SERVING once no longer served); NOT_FOUND, without a message, for
// any other name; every entry NOT_SERVING once draining. Python counts no metrics for it.
func healthCheck(h healthState, message []byte) (healthAnswer, bool) {
	var service string
	if !stringFields(message, map[int]*string{fieldHealthCheckRequestService: &service}) {
		return healthAnswer{}, false
	}
	serving := h.served.models[service] != nil || healthServiceNames[service]
	if !serving && !h.shown(service) {
		return healthAnswer{code: codeNotFound}, true
	}
	status := uint64(healthNotServing)
	if serving && h.ready && !h.draining {
		status = healthServing
	}
	return healthAnswer{message: appendVarint(appendTag(nil, fieldHealthCheckResponseStatus, wireVarint), status)}, true
}

// stringFields reads a message of string fields only, each into its place; false when it
// has any other field or a value that is not valid UTF-8 (Python's to answer).
func stringFields(message []byte, into map[int]*string) bool {
	plain := true
	err := eachField(message, func(f field) error {
		if to, known := into[f.num]; known {
			plain = plain && stringField(f, to)
		} else {
			plain = false
		}
		return nil
	})
	return err == nil && plain
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
	draining := fp.draining.Load() // not ready from the signal on, as Python's
	state := healthState{served: snapshot, ready: snapshot.ready && fp.accepting.Load() && !draining,
		draining: draining, shown: fp.worker.wasShown}
	answer, plain := call(state, message)
	if !plain {
		return false
	}
	if !admit() {
		return true
	}
	if answer.code != codeOK { // grpc.health.v1's NOT_FOUND
		writeStatus(w, answer.code, "")
		return true
	}
	if answer.label != "" { // V2's (grpc.health.v1: no metrics, no span, as in Python)
		// Counted OK, and out of flight, once the answer exists, before it is written:
		// Python counts a call when its handler returns, whenever the client reads it.
		trace := fp.sampler.sample(r.Header, started)
		answered := time.Now()
		fp.metrics.inFlight(apiV2, 1) // in and out at once: the series exists, as in Python
		fp.metrics.inFlight(apiV2, -1)
		fp.metrics.finished(answer.label, apiV2, codeOK, answered.Sub(started).Seconds())
		fp.spans.record(trace, callSpan{method: strings.TrimPrefix(r.RequestURI, "/"), code: codeOK, answered: answered})
	}
	// A client that does not read it does not hold the call past its deadline either.
	_ = writeBefore(w, [][]byte{prefixed(answer.message)}, func() {}, deadline, fp.deadlineSlack)
	return true
}

// prefixed is message after room for the 5-byte gRPC prefix (writeMessage fills it in).
func prefixed(message []byte) []byte {
	return append(make([]byte, 5, 5+len(message)), message...)
}

// deadlineIf is deadline when the call has one, else the zero time.
func deadlineIf(limited bool, deadline time.Time) time.Time {
	if !limited {
		return time.Time{}
	}
	return deadline
}

package main

// Tracing of the calls answered here (--trace-sampler). Each call is sampled as the Python
// front end's OpenTelemetry sampler samples it, from the caller's W3C traceparent. A sampled
// call's ids go with its INFER (the worker links each batch's compute span to the spans of
// the traced requests in it), and when the call ends a record of it goes to the Python front
// end (--spans-socket), which makes its spans and exports them with the server's one
// exporter. An unsampled call costs a header lookup and, without a parent, a random number.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log"
	"math/big"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// sampler decides as the OpenTelemetry SDK's samplers that OTEL_TRACES_SAMPLER names.
type sampler struct {
	parentBased bool   // a caller's sampled flag decides, when it sent a valid traceparent
	all         bool   // a root is always sampled
	bound       uint64 // else a root is sampled when its trace id's low 64 bits are below this
}

// parseSampler reads --trace-sampler: [parentbased_](always_on|always_off|ratio:BOUND), as
// service/observability/tracing.py's gateway_sampler writes it; "" is tracing off (nil).
func parseSampler(value string) (*sampler, error) {
	if value == "" {
		return nil, nil
	}
	s := &sampler{}
	root, parentBased := strings.CutPrefix(value, "parentbased_")
	s.parentBased = parentBased
	switch {
	case root == "always_on":
		s.all = true
	case root == "always_off":
	case strings.HasPrefix(root, "ratio:"):
		bound, ok := new(big.Int).SetString(strings.TrimPrefix(root, "ratio:"), 10)
		if !ok || bound.Sign() < 0 {
			return nil, fmt.Errorf("--trace-sampler %q: the ratio's bound is not a whole number", value)
		}
		if bound.BitLen() > 64 { // 2**64: every trace id is below it
			s.all = true
		} else {
			s.bound = bound.Uint64()
		}
	default:
		return nil, fmt.Errorf("--trace-sampler %q: expected [parentbased_](always_on|always_off|ratio:BOUND)", value)
	}
	return s, nil
}

// callTrace is a sampled call's place in its trace.
type callTrace struct {
	traceID      [16]byte
	spanID       [8]byte
	parentSpanID [8]byte // zero: the call has no parent (its trace starts here)
	parentFlags  byte
	traceState   string
	received     time.Time
	done         []byte // the worker's packed DONE of the call, once it computed it
}

// sample returns the call's trace when it is sampled, nil when not. Like the Python front
// end, which reads gRPC metadata into a dict, it takes the last traceparent and tracestate.
func (s *sampler) sample(h http.Header, received time.Time) *callTrace {
	if s == nil {
		return nil
	}
	t := &callTrace{received: received}
	parentValid := false
	if values := h.Values("Traceparent"); len(values) > 0 {
		parentValid = parseTraceparent(values[len(values)-1], t)
	}
	switch {
	case parentValid && s.parentBased:
		if t.parentFlags&1 == 0 {
			return nil
		}
	default:
		if !parentValid {
			binary.BigEndian.PutUint64(t.traceID[:8], rand.Uint64())
			binary.BigEndian.PutUint64(t.traceID[8:], rand.Uint64())
			if t.traceID == [16]byte{} {
				t.traceID[15] = 1
			}
			t.parentSpanID = [8]byte{}
		}
		if !s.all && binary.BigEndian.Uint64(t.traceID[8:]) >= s.bound {
			return nil
		}
	}
	if parentValid {
		// As the propagator: a longer tracestate is dropped, not cut.
		if values := h.Values("Tracestate"); len(values) > 0 && len(values[len(values)-1]) <= maxTraceState {
			t.traceState = values[len(values)-1]
		}
	}
	for t.spanID == [8]byte{} {
		binary.BigEndian.PutUint64(t.spanID[:], rand.Uint64())
	}
	return t
}

const (
	maxTraceparent = 512 // as OpenTelemetry's propagator reads them
	maxTraceState  = 512
)

// parseTraceparent reads a W3C traceparent into t's trace id, parent span id and flags, by
// the rules OpenTelemetry's Python propagator applies; false when it is not valid.
func parseTraceparent(v string, t *callTrace) bool {
	if len(v) > maxTraceparent {
		return false
	}
	v = strings.TrimLeft(v, " \t")
	if len(v) < 55 || v[2] != '-' || v[35] != '-' || v[52] != '-' {
		return false
	}
	version, rest := v[:2], v[55:]
	if !lowerHex(v[:2]) || !lowerHex(v[3:35]) || !lowerHex(v[36:52]) || !lowerHex(v[53:55]) {
		return false
	}
	switch {
	case strings.Trim(rest, " \t") == "":
	case rest[0] == '-' && version != "00":
	default:
		return false // version 00 has nothing after the flags
	}
	if version == "ff" {
		return false
	}
	hexInto(t.traceID[:], v[3:35])
	hexInto(t.parentSpanID[:], v[36:52])
	flags, _ := strconv.ParseUint(v[53:55], 16, 8)
	t.parentFlags = byte(flags)
	return t.traceID != [16]byte{} && t.parentSpanID != [8]byte{}
}

func lowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func hexInto(into []byte, s string) {
	for i := range into {
		b, _ := strconv.ParseUint(s[2*i:2*i+2], 16, 8)
		into[i] = byte(b)
	}
}

// tag is the call's ids as its INFER carries them (service/ipc/packed.py TAG, tagSize bytes):
// trace id and span id big-endian, then the span's flags (sampled).
func (t *callTrace) tag() []byte {
	b := make([]byte, 0, tagSize)
	b = append(b, t.traceID[:]...)
	b = append(b, t.spanID[:]...)
	return append(b, 1)
}

// tagJSON is the tag as a JSON INFER carries it: [trace id, span id, flags] as numbers.
func (t *callTrace) tagJSON() []any {
	return []any{new(big.Int).SetBytes(t.traceID[:]), binary.BigEndian.Uint64(t.spanID[:]), 1}
}

// callSpan is what a sampled call's record says besides its trace: service/ipc/span_record.py.
type callSpan struct {
	method    string // package.Service/Method
	code      int
	answered  time.Time
	model     string
	version   int64
	sequences int64
	length    int64
}

// spanSink hands records to the Python front end on one connection, from a bounded queue: a
// front end that falls behind loses records (counted), never holds up a call.
type spanSink struct {
	path    string
	queue   chan []byte
	dropped atomic.Int64
}

const spanQueue = 4096

func newSpanSink(path string) *spanSink {
	s := &spanSink{path: path, queue: make(chan []byte, spanQueue)}
	go s.run()
	return s
}

// record queues the call's record; it never blocks.
func (s *spanSink) record(t *callTrace, c callSpan) {
	if s == nil || t == nil {
		return
	}
	select {
	case s.queue <- spanRecord(t, c):
	default:
		if n := s.dropped.Add(1); n&(n-1) == 0 { // 1, 2, 4, 8, ...: not a line per call
			log.Printf("tracing: %d span records dropped (the front end is behind)", n)
		}
	}
}

// run writes what is queued, many records per write, reconnecting after a lost front end.
func (s *spanSink) run() {
	var conn net.Conn
	var buffer []byte
	for first := range s.queue {
		buffer = append(buffer[:0], first...)
	more:
		for len(buffer) < 1<<20 {
			select {
			case next := <-s.queue:
				buffer = append(buffer, next...)
			default:
				break more
			}
		}
		if conn == nil {
			var err error
			if conn, err = net.Dial("unix", s.path); err != nil {
				log.Printf("tracing: cannot reach the front end's span socket (%v); spans lost", err)
				conn = nil
				continue
			}
		}
		if _, err := conn.Write(buffer); err != nil {
			if !errors.Is(err, net.ErrClosed) {
				log.Printf("tracing: span socket lost (%v)", err)
			}
			conn.Close()
			conn = nil
		}
	}
}

// spanRecord frames the record as service/ipc/span_record.py reads it: its length (uint32),
// then the fixed part (spanHeadSize bytes, generated from span_record.HEAD) and the strings,
// little-endian.
func spanRecord(t *callTrace, c callSpan) []byte {
	done := t.done
	if len(done) > 0xffff {
		done = done[:doneSize] // a batch of thousands: its links are dropped, not the span
	}
	size := spanHeadSize + len(c.method) + len(c.model) + len(t.traceState) + len(done)
	b := make([]byte, 0, 4+size)
	b = binary.LittleEndian.AppendUint32(b, uint32(size))
	b = append(b, spanRecordVersion)
	b = append(b, t.traceID[:]...)
	b = append(b, t.spanID[:]...)
	b = append(b, t.parentSpanID[:]...)
	b = append(b, t.parentFlags)
	b = binary.LittleEndian.AppendUint64(b, uint64(t.received.UnixNano()))
	b = binary.LittleEndian.AppendUint64(b, uint64(c.answered.UnixNano()))
	b = append(b, byte(c.code))
	for _, v := range [3]int64{c.version, c.sequences, c.length} {
		b = binary.LittleEndian.AppendUint64(b, uint64(v))
	}
	for _, n := range [4]int{len(c.method), len(c.model), len(t.traceState), len(done)} {
		b = binary.LittleEndian.AppendUint16(b, uint16(n))
	}
	b = append(b, c.method...)
	b = append(b, c.model...)
	b = append(b, t.traceState...)
	return append(b, done...)
}

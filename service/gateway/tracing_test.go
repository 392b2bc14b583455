package main

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"
)

var (
	goldenTrace = [16]byte{0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36}
	goldenSpan  = [8]byte{0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88}
	goldenCall  = [8]byte{0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7}
)

func golden(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "tests", "golden", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A traced INFER, DONE and span record are the bytes Python packs and reads
// (tests/ipc/test_span_record.py checks the same files).
func TestGoldenTracedInfer(t *testing.T) {
	trace := &callTrace{traceID: goldenTrace, spanID: goldenSpan}
	got := append(inferMessage(41, true, [3]int64{2, 16, 512}, [3]int64{0, 65536, 131072}, 812.5, "mha/1", "<f4"), trace.tag()...)
	if want := golden(t, "infer-traced.msg"); !bytes.Equal(got, want) {
		t.Fatalf("traced INFER\n got %x\nwant %x", got, want)
	}
}

func TestGoldenTracedDoneIsKeptForATracedCall(t *testing.T) {
	done := golden(t, "done-traced.msg")
	w := &worker{}
	l := &link{calls: map[uint64]*pending{}}
	call := &pending{done: make(chan answer, 1), traced: true}
	l.calls[41] = call
	buffer := append([]byte(nil), done...)
	if err := w.dispatch(l, buffer, func() {}); err != nil {
		t.Fatal(err)
	}
	clear(buffer) // the read buffer is reused: the answer must hold its own copy
	a := <-call.done
	if a.kind != "" || a.queueS != 0.002 || a.computeS != 0.0005 || a.batch != 6 {
		t.Fatalf("answer = %+v", a)
	}
	if !bytes.Equal(a.done, done) {
		t.Fatalf("kept DONE %x, want %x", a.done, done)
	}
}

func TestGoldenSpanRecord(t *testing.T) {
	received := time.Unix(0, 1_700_000_000_123_456_789)
	trace := &callTrace{traceID: goldenTrace, spanID: goldenSpan, parentSpanID: goldenCall, parentFlags: 1,
		traceState: "congo=t61rcWkgMzE", received: received, done: golden(t, "done-traced.msg")}
	got := spanRecord(trace, callSpan{method: "inference.GRPCInferenceService/ModelInfer", code: codeOK,
		answered: received.Add(2 * time.Millisecond), model: "mha", version: 1, sequences: 2, length: 16})
	if want := golden(t, "span-record.bin"); !bytes.Equal(got, want) {
		t.Fatalf("span record\n got %x\nwant %x", got, want)
	}
}

// The rules of OpenTelemetry's Python propagator (opentelemetry.trace.propagation.tracecontext).
func TestTraceparent(t *testing.T) {
	valid := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	cases := map[string]bool{
		valid:                        true,
		" \t" + valid:                true,
		valid + " \t":                true,
		"01" + valid[2:] + "-future": true,
		valid + "-extra":             false, // version 00 has nothing more
		"ff" + valid[2:]:             false,
		"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01": false,
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01": false,
		"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01": false,
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7":    false,
		"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01": false,
		"01" + valid[2:] + "-" + string(make([]byte, 500)):        false, // over 512 characters
		"": false,
	}
	for header, want := range cases {
		var got callTrace
		if ok := parseTraceparent(header, &got); ok != want {
			t.Errorf("parseTraceparent(%q) = %v, want %v", header, ok, want)
		} else if ok && (got.traceID != goldenTrace || got.parentSpanID != goldenCall || got.parentFlags != 1) {
			t.Errorf("parseTraceparent(%q) read %+v", header, got)
		}
	}
}

func traceparent(trace [16]byte, flags string) http.Header {
	h := http.Header{}
	h.Set("Traceparent", "00-"+hexOf(trace[:])+"-00f067aa0ba902b7-"+flags)
	return h
}

func hexOf(b []byte) string {
	const digits = "0123456789abcdef"
	out := make([]byte, 0, 2*len(b))
	for _, c := range b {
		out = append(out, digits[c>>4], digits[c&15])
	}
	return string(out)
}

func TestSamplersDecideAsTheSDK(t *testing.T) {
	below, at := goldenTrace, goldenTrace
	binary.BigEndian.PutUint64(below[8:], 184467440737095519) // the SDK's bound for 0.01, less one
	binary.BigEndian.PutUint64(at[8:], 184467440737095520)
	ratio, err := parseSampler("ratio:184467440737095520")
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if ratio.sample(traceparent(below, "00"), now) == nil || ratio.sample(traceparent(at, "01"), now) != nil {
		t.Fatal("traceidratio: a trace id's low 64 bits below the bound are sampled, the others not, whatever the parent says")
	}
	parentBased, _ := parseSampler("parentbased_ratio:0")
	kept := parentBased.sample(traceparent(at, "01"), now)
	if kept == nil || kept.traceID != at || kept.parentSpanID != goldenCall || kept.spanID == [8]byte{} {
		t.Fatalf("parentbased: a sampled parent's trace is kept, with a new span: %+v", kept)
	}
	if parentBased.sample(traceparent(below, "00"), now) != nil || parentBased.sample(http.Header{}, now) != nil {
		t.Fatal("parentbased: an unsampled parent, or a root below no bound, is not sampled")
	}
	all, _ := parseSampler("ratio:18446744073709551616")
	root := all.sample(http.Header{}, now)
	if root == nil || root.parentSpanID != [8]byte{} || root.traceID == [16]byte{} {
		t.Fatalf("a root call gets a new trace: %+v", root)
	}
	off, _ := parseSampler("always_off")
	if off.sample(traceparent(below, "01"), now) != nil {
		t.Fatal("always_off sampled a call")
	}
	if none, err := parseSampler(""); none != nil || err != nil || none.sample(http.Header{}, now) != nil {
		t.Fatal("no sampler: tracing off")
	}
	for _, bad := range []string{"ratio:", "ratio:-1", "ratio:0.5", "traceidratio", "parentbased_"} {
		if _, err := parseSampler(bad); err == nil {
			t.Errorf("parseSampler(%q) took it", bad)
		}
	}
}

// Records reach the front end's socket framed, in order, several per write.
func TestSpanSinkDeliversRecords(t *testing.T) {
	path := filepath.Join(t.TempDir(), "spans.sock")
	listener, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close()
	sink := newSpanSink(path)
	trace := &callTrace{traceID: goldenTrace, spanID: goldenSpan, received: time.Now()}
	var want []byte
	for i := range 3 {
		c := callSpan{method: "attention.v1.AttentionService/Attend", code: i, answered: trace.received}
		sink.record(trace, c)
		want = append(want, spanRecord(trace, c)...)
	}
	conn, err := listener.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, len(want))
	if _, err := io.ReadFull(conn, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("records\n got %x\nwant %x", got, want)
	}
}

package main

// The request headers and framing the gateway reads as gRPC core (the Python front end's
// server) reads them, so that a call gets one answer whichever of the two takes it.

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"testing"
	"time"
)

func TestGrpcTimeoutIsReadAsGrpcCoreReadsIt(t *testing.T) {
	// Each value as gRPC core took or refused it (probed against grpcio 1.81).
	for value, want := range map[string]time.Duration{
		"5S": 5 * time.Second, "100m": 100 * time.Millisecond, "7u": time.Millisecond,
		"1n": time.Millisecond, "1000001n": 2 * time.Millisecond, "0n": 0,
		" 1S": time.Second, "1 S": time.Second, "1S ": time.Second, "00000001S": time.Second,
		"0000000000001S": time.Second, "123456789S": 123456789 * time.Second,
		"1000000000n": time.Second, "0S": 0,
	} {
		if got, set, valid := grpcTimeout(value); !set || !valid || got != want {
			t.Errorf("%q: %v set %v valid %v, want %v", value, got, set, valid, want)
		}
	}
	for _, value := range []string{"S", "5", "-1S", "5X", "+5S", "1.5S", "1x", "1s", "\t1S",
		"1S\t", "1000000000x", "1SS", " ", "１S"} {
		if _, set, valid := grpcTimeout(value); set || valid {
			t.Errorf("%q accepted", value)
		}
	}
	// Past 1,000,000,000 units core sets no deadline and reads no further; past what a
	// Duration holds, neither does the gateway.
	for _, value := range []string{"", "1234567890S", "1234567890xyz", "10000000000n",
		"99999999H", "2562048H"} {
		if _, set, valid := grpcTimeout(value); set || !valid {
			t.Errorf("%q: set %v valid %v, want no deadline", value, set, valid)
		}
	}
}

// callWith runs checkCallHeaders on a call with these headers: whether it answered, what it
// answered, and whether it reset the stream instead.
func callWith(header http.Header) (answered bool, w *httptest.ResponseRecorder, r *http.Request, reset bool) {
	r = httptest.NewRequest(http.MethodPost, modelInferPath, nil)
	r.Header = header
	w = httptest.NewRecorder()
	defer func() {
		if p := recover(); p != nil {
			if p != http.ErrAbortHandler {
				panic(p)
			}
			reset = true
		}
	}()
	answered = checkCallHeaders(w, r)
	return answered, w, r, false
}

func TestCallHeadersGrpcCoreRefusesAreRefusedAsItRefusesThem(t *testing.T) {
	if answered, _, _, reset := callWith(http.Header{}); answered || !reset {
		t.Fatalf("no te: answered %v reset %v, want the stream reset", answered, reset)
	}
	refused := []http.Header{
		{"Te": {""}},
		{"Te": {"trailers"}, "Grpc-Timeout": {""}},
		{"Te": {"trailers"}, "Grpc-Timeout": {"1.5S"}},
		{"Te": {"trailers"}, "Grpc-Timeout": {"1S", "1.5S"}},
		{"Te": {"trailers"}, "Grpc-Timeout": {"1.5S", "1S"}},
	}
	for _, header := range refused {
		answered, w, _, reset := callWith(header)
		status, message := w.Header().Get("Grpc-Status"), w.Header().Get("Grpc-Message")
		if !answered || reset || status != "13" || message == "" {
			t.Errorf("%v: answered %v reset %v status %q %q, want INTERNAL", header, answered, reset,
				status, message)
		}
	}
	for _, values := range [][]string{{"100S", "1n"}, {"1n"}, nil} {
		header := http.Header{"Te": {"trailers"}}
		if values != nil {
			header["Grpc-Timeout"] = values
		}
		answered, _, r, reset := callWith(header)
		got := r.Header.Values("Grpc-Timeout")
		if answered || reset || (values != nil && (len(got) != 1 || got[0] != values[len(values)-1])) {
			t.Errorf("%v: answered %v reset %v, passed on %v, want the last value alone", values,
				answered, reset, got)
		}
	}
}

func TestAnswersWithAMessageAdvertiseTheAcceptedEncodings(t *testing.T) {
	defer func(saved string) { acceptEncoding = saved }(acceptEncoding)
	acceptEncoding = "identity, deflate, gzip"
	w := httptest.NewRecorder()
	if err := writeMessage(w, [][]byte{make([]byte, 5)}, func() {}); err != nil {
		t.Fatal(err)
	}
	if got := w.Header().Get("Grpc-Accept-Encoding"); got != acceptEncoding {
		t.Fatalf("grpc-accept-encoding %q, want %q", got, acceptEncoding)
	}
	w = httptest.NewRecorder()
	writeStatus(w, codeInternal, "no") // trailers-only, as gRPC core writes it: none
	if got, ok := w.Header()["Grpc-Accept-Encoding"]; ok {
		t.Fatalf("a trailers-only answer advertises %q", got)
	}
}

func TestAStreamGoesOnReadingAfterAMessageWithTheCompressedFlag(t *testing.T) {
	fp := &fastPath{closing: make(chan struct{})}
	ctx, end := context.WithCancelCause(context.Background())
	defer end(nil)
	toPython, pipe := io.Pipe()
	s := &stream{fp: fp, gateway: &gateway{maxReceive: 1 << 20}, ctx: ctx, end: end,
		limits: streamLimits{maxInflight: 4, maxPending: 1 << 20}, room: make(chan struct{}, 1),
		readDone: make(chan struct{}), python: &pythonPart{pipe: pipe, done: make(chan struct{})}}
	flagged := func(msg string) []byte {
		b := framed([]byte(msg), len(msg))
		b[0] = 1
		return b
	}
	body := append(flagged("first"), flagged("second")...)
	forwarded := make(chan []byte)
	go func() {
		got, _ := io.ReadAll(toPython)
		forwarded <- got
	}()
	s.read(&trickle{chunks: [][]byte{body[:7], body[7:]}})
	pipe.Close()
	if got := <-forwarded; !bytes.Equal(got, body) {
		t.Fatalf("Python's part got %q, want both messages as they came %q", got, body)
	}
	select {
	case <-s.readDone:
	default:
		t.Fatal("reading did not end with the client's half-close")
	}
	if errors.Is(context.Cause(ctx), context.Canceled) {
		t.Fatal("the call was ended")
	}
}

// erring is a body that gives its chunks, then an error other than the end of the body.
type erring struct {
	trickle
	err error
}

func (e *erring) Read(p []byte) (int, error) {
	if len(e.chunks) == 0 {
		return 0, e.err
	}
	return e.trickle.Read(p)
}

func TestAUnaryBodyThatDoesNotEndIsNotTakenAsAWholeCall(t *testing.T) {
	g := &gateway{maxReceive: 1 << 20}
	whole := framed([]byte("abc"), 3)
	for _, err := range []error{os.ErrDeadlineExceeded, errors.New("stream reset")} {
		if _, _, ok := g.readUnary(&erring{trickle{chunks: [][]byte{whole}}, err}); ok {
			t.Errorf("a message, then %v: taken as a whole unary call", err)
		}
	}
	if _, got, ok := g.readUnary(&trickle{chunks: [][]byte{whole}}); !ok || string(got) != "abc" {
		t.Fatalf("a message, then the end of the body: ok=%v %q", ok, got)
	}
}

func TestHeadersGrpcCoreParsesAreCheckedAsItParsesThem(t *testing.T) {
	// Each value as gRPC core (grpcio 1.81) took or refused it, alone on a call.
	cases := []struct {
		name, value string
		refused     bool
	}{
		{"grpc-encoding", "identity", false}, {"grpc-encoding", "gzip", false},
		{"grpc-encoding", "bogus", true}, {"grpc-encoding", "", true},
		{"grpc-encoding", "Identity", true}, {"grpc-encoding", "identity ", true},
		{"grpc-encoding", "stream/gzip", true},
		{"grpc-internal-encoding-request", "gzip", false},
		{"grpc-internal-encoding-request", "", true},
		{"grpc-status", "16", false}, {"grpc-status", "2147483646", false},
		{"grpc-status", "+5", false}, {"grpc-status", "\t5", false}, {"grpc-status", " 3 ", false},
		{"grpc-status", "x", true}, {"grpc-status", "-1", true}, {"grpc-status", "2147483647", true},
		{"grpc-previous-rpc-attempts", "4294967295", false},
		{"grpc-previous-rpc-attempts", " 1", false}, {"grpc-previous-rpc-attempts", "+1", false},
		{"grpc-previous-rpc-attempts", "-1", true}, {"grpc-previous-rpc-attempts", "-0", true},
		{"grpc-previous-rpc-attempts", "4294967296", true},
		{"grpc-previous-rpc-attempts", "0x1", true}, {"grpc-previous-rpc-attempts", "1_0", true},
		{"grpc-previous-rpc-attempts", "", true},
		{"grpc-retry-pushback-ms", "-5", false},
		{"grpc-retry-pushback-ms", "-9223372036854775808", false},
		{"grpc-retry-pushback-ms", "9223372036854775808", true},
		{"grpc-retry-pushback-ms", "--1", true}, {"grpc-retry-pushback-ms", "+-1", true},
		{"grpclb_client_stats", "x", true},
		{"lb-cost-bin", "MTIzNDU2Nzg=", false}, {"lb-cost-bin", "MTIzNDU2Nw==", true},
		{"lb-token", "x", false}, {"grpc-accept-encoding", "bogus", false},
		{"grpc-tags-bin", "AAA", false}, {"user-agent", "", false},
	}
	for _, c := range cases {
		header := http.Header{"Te": {"trailers"}}
		header.Add(c.name, c.value)
		answered, w, _, _ := callWith(header)
		want := ""
		if c.refused {
			want = "Error parsing '" + c.name + "' metadata"
		}
		if got := w.Header().Get("Grpc-Message"); answered != c.refused || got != want {
			t.Errorf("%s: %q answered %v %q, want %q", c.name, c.value, answered, got, want)
		}
	}
	// Every value of a header given twice is parsed (the last one is the value).
	header := http.Header{"Te": {"trailers"}, "Grpc-Encoding": {"identity", "bogus"}}
	if answered, _, _, _ := callWith(header); !answered {
		t.Error("a second grpc-encoding core refuses was taken")
	}
}

func TestHeaderNamesGrpcDoesNotAllowAreRefused(t *testing.T) {
	// HTTP/2 allows any token character in a name; gRPC's metadata keys only 0-9 a-z _ - .
	for _, name := range []string{"x~a", "x!a", "x|a", "x'a", "x*a", "x+a", "x^a", "x`a", "x%a",
		"x&a", "x$a", "x#a", "x~a-bin"} {
		header := http.Header{"Te": {"trailers"}}
		header.Add(name, "b")
		answered, w, _, _ := callWith(header)
		if got := w.Header().Get("Grpc-Message"); !answered || got != grpcMessage("Illegal header key: "+name) {
			t.Errorf("%s: answered %v %q", name, answered, got)
		}
	}
	for _, name := range []string{"x_a", "x.a", "x-0"} {
		header := http.Header{"Te": {"trailers"}}
		header.Add(name, "b")
		if answered, _, _, _ := callWith(header); answered {
			t.Errorf("%s refused", name)
		}
	}
}

func TestAHeaderCoreRefusesComesBeforeAMissingTe(t *testing.T) {
	// Core resets a call without te once the whole header block is parsed: a header it
	// refuses is answered first.
	for name, value := range map[string]string{"Grpc-Timeout": "1.5S", "Grpc-Encoding": "bogus",
		"X-Key-Bin": "YR"} {
		answered, w, _, reset := callWith(http.Header{name: {value}})
		if !answered || reset || w.Header().Get("Grpc-Status") != "13" {
			t.Errorf("%s without te: answered %v reset %v, want INTERNAL", name, answered, reset)
		}
	}
}

func TestOfSeveralRefusedHeadersTheSameOneIsNamedEveryTime(t *testing.T) {
	// net/http hands the headers over without their order: the gateway names an illegal key,
	// then the first of coreParsed's order, then a binary header, each kind by name; never
	// one by chance.
	header := http.Header{"Te": {""}, "X|b": {"1"}, "X~a": {"1"}}
	for i := 0; i < 20; i++ {
		if _, w, _, _ := callWith(header.Clone()); w.Header().Get("Grpc-Message") != "Illegal header key: x|b" {
			t.Fatalf("named %q, want x|b", w.Header().Get("Grpc-Message"))
		}
	}
	header = http.Header{"Te": {""}, "Grpc-Timeout": {"x"}, "X-B-Bin": {"YR"}, "X-A-Bin": {"Y"}}
	for i := 0; i < 20; i++ {
		if _, w, _, _ := callWith(header.Clone()); w.Header().Get("Grpc-Message") != badTe {
			t.Fatalf("named %q, want te's", w.Header().Get("Grpc-Message"))
		}
	}
	header = http.Header{"Te": {"trailers"}, "X-B-Bin": {"YR"}, "X-C-Bin": {"!"}, "X-A-Bin": {"Y"}}
	for i := 0; i < 20; i++ {
		if _, w, _, _ := callWith(header.Clone()); w.Header().Get("Grpc-Message") != badBinaryHeader("x-a-bin") {
			t.Fatalf("named %q, want x-a-bin's", w.Header().Get("Grpc-Message"))
		}
	}
}

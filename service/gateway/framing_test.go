package main

// A message whose compressed-flag byte is neither 0 nor 1 (gRPC defines no other) ends the
// call INTERNAL here, in grpc-go's words, on the unary and the streaming methods the gateway
// reads; nothing of the call after it is read or handed on.

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
)

func flaggedMessage(flag byte, msg string) []byte {
	b := framed([]byte(msg), len(msg))
	b[0] = flag
	return b
}

func TestAUnaryMessageWithAnUnknownFlagIsRefusedAsGrpcGoRefusesIt(t *testing.T) {
	for _, flag := range []byte{2, 0x80, 255} {
		for _, path := range []string{modelInferPath, attendPath} {
			for _, after := range [][]byte{nil, framed([]byte("next"), 4)} {
				g := &gateway{fast: &fastPath{}, maxReceive: 1 << 20}
				body := &trickle{chunks: [][]byte{flaggedMessage(flag, "abc"), after}}
				r := grpcCall(path)
				r.Body = io.NopCloser(body)
				w := httptest.NewRecorder()
				g.ServeHTTP(w, r)
				status, message := w.Header().Get("Grpc-Status"), w.Header().Get("Grpc-Message")
				want := "grpc: received unexpected payload format " + strconv.Itoa(int(flag))
				if status != strconv.Itoa(codeInternal) || message != want {
					t.Errorf("%s flag %d: grpc-status %q %q, want INTERNAL %q", path, flag, status, message, want)
				}
				if len(after) > 0 && len(body.chunks) == 0 {
					t.Errorf("%s flag %d: the message after it was read", path, flag)
				}
			}
		}
	}
	// The compressed flag and a torn message are still Python's to answer.
	g := &gateway{maxReceive: 1 << 20}
	for _, body := range [][]byte{flaggedMessage(1, "abc"), flaggedMessage(2, "abc")[:6]} {
		if _, _, ok := g.readUnary(&trickle{chunks: [][]byte{body}}); ok {
			t.Errorf("% x taken", body)
		}
	}
}

// readingStream is a stream as serveStream makes it, with Python's part a pipe whose bytes
// forwarded() returns once the stream's reading has ended.
func readingStream() (s *stream, ctx context.Context, forwarded func() []byte) {
	ctx, end := context.WithCancelCause(context.Background())
	toPython, pipe := io.Pipe()
	s = &stream{fp: &fastPath{closing: make(chan struct{})}, gateway: &gateway{maxReceive: 1 << 20},
		ctx: ctx, end: end, limits: streamLimits{maxInflight: 4, maxPending: 1 << 20},
		room: make(chan struct{}, 1), readDone: make(chan struct{}),
		python: &pythonPart{pipe: pipe, done: make(chan struct{})}}
	got := make(chan []byte)
	go func() {
		b, _ := io.ReadAll(toPython)
		got <- b
	}()
	return s, ctx, func() []byte {
		pipe.Close()
		return <-got
	}
}

func TestAStreamMessageWithAnUnknownFlagEndsTheCallInternal(t *testing.T) {
	for _, flag := range []byte{2, 0x80, 255} {
		s, ctx, forwarded := readingStream()
		compressed := flaggedMessage(1, "first")
		rest := flaggedMessage(1, "third")
		body := &trickle{chunks: [][]byte{compressed, flaggedMessage(flag, "second"), rest}}
		s.read(body)
		if got := forwarded(); !bytes.Equal(got, compressed) {
			t.Errorf("flag %d: Python's part got %q, want only the message before it %q", flag, got, compressed)
		}
		if len(body.chunks) == 0 {
			t.Errorf("flag %d: the stream was read past it", flag)
		}
		var refused streamRefused
		if !errors.As(context.Cause(ctx), &refused) {
			t.Fatalf("flag %d: the call goes on (%v)", flag, context.Cause(ctx))
		}
		code, message := s.status()
		want := grpcMessage("grpc: received unexpected payload format " + strconv.Itoa(int(flag)))
		if code != codeInternal || message != want {
			t.Errorf("flag %d: ends %d %q, want INTERNAL %q", flag, code, message, want)
		}
	}
}

func TestAStreamWhoseFirstMessageHasAnUnknownFlagIsAnsweredTrailersOnly(t *testing.T) {
	g := &gateway{fast: &fastPath{closing: make(chan struct{}), streams: streamLimits{maxInflight: 4, maxPending: 1 << 20}},
		maxReceive: 1 << 20}
	g.fast.accepting.Store(true)
	r := grpcCall(attendStreamPath)
	r.Body = io.NopCloser(&trickle{chunks: [][]byte{flaggedMessage(2, "abc")}})
	w := httptest.NewRecorder()
	g.ServeHTTP(w, r)
	if w.Code != http.StatusOK || w.Body.Len() != 0 || w.Header().Get("Grpc-Status") != strconv.Itoa(codeInternal) ||
		w.Header().Get("Grpc-Message") != "grpc: received unexpected payload format 2" {
		t.Fatalf("answered %d %v %q", w.Code, w.Header(), w.Body.Bytes())
	}
}

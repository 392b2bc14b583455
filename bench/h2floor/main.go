// Command h2floor is the floor under the gRPC gateway's rows in the benchmark: Go's stock
// net/http HTTP/2 server (cleartext, with the gateway's frame size and windows) and one
// handler that reads a V2 ModelInfer call's message to the end of its body and answers it as
// bench/grpc_floor.py answers the benchmark's request: the input back as the output, with
// gRPC's headers and trailers. It has no validation, worker, batching, bounds or metrics.
// The gateway serves the same HTTP/2 over an I/O layer of its own (raw system calls with a
// read-ahead, an answer's frames written together), so its I/O costs less than this stock
// server's: what the gateway spends over this is its own work less what its I/O saves.
//
//	h2floor -host 127.0.0.1 -port 0   # prints "listening grpc_port=N metrics_port=0"
package main

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"sync"
	"syscall"
)

const (
	service    = "/inference.GRPCInferenceService/"
	maxMessage = 64 << 20 // as bench/grpc_floor.py's receive limit
	// gRPC status codes (google.golang.org/grpc/codes).
	codeInvalidArgument   = 3
	codeInternal          = 13
	codeUnimplemented     = 12
	codeResourceExhausted = 8
)

// readyAnswer is V2's ServerReadyResponse and ModelReadyResponse with ready = true.
var readyAnswer = []byte{0x08, 0x01}

// buffers holds request and answer buffers between calls, as a server that minds its
// allocations would; none larger than maxPooled, as the gateway's pool.
var buffers = sync.Pool{New: func() any { return new([]byte) }}

const maxPooled = 1 << 20

// readStep is how much of a message is read at a time: a buffer grows as bytes arrive, never
// to a length a prefix declares before they do.
const readStep = 64 << 10

// put returns a buffer to the pool when it is small enough to keep.
func put(buffer *[]byte) {
	if cap(*buffer) <= maxPooled {
		buffers.Put(buffer)
	}
}

// prefixSize is a gRPC message's prefix: a compressed flag and its length, 4 bytes big-endian.
const prefixSize = 5

func main() {
	host := flag.String("host", "127.0.0.1", "address to listen on")
	port := flag.Int("port", 0, "port to listen on (0: any free one)")
	flag.Parse()
	listener, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		fmt.Fprintln(os.Stderr, "h2floor:", err)
		os.Exit(1)
	}
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	server := &http.Server{
		Handler:   http.HandlerFunc(serve),
		Protocols: &protocols,
		ErrorLog:  log.New(io.Discard, "", 0),
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams:          1024,
			MaxReadFrameSize:              1 << 20,
			MaxReceiveBufferPerStream:     1 << 20,
			MaxReceiveBufferPerConnection: 8 << 20,
		},
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		_ = server.Close()
	}()
	fmt.Printf("listening grpc_port=%d metrics_port=0\n", listener.Addr().(*net.TCPAddr).Port)
	if err := server.Serve(listener); err != nil && !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintln(os.Stderr, "h2floor:", err)
		os.Exit(1)
	}
}

func serve(w http.ResponseWriter, r *http.Request) {
	infer := r.URL.Path == service+"ModelInfer"
	if !infer && r.URL.Path != service+"ServerReady" && r.URL.Path != service+"ModelReady" {
		writeStatus(w, codeUnimplemented, "")
		return
	}
	held := buffers.Get().(*[]byte)
	defer put(held)
	message, code, why := readMessage(r.Body, held)
	if code != 0 {
		writeStatus(w, code, why)
		return
	}
	answer := buffers.Get().(*[]byte)
	framed := append((*answer)[:0], make([]byte, prefixSize)...) // room for the prefix
	if infer {
		var ok bool
		if framed, ok = echo(message, framed); !ok {
			put(answer)
			writeStatus(w, codeInvalidArgument, "not a V2 ModelInferRequest with an input and its raw contents")
			return
		}
	} else {
		framed = append(framed, readyAnswer...)
	}
	*answer = framed // kept, grown, for the next call
	if writeAnswer(w, framed) == nil {
		// Reused only after a write that completed: a failed one (the stream reset, the
		// client gone) may leave net/http still reading the slice.
		put(answer)
	}
}

// readMessage reads a unary call's one length-prefixed gRPC message into *held (grown as
// its bytes arrive) and the body to its end; code is a gRPC status when it cannot.
func readMessage(body io.Reader, held *[]byte) (message []byte, code int, why string) {
	var prefix [prefixSize]byte
	if _, err := io.ReadFull(body, prefix[:]); err != nil {
		return nil, codeInvalidArgument, "no gRPC message"
	}
	if prefix[0] > 1 {
		return nil, codeInternal, "the message's compressed flag is neither 0 nor 1"
	}
	if prefix[0] != 0 {
		return nil, codeUnimplemented, "compressed messages are not read here"
	}
	size := int(binary.BigEndian.Uint32(prefix[1:]))
	if size > maxMessage {
		return nil, codeResourceExhausted, "message larger than 64 MiB"
	}
	message = (*held)[:0]
	for len(message) < size {
		step := min(size-len(message), readStep)
		message = slices.Grow(message, step)
		n, err := io.ReadFull(body, message[len(message):len(message)+step])
		message = message[:len(message)+n]
		if err != nil {
			*held = message
			return nil, codeInvalidArgument, "the message ended early"
		}
	}
	*held = message
	var more [1]byte
	n, err := body.Read(more[:])
	for n == 0 && err == nil {
		n, err = body.Read(more[:])
	}
	if n > 0 {
		return nil, codeInvalidArgument, "more than one message on a unary call"
	}
	if err != io.EOF {
		return nil, codeInvalidArgument, "the call's body did not end"
	}
	return message, 0, ""
}

// writeAnswer sends framed (a message after prefixSize bytes of room) and an OK status; the
// error is the write's.
func writeAnswer(w http.ResponseWriter, framed []byte) error {
	header := w.Header()
	header.Set("Content-Type", "application/grpc")
	header.Set("Trailer", "Grpc-Status")
	framed[0] = 0 // not compressed
	binary.BigEndian.PutUint32(framed[1:prefixSize], uint32(len(framed)-prefixSize))
	_, err := w.Write(framed)
	header.Set("Grpc-Status", "0")
	return err
}

func writeStatus(w http.ResponseWriter, code int, message string) {
	header := w.Header()
	header.Set("Content-Type", "application/grpc")
	header.Set("Grpc-Status", strconv.Itoa(code))
	if message != "" {
		header.Set("Grpc-Message", message) // plain ASCII here: no percent-encoding needed
	}
	w.WriteHeader(http.StatusOK)
}

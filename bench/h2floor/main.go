// Command h2floor is the floor under the gRPC gateway's rows in the benchmark: a bare Go
// net/http HTTP/2 server (cleartext, with the gateway's frame size and windows) whose handler
// reads a V2 ModelInfer call's message and answers it as bench/grpc_floor.py does, the input
// back as the output, with gRPC's headers and trailers. It has no validation, worker,
// batching, bounds or metrics: what Go's HTTP/2 server and one handler cost per call, which
// the gateway pays too.
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
	"strconv"
	"sync"
	"syscall"
)

const (
	service    = "/inference.GRPCInferenceService/"
	maxMessage = 64 << 20 // as bench/grpc_floor.py's receive limit
	// gRPC status codes (google.golang.org/grpc/codes).
	codeInvalidArgument   = 3
	codeUnimplemented     = 12
	codeResourceExhausted = 8
)

// readyAnswer is V2's ServerReadyResponse and ModelReadyResponse with ready = true.
var readyAnswer = []byte{0x08, 0x01}

// buffers holds request and answer buffers between calls, as a server that minds its
// allocations would.
var buffers = sync.Pool{New: func() any { return new([]byte) }}

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
	held, answer := buffers.Get().(*[]byte), buffers.Get().(*[]byte)
	defer buffers.Put(held)
	defer buffers.Put(answer)
	message, code, why := readMessage(r.Body, held)
	if code != 0 {
		writeStatus(w, code, why)
		return
	}
	framed := append((*answer)[:0], make([]byte, prefixSize)...) // room for the prefix
	switch r.URL.Path {
	case service + "ModelInfer":
		var ok bool
		if framed, ok = echo(message, framed); !ok {
			writeStatus(w, codeInvalidArgument, "not a V2 ModelInferRequest with an input and its raw contents")
			return
		}
	case service + "ServerReady", service + "ModelReady":
		framed = append(framed, readyAnswer...)
	default:
		writeStatus(w, codeUnimplemented, "")
		return
	}
	*answer = framed // kept, grown, for the next call
	writeAnswer(w, framed)
}

// readMessage reads a unary call's one length-prefixed gRPC message into *held (grown as
// needed); code is a gRPC status when it cannot.
func readMessage(body io.Reader, held *[]byte) (message []byte, code int, why string) {
	var prefix [prefixSize]byte
	if _, err := io.ReadFull(body, prefix[:]); err != nil {
		return nil, codeInvalidArgument, "no gRPC message"
	}
	if prefix[0] != 0 {
		return nil, codeUnimplemented, "compressed messages are not read here"
	}
	size := int(binary.BigEndian.Uint32(prefix[1:]))
	if size > maxMessage {
		return nil, codeResourceExhausted, "message larger than 64 MiB"
	}
	if cap(*held) < size {
		*held = make([]byte, size)
	}
	message = (*held)[:size]
	if _, err := io.ReadFull(body, message); err != nil {
		return nil, codeInvalidArgument, "the message ended early"
	}
	return message, 0, ""
}

// writeAnswer sends framed (a message after prefixSize bytes of room) and an OK status.
func writeAnswer(w http.ResponseWriter, framed []byte) {
	header := w.Header()
	header.Set("Content-Type", "application/grpc")
	header.Set("Trailer", "Grpc-Status")
	framed[0] = 0 // not compressed
	binary.BigEndian.PutUint32(framed[1:prefixSize], uint32(len(framed)-prefixSize))
	_, _ = w.Write(framed)
	header.Set("Grpc-Status", "0")
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

package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"
)

// The gRPC wire details the load generator needs: the length-prefixed message, the status of
// an answer (from its trailers, or from its headers when the answer is trailers-only), the
// grpc-timeout header and ServerReady's answer.

const prefixBytes = 5 // compressed flag, 4-byte big-endian length

// codeNames are gRPC's status codes by number.
var codeNames = [...]string{
	"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
	"ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
	"ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
	"UNAUTHENTICATED",
}

// Names of outcomes that are no gRPC status: the call got no gRPC answer.
const (
	clientError = "CLIENT_ERROR"   // transport error, or an answer without a grpc-status
	notSent     = "NOT_SENT"       // the in-flight bound was reached at its scheduled time
	httpError   = "HTTP_NOT_200"   // an HTTP status other than 200
	clientLate  = "CLIENT_TIMEOUT" // no answer by the deadline (plus a grace) at the client
)

// codeName is the name of a gRPC status code ("CODE_17" for one it does not know).
func codeName(code int) string {
	if code >= 0 && code < len(codeNames) {
		return codeNames[code]
	}
	return fmt.Sprintf("CODE_%d", code)
}

// checkFrame returns the message of a body holding exactly one uncompressed gRPC message.
func checkFrame(body []byte) ([]byte, error) {
	if len(body) < prefixBytes || body[0] != 0 {
		return nil, errors.New("not an uncompressed gRPC message")
	}
	size := binary.BigEndian.Uint32(body[1:prefixBytes])
	if int(size) != len(body)-prefixBytes {
		return nil, fmt.Errorf("prefix says %d bytes, the body holds %d", size, len(body)-prefixBytes)
	}
	return body[prefixBytes:], nil
}

// frame prefixes a message as it goes in a request body.
func frame(message []byte) []byte {
	out := make([]byte, prefixBytes, prefixBytes+len(message))
	binary.BigEndian.PutUint32(out[1:], uint32(len(message)))
	return append(out, message...)
}

// status reads the outcome of an answer: the grpc-status and grpc-message of its trailers, or
// of its headers for a trailers-only answer. The name is a gRPC code's, or httpError or
// clientError when the answer carries no gRPC status.
func status(httpStatus int, header, trailer http.Header) (name, message string) {
	if httpStatus != http.StatusOK {
		return httpError, fmt.Sprintf("HTTP %d", httpStatus)
	}
	source := trailer
	if source.Get("grpc-status") == "" {
		source = header
	}
	text := source.Get("grpc-status")
	if text == "" {
		return clientError, "no grpc-status in the answer"
	}
	code, err := strconv.Atoi(text)
	if err != nil {
		return clientError, fmt.Sprintf("grpc-status %q", text)
	}
	return codeName(code), decodeMessage(source.Get("grpc-message"))
}

// decodeMessage undoes grpc-message's percent-encoding (kept as sent when it is malformed).
func decodeMessage(text string) string {
	decoded, err := url.PathUnescape(text)
	if err != nil {
		return text
	}
	return decoded
}

// timeoutHeader is a grpc-timeout value for d: at most 8 digits, in the finest unit that fits.
func timeoutHeader(d time.Duration) string {
	units := []struct {
		size time.Duration
		unit string
	}{{time.Nanosecond, "n"}, {time.Microsecond, "u"}, {time.Millisecond, "m"}, {time.Second, "S"}}
	for _, u := range units {
		// Rounded up, so the server's deadline is never before the client's.
		if n := (d + u.size - 1) / u.size; n < 100_000_000 {
			return strconv.FormatInt(int64(n), 10) + u.unit
		}
	}
	return "99999999S"
}

// serverReady reads inference.ServerReadyResponse{bool ready = 1} from an answer's body.
func serverReady(body []byte) (bool, error) {
	message, err := checkFrame(body)
	if err != nil {
		return false, err
	}
	ready := false
	for len(message) > 0 {
		switch {
		case len(message) >= 2 && message[0] == 0x08: // field 1, varint (0 or 1)
			ready = message[1] != 0
			message = message[2:]
		default:
			return false, fmt.Errorf("unexpected ServerReadyResponse bytes % x", message)
		}
	}
	return ready, nil
}

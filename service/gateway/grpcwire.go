package main

// gRPC over HTTP/2 as net/http serves it: the 5-byte message prefix, status trailers, and
// the request headers gRPC core checks (te, grpc-timeout).

import (
	"encoding/base64"
	"encoding/binary"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// gRPC status codes used here, and their names as the metrics label them.
const (
	codeOK                 = 0
	codeCancelled          = 1
	codeInvalidArgument    = 3
	codeDeadlineExceeded   = 4
	codeNotFound           = 5
	codeAlreadyExists      = 6
	codeResourceExhausted  = 8
	codeFailedPrecondition = 9
	codeUnimplemented      = 12
	codeInternal           = 13
	codeUnavailable        = 14
)

var codeNames = map[int]string{
	codeOK: "OK", codeCancelled: "CANCELLED", codeInvalidArgument: "INVALID_ARGUMENT",
	codeDeadlineExceeded: "DEADLINE_EXCEEDED", codeNotFound: "NOT_FOUND",
	codeAlreadyExists: "ALREADY_EXISTS", codeFailedPrecondition: "FAILED_PRECONDITION",
	codeResourceExhausted: "RESOURCE_EXHAUSTED", codeUnimplemented: "UNIMPLEMENTED",
	codeInternal: "INTERNAL", codeUnavailable: "UNAVAILABLE",
}

// kindCodes map the worker's error kinds (service/ipc/messages.py ERRORS) to status codes,
// as service/frontend/status.py does (tests/gateway/test_gateway.py compares the two).
var kindCodes = map[string]int{
	"InvalidInput": codeInvalidArgument, "NonFiniteOutput": codeInvalidArgument,
	"ModelLoadFailed": codeInvalidArgument, "ModelNotFound": codeNotFound,
	"QueueFull": codeResourceExhausted, "DeadlineExpired": codeDeadlineExceeded,
	"ShuttingDown": codeUnavailable, "NotSupported": codeUnimplemented,
	"ModelControlDisabled": codeFailedPrecondition, "RegionNotFound": codeNotFound,
	"RegionExists": codeAlreadyExists, "RegionsExhausted": codeResourceExhausted,
}

// codeOfKind is the status of a worker's error kind; INTERNAL for one not known.
func codeOfKind(kind string) int {
	if code, known := kindCodes[kind]; known {
		return code
	}
	return codeInternal
}

// grpcMessage percent-encodes a status message as the gRPC spec asks.
func grpcMessage(text string) string {
	const hex = "0123456789ABCDEF"
	out := make([]byte, 0, len(text))
	for i := 0; i < len(text); i++ {
		c := text[i]
		// A space at either end too: HTTP/2 forbids a field value that starts or ends with
		// whitespace, and strict clients reset the stream over it.
		edge := c == ' ' && (i == 0 || i == len(text)-1)
		if c < 0x20 || c > 0x7e || c == '%' || edge {
			out = append(out, '%', hex[c>>4], hex[c&15])
		} else {
			out = append(out, c)
		}
	}
	return string(out)
}

// writeStatus ends a call with no message: a trailers-only response.
func writeStatus(w http.ResponseWriter, code int, message string) {
	h := w.Header()
	h.Set("Content-Type", "application/grpc")
	h.Set("Grpc-Status", strconv.Itoa(code))
	if message != "" {
		h.Set("Grpc-Message", grpcMessage(message))
	}
	w.WriteHeader(http.StatusOK)
}

// message is one response message as segments written in turn: the fields built here,
// and the tensors' bytes referenced where they lie in shared memory until they are copied
// out (an answer can be hundreds of megabytes: never built whole in this heap).
type message struct {
	segments [][]byte
	built    []byte // fields not yet in segments
}

func newMessage() *message {
	return &message{built: make([]byte, 5, 256)} // the 5-byte gRPC prefix first
}

// bytesField adds a bytes field whose value is data, referenced, not copied.
func (m *message) bytesField(num int, data []byte) {
	if len(data) == 0 {
		m.built = appendBytesField(m.built, num, nil)
		return
	}
	m.built = appendVarint(appendTag(m.built, num, wireBytes), uint64(len(data)))
	m.segments = append(m.segments, m.built, data)
	m.built = make([]byte, 0, 64)
}

func (m *message) finish() [][]byte {
	if len(m.built) > 0 {
		m.segments = append(m.segments, m.built)
	}
	return m.segments
}

const (
	// Answers up to this size are copied out of shared memory at once, which is freed
	// before the first byte goes out: a slow reader holds heap, bounded by its answers'
	// reservation, not the shared memory every call needs.
	copyWholeBytes = 4 << 20
	// Larger ones go out through copies of this size, the shared memory held until the
	// last is taken. Never a shared-memory slice to the connection itself: net/http may
	// still be sending a frame when a reset ends the write, and the region is reused.
	copyChunkBytes = 1 << 20
)

// writeMessage sends one message (segments, the first starting with room for the 5-byte
// prefix) and OK. free releases the shared memory the segments reference; it is called
// once they have been copied out, whatever happens.
func writeMessage(w http.ResponseWriter, segments [][]byte, free func()) error {
	h := w.Header()
	h.Set("Content-Type", "application/grpc")
	h.Set("Grpc-Accept-Encoding", acceptEncoding)
	h.Set("Trailer", "Grpc-Status")
	w.WriteHeader(http.StatusOK)
	err := writeSegments(w, segments, free)
	if err == nil {
		err = flush(w)
	}
	h.Set("Grpc-Status", "0")
	return err
}

// writeSegments writes one message of a call whose headers are out, without flushing it.
// free releases the shared memory the segments reference; it is called once they have been
// copied out, whatever happens.
func writeSegments(w http.ResponseWriter, segments [][]byte, free func()) error {
	freed := false
	defer func() {
		if !freed {
			free()
		}
	}()
	size := 0
	for _, s := range segments {
		size += len(s)
	}
	binary.BigEndian.PutUint32(segments[0][1:5], uint32(size-5))
	segments[0][0] = 0 // not compressed
	var err error
	if size <= copyWholeBytes {
		pooled := buffers.Get().(*[]byte)
		whole := (*pooled)[:0]
		for _, s := range segments {
			whole = append(whole, s...)
		}
		free()
		freed = true
		_, err = w.Write(whole)
		// Reused only after a write that completed: an abandoned frame may still
		// reference it.
		if err == nil && cap(whole) <= maxPooledBuffer {
			*pooled = whole
			buffers.Put(pooled)
		}
		return err
	}
	for _, s := range segments {
		for len(s) > 0 && err == nil {
			n := min(len(s), copyChunkBytes)
			_, err = w.Write(append([]byte(nil), s[:n]...))
			s = s[n:]
		}
	}
	return err
}

// flush sends what is buffered and returns once the client's flow control let it out (or
// the call ended): a client that resets before that has its call CANCELLED, and the
// answer's bytes stay reserved until then (a small answer would otherwise sit in the
// stream's buffer, counted OK and released).
func flush(w http.ResponseWriter) error { return http.NewResponseController(w).Flush() }

// grpcTimeout reads one grpc-timeout header value as gRPC core reads it (the Python front
// end's server, timeout_encoding.cc), so that both paths take and refuse the same values:
// spaces around the number and the unit, any number of digits (the spec says at most 8;
// past 1,000,000,000 units core stops reading and sets no deadline), then one unit of
// HMSmun. It returns the timeout, whether there is one, and whether the value is well
// formed; "" is read as no header at all (checkCallHeaders refuses an empty one). A
// timeout past what a time.Duration holds (292 years) means none.
func grpcTimeout(value string) (timeout time.Duration, set, valid bool) {
	if value == "" {
		return 0, false, true
	}
	i := skipSpaces(value, 0)
	amount, digits := int64(0), 0
	for ; i < len(value) && value[i] >= '0' && value[i] <= '9'; i++ {
		digit := int64(value[i] - '0')
		if amount >= 100_000_000 && (amount != 100_000_000 || digit != 0) {
			return 0, false, true // as core: no deadline, and the rest is not read
		}
		amount, digits = amount*10+digit, digits+1
	}
	if digits == 0 {
		return 0, false, false
	}
	i = skipSpaces(value, i)
	if i == len(value) {
		return 0, false, false
	}
	units := map[byte]time.Duration{'H': time.Hour, 'M': time.Minute, 'S': time.Second,
		'm': time.Millisecond, 'u': time.Microsecond, 'n': time.Nanosecond}
	unit, ok := units[value[i]]
	if !ok || skipSpaces(value, i+1) != len(value) {
		return 0, false, false
	}
	if amount > math.MaxInt64/int64(unit) {
		return 0, false, true
	}
	return time.Duration(amount) * unit, true, true
}

func skipSpaces(value string, i int) int {
	for i < len(value) && value[i] == ' ' {
		i++
	}
	return i
}

// acceptEncoding is grpc-accept-encoding on every answer that carries a message: the
// encodings the Python front end's server takes (--grpc-compression), which its own
// answers advertise.
var acceptEncoding = "identity"

// checkCallHeaders answers a call whose te or grpc-timeout headers gRPC core would refuse,
// as core refuses it, and reports whether it did; a call it lets through carries at most
// one grpc-timeout. Such a header is never passed on: core's header decoder fails on it
// without taking it into its header table, and every later call on the connection then
// failed the same way. What core does, and so the Python front end without the gateway:
//   - no te header (gRPC requires "te: trailers", to detect proxies that drop trailers):
//     the stream is reset (RST_STREAM INTERNAL_ERROR);
//   - a te other than "trailers": INTERNAL. Only an empty one reaches this handler: net/http
//     answers any other value HTTP 400 first (RFC 9113 8.2.2: the request is malformed),
//     which gRPC clients read as INTERNAL too;
//   - a grpc-timeout that is empty or not read by grpcTimeout: INTERNAL; with several, the
//     last one counts (as in gRPC core and grpc-go), each checked.
func checkCallHeaders(w http.ResponseWriter, r *http.Request) bool {
	// Binary headers are decoded as gRPC core parses the header block, before it looks at te.
	for name, values := range r.Header {
		if !strings.HasSuffix(name, "-Bin") {
			continue
		}
		for _, value := range values {
			if !grpcBase64(value) {
				writeStatus(w, codeInternal, badBinaryHeader(strings.ToLower(name)))
				return true
			}
		}
	}
	te := r.Header.Values("Te")
	if len(te) == 0 {
		panic(http.ErrAbortHandler) // RST_STREAM INTERNAL_ERROR, as gRPC core resets it
	}
	if te[0] != "trailers" {
		writeStatus(w, codeInternal, badTe)
		return true
	}
	timeouts := r.Header.Values("Grpc-Timeout")
	for _, value := range timeouts {
		if _, _, valid := grpcTimeout(value); !valid || value == "" {
			writeStatus(w, codeInternal, badTimeout)
			return true
		}
	}
	if len(timeouts) > 1 {
		r.Header["Grpc-Timeout"] = timeouts[len(timeouts)-1:]
	}
	return false
}

// headerBlockSize counts a call's headers as gRPC core counts them against its metadata
// limit: each header's name and value plus 32 bytes, the pseudo-headers included. Go's server
// has joined repeated cookie headers with "; ": each crumb is counted as a header of its own,
// so the count is never below core's.
func headerBlockSize(r *http.Request) int {
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	size := len(":path") + len(r.RequestURI) + len(":method") + len(r.Method) +
		len(":scheme") + len(scheme) + 3*32
	if r.Host != "" {
		size += len(":authority") + len(r.Host) + 32
	}
	for name, values := range r.Header {
		for _, value := range values {
			if name != "Cookie" {
				size += len(name) + len(value) + 32
				continue
			}
			for _, crumb := range strings.Split(value, "; ") {
				size += len(name) + len(crumb) + 32
			}
		}
	}
	return size
}

// grpcBase64 says whether gRPC core decodes value as a binary header's: the standard
// alphabet, '=' padding optional, the unused bits of the last character zero.
func grpcBase64(value string) bool {
	_, err := base64.RawStdEncoding.Strict().DecodeString(strings.TrimRight(value, "="))
	return err == nil
}

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

// codeOfKind is the status of a worker's error kind (kindCodes, generated from
// service/frontend/status.py's mapping); INTERNAL for one not known.
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
	w.WriteHeader(http.StatusOK)
	err := writeSegments(w, segments, free)
	if err == nil {
		err = flush(w)
	}
	// A trailer not announced in a "Trailer" header, which gRPC's servers never send.
	h.Set(http.TrailerPrefix+"Grpc-Status", strconv.Itoa(codeOK))
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
		var pooled *[]byte
		var whole []byte
		if size > maxPooledBuffer {
			whole = largeBuffer(size)
		} else {
			pooled = buffers.Get().(*[]byte)
			whole = (*pooled)[:0]
		}
		for _, s := range segments {
			whole = append(whole, s...)
		}
		free()
		freed = true
		_, err = w.Write(whole)
		// Reused only after a write that completed: an abandoned frame may still
		// reference it.
		if err == nil {
			if pooled != nil && cap(whole) <= maxPooledBuffer {
				*pooled = whole
				buffers.Put(pooled) // its own pointer again: no allocation per answer
			} else {
				recycle(whole)
			}
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
// HMSmun, rounded up to whole milliseconds as core keeps time. It returns the timeout,
// whether there is one, and whether the value is well formed; "" is read as no header at
// all (checkCallHeaders refuses an empty one). A timeout past what a time.Duration holds
// (292 years) means none.
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
	unit, ok := timeoutUnits[value[i]]
	if !ok || skipSpaces(value, i+1) != len(value) {
		return 0, false, false
	}
	if amount > math.MaxInt64/int64(unit) {
		return 0, false, true
	}
	// Core keeps time in whole milliseconds, rounding a timeout up: "1n" is 1 ms there (a
	// call that a gRPC client sent with a tiny timeout is read, not refused at once).
	timeout = (time.Duration(amount)*unit + time.Millisecond - 1).Truncate(time.Millisecond)
	return timeout, true, true
}

var timeoutUnits = map[byte]time.Duration{'H': time.Hour, 'M': time.Minute, 'S': time.Second,
	'm': time.Millisecond, 'u': time.Microsecond, 'n': time.Nanosecond}

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

// checkCallHeaders answers a call with a request header gRPC core would refuse, as core
// refuses it, and reports whether it did; a call it lets through carries at most one
// grpc-timeout. Such a header is never passed on: core's header decoder fails on some of
// them without taking them into its header table, and every later call on the connection
// then failed the same way. What core does, and so the Python front end without the gateway:
//   - a name with a character gRPC's metadata keys do not have (0-9 a-z _ - .), though
//     HTTP/2 allows it: INTERNAL, "Illegal header key: <name>";
//   - a header it parses into a typed value (te, grpc-timeout, grpc-encoding, ...: coreParsed)
//     with a value it cannot parse, or a binary one (-bin) that is not base64: INTERNAL,
//     "Error parsing '<name>' metadata". A te other than "trailers", or two te headers,
//     never get here: net/http's HTTP/2 server answers the request HTTP 400 itself, before
//     any handler and with no hook to do otherwise (RFC 9113 8.2.2: any other te makes the
//     request malformed; gRPC clients read the 400 as INTERNAL, core's status for it too;
//     docs/architecture.md, "Where it differs"). An empty te does get here;
//   - core names the first such header of the block; net/http hands the headers over without
//     their order, so with several the gateway names an illegal key first, then a header of
//     coreParsed in its order, then a binary one, each kind by name (docs/architecture.md,
//     "Where it differs");
//   - then, with every header parsed, no te header (gRPC requires "te: trailers", to detect
//     proxies that drop trailers): the stream is reset (RST_STREAM INTERNAL_ERROR);
//   - of several grpc-timeout headers the last counts (as in gRPC core and grpc-go).
func checkCallHeaders(w http.ResponseWriter, r *http.Request) bool {
	if message := headerRefusal(r.Header); message != "" {
		writeStatus(w, codeInternal, message)
		return true
	}
	if len(r.Header.Values("Te")) == 0 {
		panic(http.ErrAbortHandler) // RST_STREAM INTERNAL_ERROR, as gRPC core resets it
	}
	if timeouts := r.Header.Values("Grpc-Timeout"); len(timeouts) > 1 {
		r.Header["Grpc-Timeout"] = timeouts[len(timeouts)-1:]
	}
	return false
}

// coreParsed are the request headers gRPC core parses into typed values (its metadata
// traits, src/core/call/metadata_batch.h), each with whether core takes a value; every
// value of a header given more than once is parsed. Binary headers are checked apart.
var coreParsed = []struct {
	name  string // lower case, as on the wire
	valid func(value string) bool
}{
	{"te", func(v string) bool { return v == "trailers" }},
	{"grpc-timeout", func(v string) bool { _, _, valid := grpcTimeout(v); return valid && v != "" }},
	{"grpc-encoding", compressionAlgorithm},
	{"grpc-internal-encoding-request", compressionAlgorithm},
	{"grpc-status", func(v string) bool {
		n, ok := simpleAtoi(v, true)
		return ok && n >= 0 && n < math.MaxInt32 // GRPC_STATUS__DO_NOT_USE and past it: refused
	}},
	{"grpc-previous-rpc-attempts", func(v string) bool {
		n, ok := simpleAtoi(v, false)
		return ok && n <= math.MaxUint32
	}},
	{"grpc-retry-pushback-ms", func(v string) bool { _, ok := simpleAtoi(v, true); return ok }},
	{"grpclb_client_stats", func(string) bool { return false }}, // core's own, never a client's
}

// coreParsedAt is each coreParsed header's place, by its name as net/http keys it.
var coreParsedAt = map[string]int{}

func init() {
	for i, h := range coreParsed {
		coreParsedAt[http.CanonicalHeaderKey(h.name)] = i
	}
}

// headerRefusal is core's status message refusing the call over its headers; "" when core
// takes them. One pass over the headers; names are lowered only to be named.
func headerRefusal(header http.Header) string {
	illegal, binary, parsed := "", "", len(coreParsed)
	for name, values := range header {
		switch {
		case !legalKey(name):
			illegal = first(illegal, strings.ToLower(name))
		case len(name) >= 4 && strings.EqualFold(name[len(name)-4:], "-bin"):
			if !binaryValuesValid(name, values) {
				binary = first(binary, strings.ToLower(name))
			}
		default:
			if at, known := coreParsedAt[name]; known && at < parsed && !allValid(coreParsed[at].valid, values) {
				parsed = at
			}
		}
	}
	switch {
	case illegal != "":
		return illegalHeaderKey(illegal)
	case parsed < len(coreParsed):
		return badMetadata(coreParsed[parsed].name)
	case binary == "lb-cost-bin" && binaryValuesValid("", header.Values(binary)):
		return badMetadata(binary) // base64, too short for the cost it holds
	case binary != "":
		return badBinaryHeader(binary)
	}
	return ""
}

// first is the first of two names in order ("": none yet).
func first(name, other string) string {
	if name == "" || other < name {
		return other
	}
	return name
}

func allValid(valid func(string) bool, values []string) bool {
	for _, value := range values {
		if !valid(value) {
			return false
		}
	}
	return true
}

// binaryValuesValid is whether core decodes every value of a binary header, and takes it
// (name: the header's, any case): lb-cost-bin holds a cost, a float64, then a name.
func binaryValuesValid(name string, values []string) bool {
	for _, value := range values {
		if !grpcBase64(value) {
			return false
		}
		unpadded := len(strings.TrimRight(value, "="))
		if base64.RawStdEncoding.DecodedLen(unpadded) < 8 && strings.EqualFold(name, "lb-cost-bin") {
			return false
		}
	}
	return true
}

// legalKey is whether a header name (in any case) has only the characters of gRPC's
// metadata keys: 0-9 a-z _ - .
func legalKey(name string) bool {
	for i := 0; i < len(name); i++ {
		c := name[i] | 0x20 // lower case for letters; the others are checked as they are
		letter := c >= 'a' && c <= 'z'
		if !letter && !(name[i] >= '0' && name[i] <= '9') && name[i] != '_' && name[i] != '-' && name[i] != '.' {
			return false
		}
	}
	return true
}

// compressionAlgorithm is whether core knows an encoding's name (ParseCompressionAlgorithm).
func compressionAlgorithm(name string) bool {
	return name == "identity" || name == "deflate" || name == "gzip"
}

// simpleAtoi reads an integer as absl::SimpleAtoi, core's parser for integer headers, reads
// it into an int64 (signed) or uint64: ASCII whitespace around it, one optional sign, decimal
// digits; false past the type's range, and for any sign but '+' on an unsigned one.
func simpleAtoi(value string, signed bool) (int64, bool) {
	value = strings.Trim(value, " \t\n\v\f\r")
	digits := strings.TrimLeft(value, "+-")
	if len(value)-len(digits) > 1 || digits == "" || strings.Trim(digits, "0123456789") != "" {
		return 0, false
	}
	if signed {
		n, err := strconv.ParseInt(value, 10, 64)
		return n, err == nil
	}
	if strings.HasPrefix(value, "-") {
		return 0, false
	}
	n, err := strconv.ParseUint(digits, 10, 64)
	return int64(min(n, math.MaxInt64)), err == nil
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

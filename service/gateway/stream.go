package main

// Streaming calls on the fast path: V2 ModelStreamInfer and attention.v1 AttendStream. The
// gateway owns the stream. A plain message is answered here exactly as a plain unary call
// is; any other message goes, as it came, into one stream of the same method that the
// gateway opens to the Python front end when first needed (a message with the compressed
// flag set included: the call declared no encoding, and gRPC core reads it as it is), and
// Python's answers join the client's stream. As the Python front end's streams
// (service/frontend/streaming.py):
//   - answers go out in completion order, each as the method's stream response; an error
//     is a message of its own and the stream goes on;
//   - at most --max-stream-inflight-requests messages are unanswered, and their answers'
//     bytes stay under --max-stream-pending-bytes: past either, reading stops and HTTP/2
//     flow control holds the client back;
//   - the call's deadline is every message's; a call that ends early (cancelled, client
//     gone, deadline) drops its messages in the worker before compute;
//   - on shutdown a stream stops reading, answers what it read, and ends UNAVAILABLE.
// A message whose compressed-flag byte is neither 0 nor 1 ends the call INTERNAL, as grpc-go
// ends it (gRPC core would read nothing after it and end the call OK).

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// streamMethod is what one streaming method plugs in.
type streamMethod struct {
	api   string // the metrics' label of each message
	parse func([]byte) *inferRequest
	// ok wraps a unary answer as the stream's response; failure is one message's error.
	ok      func(req *inferRequest, answer [][]byte) [][]byte
	failure func(req *inferRequest, code int, message string) [][]byte
}

var streamMethods = map[string]*streamMethod{
	modelStreamInferPath: {api: apiV2Stream, parse: parseInfer, ok: v2StreamAnswer, failure: v2StreamError},
	attendStreamPath:     {api: apiAttentionStream, parse: parseAttend, ok: attendStreamAnswer, failure: attendStreamError},
}

// streamLimits are the per-stream bounds.
type streamLimits struct {
	maxInflight int
	maxPending  int64
}

// stream is one streaming call being served.
type stream struct {
	fp      *fastPath
	gateway *gateway
	method  *streamMethod
	r       *http.Request
	limits  streamLimits
	// ctx ends when the client goes, at the deadline, or when Python's part of the
	// stream fails (its cause then says how the call ends).
	ctx      context.Context
	end      context.CancelCauseFunc
	deadline time.Time // zero: none
	answers  chan streamAnswer
	room     chan struct{} // an answer was written: reading may go on
	readDone chan struct{}
	// requestsRead counts the messages read whole (for the end's log line).
	requestsRead atomic.Int64

	mu       sync.Mutex // the fields below
	inflight int        // messages read here and not yet written
	pending  int64      // their answers' bytes
	stopped  bool       // no more messages are taken
	closed   bool       // stopped by shutdown
	python   *pythonPart
	tasks    sync.WaitGroup
}

// streamAnswer is one message for the client, with what it holds until written.
type streamAnswer struct {
	segments    [][]byte // the message, the first segment starting with the 5-byte prefix
	free        func()   // shared memory the segments reference; nil: none
	hold        *reservation
	bytes       int64          // in the stream's pending bound (0: Python's answer)
	count       func(code int) // counts an OK answer once its fate is known; nil: not here
	undelivered int            // a Python answer's bytes in the undelivered gauge
	metrics     *metrics
}

// pythonFailed is Python's part of a stream ending with an error: the whole call ends so.
type pythonFailed struct{ status, message string }

func (p pythonFailed) Error() string { return "python: grpc-status " + p.status }

// streamRefused is the gateway ending a stream with an error of its own.
type streamRefused struct {
	code    int
	message string // as written, before percent-encoding
}

func (r streamRefused) Error() string { return r.message }

func (g *gateway) serveStream(w http.ResponseWriter, r *http.Request, method *streamMethod) {
	started := time.Now()
	fp := g.fast
	fp.inFlight.Add(1)
	defer fp.inFlight.Done()
	select {
	case <-fp.closing: // the drain stopped taking work: none of its requests was read
		writeStatus(w, codeUnavailable, notAccepting)
		logStreamEnded(r, method.api, codeUnavailable, time.Since(started), 0)
		return
	default:
	}
	ctx, end := context.WithCancelCause(r.Context())
	defer end(nil)
	s := &stream{fp: fp, gateway: g, method: method, r: r, limits: fp.streams, ctx: ctx, end: end,
		answers: make(chan streamAnswer, fp.streams.maxInflight), room: make(chan struct{}, 1),
		readDone: make(chan struct{})}
	if t, set, _ := grpcTimeout(r.Header.Get("Grpc-Timeout")); set {
		s.deadline = time.Now().Add(t)
		var cancel context.CancelFunc
		s.ctx, cancel = context.WithDeadline(ctx, s.deadline)
		defer cancel()
		// A client that stops reading must not hold the handler long past the deadline
		// (net/http resets the stream then: stuckWriterGrace later, so the status goes first).
		_ = http.NewResponseController(w).SetWriteDeadline(s.deadline.Add(stuckWriterGrace))
	}
	go s.read(r.Body)
	go s.finish()
	code := s.write(w)
	logStreamEnded(r, method.api, code, time.Since(started), s.requestsRead.Load())
}

// finish ends the stream's input once the client half-closed, the call ended or the server
// shuts down; then waits for every answer, and closes the answers.
func (s *stream) finish() {
	select {
	case <-s.readDone:
	case <-s.ctx.Done():
	case <-s.fp.closing:
	}
	s.mu.Lock()
	s.stopped = true
	select {
	case <-s.readDone:
	default:
		s.closed = s.ctx.Err() == nil // stopped by shutdown, not by the call's end
	}
	s.mu.Unlock()
	// The reader stops before its next message: one it has read whole is still taken
	// (computed here, or handed to Python's part), so that "every request read from this
	// stream was answered" holds; one it is still reading is dropped unread.
	_ = s.r.Body.Close()
	<-s.readDone
	s.mu.Lock()
	python := s.python
	s.mu.Unlock()
	s.tasks.Wait()
	if python != nil {
		python.pipe.Close() // half-closes Python's part: it answers what it has, then ends
		<-python.done
	}
	close(s.answers)
}

// write sends the answers as they come, then the call's status; the code the call ended with.
func (s *stream) write(w http.ResponseWriter) int {
	started, broken := false, false
	for a := range s.answers {
		// Once the call has ended (deadline, Python's part failed) what is left is dropped.
		broken = broken || s.ended()
		if !broken {
			if !started {
				h := w.Header()
				h.Set("Content-Type", "application/grpc")
				h.Set("Grpc-Accept-Encoding", acceptEncoding)
				w.WriteHeader(http.StatusOK)
				started = true
			}
			err := writeSegments(w, a.segments, a.takeFree())
			if err == nil && len(s.answers) == 0 {
				err = flush(w) // more answers ready go out with this one
			}
			broken = err != nil
		}
		if broken {
			a.settle(s.unwritten())
		} else {
			a.settle(codeOK)
		}
		s.written(a.bytes)
	}
	code, message := s.status()
	if s.r.Context().Err() != nil {
		return s.unwritten() // the client has gone: no one to tell
	}
	h := w.Header()
	prefix := "" // trailers-only: the status in the answer's one HEADERS frame
	if started {
		prefix = http.TrailerPrefix // trailers not announced in a "Trailer" header, as gRPC's
	}
	h.Set("Content-Type", "application/grpc")
	h.Set(prefix+"Grpc-Status", strconv.Itoa(code))
	if message != "" {
		h.Set(prefix+"Grpc-Message", message)
	}
	if !started {
		w.WriteHeader(http.StatusOK)
	}
	return code
}

// ended says whether the call is over: its context ended, or its deadline has passed before
// the context's timer fired (a message's own deadline timer in compute can fire first, and
// its DEADLINE_EXCEEDED is the call's end, not an answer to write; Python writes none).
func (s *stream) ended() bool {
	return s.ctx.Err() != nil || (!s.deadline.IsZero() && !time.Now().Before(s.deadline))
}

// status is how the call ends: its code and grpc-message (already percent-encoded).
func (s *stream) status() (int, string) {
	var failure pythonFailed
	var refused streamRefused
	cause := context.Cause(s.ctx)
	s.mu.Lock()
	closed := s.closed // by shutdown, while the call was live: Python's part may then end torn
	s.mu.Unlock()
	switch {
	case errors.Is(cause, context.DeadlineExceeded):
		return codeDeadlineExceeded, grpcMessage(deadlineExceeded)
	case closed:
		return codeUnavailable, grpcMessage(streamClosed)
	case cause == nil && !s.deadline.IsZero() && !time.Now().Before(s.deadline):
		// Past the deadline before its timer fired: a call whose deadline has passed ends
		// DEADLINE_EXCEEDED, whatever was answered before (as the Python front end ends it).
		return codeDeadlineExceeded, grpcMessage(deadlineExceeded)
	case errors.As(cause, &refused):
		return refused.code, grpcMessage(refused.message)
	case errors.As(cause, &failure):
		code, err := strconv.Atoi(failure.status)
		if err != nil {
			return codeInternal, grpcMessage(streamEndedWithoutStatus)
		}
		return code, failure.message
	}
	return codeOK, ""
}

func (a *streamAnswer) takeFree() func() { return take(&a.free) }

// unwritten is how an OK answer that will never be written counts: DEADLINE_EXCEEDED once
// the stream's deadline has come (a unary call's answer counts so), else CANCELLED.
func (s *stream) unwritten() int {
	if !s.deadline.IsZero() && time.Until(s.deadline) <= s.fp.deadlineSlack {
		return codeDeadlineExceeded
	}
	return codeCancelled
}

// settle gives back what the answer held; an OK answer counts now, as code (codeOK if it was
// written, else what unwritten says).
func (a *streamAnswer) settle(code int) {
	a.takeFree()()
	if a.hold != nil {
		a.hold.release()
		a.hold = nil
	}
	if a.undelivered != 0 {
		a.metrics.undelivered(-float64(a.undelivered))
		a.undelivered = 0
	}
	if a.count != nil {
		a.count(code)
		a.count = nil
	}
}

// written frees a message's place in the stream's bounds.
func (s *stream) written(answerBytes int64) {
	if answerBytes == 0 {
		return
	}
	s.mu.Lock()
	s.inflight--
	s.pending -= answerBytes
	s.mu.Unlock()
	select {
	case s.room <- struct{}{}:
	default:
	}
}

// read takes the client's messages until it half-closes, the call ends or the stream stops.
func (s *stream) read(body io.Reader) {
	defer close(s.readDone)
	for s.waitForRoom() {
		var prefix [5]byte
		n, err := io.ReadFull(body, prefix[:])
		if n > 0 {
			s.gateway.taken.Add(1) // a message is activity: the idle hand-back waits for a quiet stream
		}
		if err != nil {
			if errors.Is(err, io.ErrUnexpectedEOF) {
				s.forward(bytes.NewReader(prefix[:n])) // Python's part says what a torn message is
			}
			return
		}
		length := int64(binary.BigEndian.Uint32(prefix[1:5]))
		if length > s.gateway.maxReceive {
			// Larger than a message may be: Python's part refuses it as the Python front
			// end refuses it, without this process holding it, and that ends the call:
			// nothing after it is read.
			s.forward(io.MultiReader(bytes.NewReader(prefix[:]), io.LimitReader(body, length)))
			return
		}
		buffer, ok := readMessage(body, prefix[:], int(length))
		if !ok {
			s.forward(bytes.NewReader(buffer))
			return
		}
		s.requestsRead.Add(1)
		taken := false
		switch prefix[0] {
		case 0:
			taken = s.take(buffer)
		case 1:
			// The compressed flag in a call that declared no encoding (a compressed call
			// is Python's whole): gRPC core reads the message as it is, so Python's part
			// answers it as the Python front end would, and the stream goes on.
			taken = s.forward(bytes.NewReader(buffer))
			recycle(buffer)
		default:
			// A flag byte gRPC gives no meaning: the call ends INTERNAL once the message is
			// whole, as grpc-go ends it. gRPC core would read nothing of the call after it
			// and end it OK, so it is never handed on.
			recycle(buffer)
			s.end(streamRefused{codeInternal, unexpectedPayloadFormat(int(prefix[0]))})
		}
		if !taken {
			return
		}
	}
}

// readMessage reads a message's bytes after its prefix into a pooled buffer, grown as the
// bytes arrive: a client that declares a large message and sends five bytes must not make
// this process allocate the large size. It may take a kept buffer that fits (the shelf
// holds shelfBytes at most), read into without a copy.
// false (with what was read) when the body ended first.
func readMessage(body io.Reader, prefix []byte, length int) ([]byte, bool) {
	need := 5 + length
	var buffer []byte
	if need > maxPooledBuffer && need <= slabReleaseBytes {
		buffer = largeBuffers.take(need) // nil when none is kept: grown as the body comes
	}
	if buffer == nil {
		buffer = (*buffers.Get().(*[]byte))[:0]
	}
	buffer = append(buffer, prefix...)
	for len(buffer) < need {
		if len(buffer) == cap(buffer) {
			grown := make([]byte, len(buffer), min(need, max(2*cap(buffer), 64<<10)))
			copy(grown, buffer)
			if cap(buffer) <= maxPooledBuffer { // larger ones, smaller than need, would fill the shelf
				recycle(buffer)
			}
			buffer = grown
		}
		n, err := body.Read(buffer[len(buffer):min(cap(buffer), need)])
		buffer = buffer[:len(buffer)+n]
		if err != nil && len(buffer) < need {
			return buffer, false
		}
	}
	return buffer, true
}

// take answers a plain message here and hands any other to Python's part; false when
// Python's part has ended (the stream takes no more).
func (s *stream) take(buffer []byte) bool {
	req := s.method.parse(buffer[5:])
	order := &s.fp.worker.order
	order.RLock()
	var p *plan
	if req != nil {
		p = req.check(s.fp.worker.snapshot(), s.fp.limits)
	}
	if p == nil {
		order.RUnlock()
		ok := s.forward(bytes.NewReader(buffer))
		recycle(buffer)
		return ok
	}
	answerBytes := max(1, p.answerBytes())
	s.mu.Lock() // read whole: taken even once the stream stopped (finish waits for the reader)
	s.inflight++
	s.pending += answerBytes
	s.tasks.Add(1)
	s.mu.Unlock()
	go s.answer(req, p, buffer, answerBytes, sync.OnceFunc(order.RUnlock))
	return true
}

// waitForRoom returns once another message may be read (false: the stream takes no more).
func (s *stream) waitForRoom() bool {
	for {
		s.mu.Lock()
		stopped := s.stopped
		room := s.inflight < s.limits.maxInflight && s.pending < s.limits.maxPending
		s.mu.Unlock()
		if stopped {
			return false
		}
		if room {
			return true
		}
		select {
		case <-s.room:
		case <-s.ctx.Done():
			return false
		case <-s.fp.closing:
			return false
		}
	}
}

// answer computes one plain message and queues its answer for the writer.
func (s *stream) answer(req *inferRequest, p *plan, buffer []byte, answerBytes int64, sent func()) {
	defer s.tasks.Done()
	api := s.method.api
	started := time.Now()
	req.trace = s.fp.sampler.sample(s.r.Header, started) // a span per message, as Python's
	s.gateway.busy.Add(1)
	s.fp.metrics.inFlight(api, 1)
	o := s.fp.compute(s.ctx, s.r.RemoteAddr, req, p, s.deadline, sent)
	defer s.fp.traced(s.r.RequestURI, req, p, o.code, time.Now())
	s.fp.metrics.inFlight(api, -1)
	s.gateway.busy.Add(-1)
	recycle(buffer) // its tensor is in shared memory by now (or never will be)
	seconds := o.answered.Sub(started).Seconds()
	count := func(code int) { s.fp.metrics.finished(p.model.Name, api, code, seconds) }
	a := streamAnswer{bytes: answerBytes}
	switch {
	case o.code == codeOK:
		a.segments, a.free, a.hold, a.count = s.method.ok(req, o.segments), o.takeFree(), o.hold, count
		o.hold = nil
	case s.ended(): // the call has ended: nothing is written
		count(o.code)
		o.release()
		s.written(answerBytes)
		return
	default:
		count(o.code) // an error counts at once, as the Python front end counts it
		a.segments = s.method.failure(req, o.code, o.message)
		o.release()
	}
	select {
	case s.answers <- a:
	case <-s.ctx.Done():
		a.settle(s.unwritten())
		s.written(answerBytes)
	}
}

// pythonPart is the stream of the same method opened to the Python front end for the
// messages this process does not answer.
type pythonPart struct {
	pipe *io.PipeWriter
	done chan struct{}
}

// forward writes message bytes into Python's part, opening it first; false once it has
// ended.
func (s *stream) forward(message io.Reader) bool {
	s.mu.Lock() // read whole: handed on even once the stream stopped (finish waits for the reader)
	if s.python == nil {
		s.python = s.openPython()
	}
	python := s.python
	s.mu.Unlock()
	_, err := io.Copy(python.pipe, message)
	return err == nil
}

func (s *stream) openPython() *pythonPart {
	body, pipe := io.Pipe()
	out, _ := http.NewRequestWithContext(s.ctx, http.MethodPost, backendURL.String()+s.r.URL.Path, body)
	out.Host = s.r.Host
	out.Header = s.r.Header.Clone()
	tellCaller(out.Header, s.r)
	out.Header.Set(streamPartHeader, "1") // this process ends it in the drain, not Python
	if !s.deadline.IsZero() {
		out.Header.Set("Grpc-Timeout", formatTimeout(time.Until(s.deadline)))
	}
	python := &pythonPart{pipe: pipe, done: make(chan struct{})}
	go s.relayPython(out, body, python.done)
	return python
}

// relayPython queues Python's answers for the writer and ends the call with Python's
// status when that is an error.
func (s *stream) relayPython(out *http.Request, body *io.PipeReader, done chan<- struct{}) {
	defer close(done)
	resp, err := s.gateway.backend.RoundTrip(out)
	if err != nil {
		body.CloseWithError(err)
		if s.ctx.Err() == nil {
			s.end(pythonFailed{strconv.Itoa(codeUnavailable), grpcMessage(backendGone)})
		}
		return
	}
	defer resp.Body.Close()
	for {
		var prefix [5]byte
		if _, err := io.ReadFull(resp.Body, prefix[:]); err != nil {
			break
		}
		message := make([]byte, 5+int(binary.BigEndian.Uint32(prefix[1:5])))
		copy(message, prefix[:])
		if _, err := io.ReadFull(resp.Body, message[5:]); err != nil {
			break
		}
		s.fp.metrics.undelivered(float64(len(message)))
		a := streamAnswer{segments: [][]byte{message}, undelivered: len(message), metrics: s.fp.metrics}
		select {
		case s.answers <- a:
		case <-s.ctx.Done():
			a.settle(s.unwritten()) // Python's answer: counted there, not here (no count)
			return
		}
	}
	status := resp.Trailer.Get("Grpc-Status")
	message := resp.Trailer.Get("Grpc-Message")
	if status == "" { // trailers-only
		status, message = resp.Header.Get("Grpc-Status"), resp.Header.Get("Grpc-Message")
	}
	if status != "0" && s.ctx.Err() == nil {
		s.end(pythonFailed{status, message})
	}
}

// formatTimeout writes a grpc-timeout header value (at most 8 digits).
func formatTimeout(d time.Duration) string {
	d = max(d, time.Microsecond)
	for _, unit := range []struct {
		size time.Duration
		name string
	}{{time.Microsecond, "u"}, {time.Millisecond, "m"}, {time.Second, "S"}, {time.Hour, "H"}} {
		if amount := (d + unit.size - 1) / unit.size; amount < 100_000_000 {
			return strconv.FormatInt(int64(amount), 10) + unit.name
		}
	}
	return "99999999H"
}

// v2StreamAnswer is a ModelStreamInferResponse holding the ModelInferResponse.
func v2StreamAnswer(_ *inferRequest, answer [][]byte) [][]byte {
	return nested(nil, fieldModelStreamInferResponseInferResponse, answer)
}

// v2StreamError is Triton's stream error: the message, and the request's id and model so
// the client can tell which request failed.
func v2StreamError(req *inferRequest, _ int, message string) [][]byte {
	var inner []byte
	inner = appendNonEmpty(inner, fieldModelInferResponseModelName, req.modelName)
	inner = appendNonEmpty(inner, fieldModelInferResponseModelVersion, req.modelVersion)
	inner = appendNonEmpty(inner, fieldModelInferResponseID, req.id)
	m := make([]byte, 5, 5+len(message)+len(inner)+16)
	m = appendNonEmpty(m, fieldModelStreamInferResponseErrorMessage, message)
	return [][]byte{appendBytesField(m, fieldModelStreamInferResponseInferResponse, inner)}
}

// attendStreamAnswer is an AttendStreamResponse holding the AttendResponse.
func attendStreamAnswer(req *inferRequest, answer [][]byte) [][]byte {
	head := appendNonEmpty(nil, fieldAttendStreamResponseRequestID, req.id)
	return nested(head, fieldAttendStreamResponseResponse, answer)
}

func attendStreamError(req *inferRequest, code int, message string) [][]byte {
	var inner []byte
	inner = appendVarintField(inner, fieldStreamErrorCode, uint64(code))
	inner = appendNonEmpty(inner, fieldStreamErrorMessage, message)
	m := make([]byte, 5, 5+len(message)+len(req.id)+16)
	m = appendNonEmpty(m, fieldAttendStreamResponseRequestID, req.id)
	return [][]byte{appendBytesField(m, fieldAttendStreamResponseError, inner)}
}

// nested is a message of the fields head, then inner (segments, the first with room for
// the 5-byte prefix) as field num; inner's segments are kept, not copied.
func nested(head []byte, num int, inner [][]byte) [][]byte {
	size := -5
	for _, s := range inner {
		size += len(s)
	}
	first := make([]byte, 5, 5+len(head)+16+len(inner[0]))
	first = append(first, head...)
	first = appendVarint(appendTag(first, num, wireBytes), uint64(size))
	first = append(first, inner[0][5:]...)
	return append([][]byte{first}, inner[1:]...)
}

// appendNonEmpty writes a string field, left out when empty (proto3's default).
func appendNonEmpty(b []byte, num int, value string) []byte {
	if value == "" {
		return b
	}
	return appendStringField(b, num, value)
}

package main

// V2 ModelInfer on the fast path: a request this gateway can answer exactly as the Python
// front end would (a served model, raw FP32/FP16 bytes of the model's dtype or a client
// shared-memory region holding them, the right shape, finite values, no parameters but
// the region references) is decoded from the wire into shared memory and answered from it
// here. Anything else goes to the Python front end, which answers it with
// the same errors and features as always: one place decides every error message.

import (
	"context"
	"encoding/binary"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
)

// inferRequest is a plain call of either API in the same terms.
type inferRequest struct {
	api                         string // the metrics' label: apiV2 or apiAttention
	modelName, modelVersion, id string
	datatype                    string // V2's name: FP32 or FP16
	shape                       []int64
	raw                         []byte
	outputs                     []string
	inRef                       *shmRef            // the input in a client's region
	outRefs                     map[string]*shmRef // outputs asked for in a client's region
	weights                     bool               // Attend: return_attention_weights
	flat                        bool               // Attend: [seq, d] in, [seq, d] out
	trace                       *callTrace         // nil: not sampled (or tracing off)
}

// parseInfer reads a ModelInferRequest; nil when it is not plain (the Python front end
// then decides what it is).
func parseInfer(msg []byte) *inferRequest {
	req := &inferRequest{api: apiV2}
	inputs, raws := 0, 0
	plain := true
	err := eachField(msg, func(f field) error {
		switch f.num {
		case fieldModelInferRequestModelName:
			plain = stringField(f, &req.modelName) && plain
		case fieldModelInferRequestModelVersion:
			plain = stringField(f, &req.modelVersion) && plain
		case fieldModelInferRequestID:
			plain = stringField(f, &req.id) && plain
		case fieldModelInferRequestInputs:
			inputs++
			plain = plain && f.wire == wireBytes && req.parseInput(f.bytes)
		case fieldModelInferRequestOutputs:
			name, ref, ok := parseOutput(f)
			plain = plain && ok
			req.outputs = append(req.outputs, name)
			if ref != nil {
				if req.outRefs == nil {
					req.outRefs = map[string]*shmRef{}
				}
				req.outRefs[name] = ref
			}
		case fieldModelInferRequestRawInputContents:
			raws++
			if f.wire != wireBytes {
				plain = false
			}
			req.raw = f.bytes
		case fieldModelInferRequestParameters: // the Python front end says which it tolerates
			plain = false
		}
		return nil
	})
	// The input's bytes in the message, or in a client's region and not in the message.
	if err != nil || !plain || inputs != 1 || raws != btoi(req.inRef == nil) {
		return nil
	}
	return req
}

// stringField reads a string field into into; false when it is not valid UTF-8 bytes.
func stringField(f field, into *string) bool {
	if f.wire != wireBytes || !utf8.Valid(f.bytes) {
		return false
	}
	*into = string(f.bytes)
	return true
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (req *inferRequest) parseInput(msg []byte) bool {
	plain, named := true, false // an input without a name is Python's to refuse
	params := newRefParams()
	err := eachField(msg, func(f field) error {
		var err error
		switch f.num {
		case fieldInferInputTensorName:
			plain = plain && f.wire == wireBytes && string(f.bytes) == inputName
			named = true
		case fieldInferInputTensorDatatype:
			plain = plain && f.wire == wireBytes && utf8.Valid(f.bytes) // every value, not the last
			req.datatype = string(f.bytes)
		case fieldInferInputTensorShape:
			req.shape, err = readInt64s(f, req.shape)
		case fieldInferInputTensorParameters:
			params.add(f, toleratedInputParams)
		case fieldInferInputTensorContents: // typed contents
			plain = false
		}
		return err
	})
	ref, ok := params.ref("input '" + inputName + "'")
	req.inRef = ref
	return err == nil && plain && named && ok
}

// parseOutput reads a requested output: its name and any region it is to be written into.
func parseOutput(f field) (string, *shmRef, bool) {
	if f.wire != wireBytes {
		return "", nil, false
	}
	name, plain := "", true
	params := newRefParams()
	err := eachField(f.bytes, func(g field) error {
		switch g.num {
		case fieldInferRequestedOutputTensorName:
			plain = plain && g.wire == wireBytes && utf8.Valid(g.bytes)
			name = string(g.bytes)
		case fieldInferRequestedOutputTensorParameters:
			params.add(g, toleratedOutputParams)
		}
		return nil
	})
	ref, ok := params.ref("output '" + name + "'") // the names allowed need no escaping
	return name, ref, err == nil && plain && ok && (name == outputName || name == weightsName)
}

// limits are the Python front end's input bounds (--max-seq-len, --max-batch-size), and
// whether tensors may be in client shared memory (--client-shared-memory).
type limits struct {
	maxSeqLen, maxBatchSize int64
	clientSharedMemory      bool
}

// resolve finds the model version a plain request names: empty name = the default model,
// empty version = the newest; nil when it names none (the Python front end says so).
func (s *served) resolve(name, version string) *modelInfo {
	if name == "" {
		name = s.defaultModel
	}
	versions := s.models[name]
	if version == "" {
		var newest *modelInfo
		for _, m := range versions {
			if newest == nil || m.Version > newest.Version {
				newest = m
			}
		}
		return newest
	}
	v, err := strconv.ParseInt(version, 10, 64)
	if err != nil || strconv.FormatInt(v, 10) != version {
		return nil
	}
	return versions[v]
}

// finite reports whether every value of raw (little-endian, of size 2 or 4) is finite: none
// has every exponent bit set. Each 8-byte word is two or four values (lanes): adding one to
// a lane's exponent field carries into the lane's top bit only when the field is all ones,
// and never into the next lane. The main loop takes eight words a turn, from a subslice
// whose length the compiler knows (no bounds check per word), into four accumulators:
// 30 GB/s on an AMD EPYC core, three times a loop of four words into one accumulator.
func finite(raw []byte, size int64) bool {
	exponent, one, top := uint64(0x7f8000007f800000), uint64(0x0080000000800000), uint64(0x8000000080000000)
	if size == 2 {
		exponent, one, top = 0x7c007c007c007c00, 0x0400040004000400, 0x8000800080008000
	}
	var s0, s1, s2, s3 uint64
	i := 0
	for ; i+64 <= len(raw); i += 64 {
		w := raw[i : i+64 : i+64]
		s0 |= (lanes(w[0:])&exponent + one) | (lanes(w[32:])&exponent + one)
		s1 |= (lanes(w[8:])&exponent + one) | (lanes(w[40:])&exponent + one)
		s2 |= (lanes(w[16:])&exponent + one) | (lanes(w[48:])&exponent + one)
		s3 |= (lanes(w[24:])&exponent + one) | (lanes(w[56:])&exponent + one)
	}
	seen := s0 | s1 | s2 | s3
	for ; i+8 <= len(raw); i += 8 {
		seen |= lanes(raw[i:])&exponent + one
	}
	if seen&top != 0 {
		return false
	}
	return finiteTail(raw[i:], size)
}

// lanes is the word at the start of b: two float32 or four float16 values of a tensor (not
// an IPC field, whose offsets are generated).
func lanes(b []byte) uint64 { return binary.LittleEndian.Uint64(b) }

// finiteTail is finite for the last few bytes (fewer than eight), a value at a time.
func finiteTail(raw []byte, size int64) bool {
	if size == 4 {
		for i := 0; i+4 <= len(raw); i += 4 {
			if binary.LittleEndian.Uint32(raw[i:])&0x7f800000 == 0x7f800000 {
				return false
			}
		}
		return true
	}
	for i := 0; i+2 <= len(raw); i += 2 {
		if binary.LittleEndian.Uint16(raw[i:])&0x7c00 == 0x7c00 {
			return false
		}
	}
	return true
}

// plan is a plain request checked against its model: what to reserve and send.
type plan struct {
	model    *modelInfo
	dtype    dtypeInfo
	shape    [3]int64
	weights  bool
	outputs  []string
	outBytes int64
	wBytes   int64
	// Tensors in a client's region (nil: in the message and in this front end's slab).
	inRef, outRef, wRef *shmRef
}

// inRegions is whether any tensor of the call is in a client's region.
func (p *plan) inRegions() bool { return p.inRef != nil || p.outRef != nil || p.wRef != nil }

// answerBytes are the tensor bytes the answer carries in its message: the outputs asked
// for (none named: output alone), less those written into a client's region.
func (p *plan) answerBytes() int64 {
	n := int64(0)
	if p.outRef == nil && contains(p.outputs, outputName) {
		n += p.outBytes
	}
	if p.weights && p.wRef == nil {
		n += p.wBytes
	}
	return n
}

// slabSizes are the bytes each tensor takes in the slab, in the order input, output,
// weights; -1 for one not there (in a client's region, or weights not asked for).
func (p *plan) slabSizes(rawBytes int) [3]int {
	sizes := [3]int{-1, -1, -1}
	if p.inRef == nil {
		sizes[0] = rawBytes
	}
	if p.outRef == nil {
		sizes[1] = int(p.outBytes)
	}
	if p.weights && p.wRef == nil {
		sizes[2] = int(p.wBytes)
	}
	return sizes
}

func (req *inferRequest) check(s *served, lim limits) *plan {
	model := s.resolve(req.modelName, req.modelVersion)
	if model == nil || !s.ready {
		return nil
	}
	dtype, known := dtypes[model.Dtype]
	if !known || req.datatype != dtype.v2 || len(req.shape) != 3 {
		return nil
	}
	n, seq, d := req.shape[0], req.shape[1], req.shape[2]
	if n < 1 || seq < 1 || d != model.EmbedDim || n > lim.maxBatchSize || seq > lim.maxSeqLen {
		return nil
	}
	if (req.inRef != nil || req.outRefs != nil) && !lim.clientSharedMemory {
		return nil
	}
	// An input in a client's region: the worker checks its size and values once it reads it.
	if req.inRef == nil && (int64(len(req.raw)) != n*seq*d*dtype.size || !finite(req.raw, dtype.size)) {
		return nil
	}
	p := &plan{model: model, dtype: dtype, shape: [3]int64{n, seq, d}, inRef: req.inRef}
	for _, name := range req.outputs {
		if !contains(p.outputs, name) {
			p.outputs = append(p.outputs, name)
		}
	}
	if len(p.outputs) == 0 {
		p.outputs = []string{outputName}
	}
	p.weights = contains(p.outputs, weightsName)
	if p.weights && !model.HasWeightsGraph {
		return nil
	}
	p.outRef = req.outRefs[outputName]
	if p.weights {
		p.wRef = req.outRefs[weightsName]
	} else if req.outRefs[weightsName] != nil {
		return nil // a region for weights not asked for: the Python front end refuses it
	}
	p.outBytes = n * seq * d * dtype.size
	if p.weights {
		p.wBytes = 4 * n * model.NumHeads * seq * seq
	}
	return p
}

func contains(names []string, name string) bool {
	for _, n := range names {
		if n == name {
			return true
		}
	}
	return false
}

// fastPath answers plain ModelInfer calls; the rest it hands to fallback.
type fastPath struct {
	worker  *worker
	limits  limits
	metrics *metrics
	answers *answerBudget
	// A client's deadline timer fires before ours by the time the request took to arrive,
	// and it then cancels the call: one cancelled this close to its deadline expired.
	deadlineSlack time.Duration
	accepting     atomic.Bool
	answersHealth atomic.Bool   // the front end has started: health calls are answered here
	draining      atomic.Bool   // SIGTERM came: grpc.health.v1's entries are all NOT_SERVING
	closing       chan struct{} // closed when draining starts: streams stop reading
	graceOver     chan struct{} // closed a margin before the drain's end: calls still waiting fail
	streams       streamLimits
	inFlight      sync.WaitGroup // unary calls and streams
	sampler       *sampler       // nil: tracing off
	spans         *spanSink
}

// serve answers a plain call (req, nil when it was not one) and returns true, or returns
// false having written nothing.
func (fp *fastPath) serve(w http.ResponseWriter, r *http.Request, req *inferRequest) bool {
	if req == nil {
		return false
	}
	fp.worker.order.RLock()
	locked := true
	unlock := func() {
		if locked {
			locked = false
			fp.worker.order.RUnlock()
		}
	}
	defer unlock()
	p := req.check(fp.worker.snapshot(), fp.limits)
	if p == nil {
		return false
	}
	started := time.Now()
	req.trace = fp.sampler.sample(r.Header, started)
	fp.inFlight.Add(1)
	defer fp.inFlight.Done()
	fp.metrics.inFlight(req.api, 1)
	defer fp.metrics.inFlight(req.api, -1)
	code, answered := fp.infer(w, r, req, p, unlock)
	// Server time until the answer existed: a slow reader does not stretch it (as Python).
	fp.metrics.finished(p.model.Name, req.api, code, answered.Sub(started).Seconds())
	fp.traced(r.RequestURI, req, p, code, time.Now())
	logEnded(r, req, code, answered.Sub(started))
	return true
}

// traced hands a sampled call's record to the Python front end, which makes its spans.
func (fp *fastPath) traced(method string, req *inferRequest, p *plan, code int, ended time.Time) {
	if req.trace == nil {
		return
	}
	fp.spans.record(req.trace, callSpan{
		method: strings.TrimPrefix(method, "/"), code: code, answered: ended,
		model: p.model.Name, version: p.model.Version, sequences: p.shape[0], length: p.shape[1],
	})
}

func (fp *fastPath) infer(w http.ResponseWriter, r *http.Request, req *inferRequest, p *plan, sent func()) (int, time.Time) {
	if !fp.accepting.Load() { // draining: a stream's messages are still answered
		sent()
		writeStatus(w, codeUnavailable, notAccepting)
		return codeUnavailable, time.Now()
	}
	deadline := time.Time{}
	if t, set, _ := grpcTimeout(r.Header.Get("Grpc-Timeout")); set {
		deadline = time.Now().Add(t)
	}
	o := fp.compute(r.Context(), r.RemoteAddr, req, p, deadline, sent)
	defer o.release()
	if o.code == codeOK && !deadline.IsZero() && !time.Now().Before(deadline) {
		// Computed as the deadline passed: never an OK after it (gRPC core's deadline
		// timer ends the call then, with or without an answer ready).
		o.code, o.message = codeDeadlineExceeded, deadlineExceeded
	}
	if o.code != codeOK {
		if o.code != codeCancelled { // a cancelled call's client has gone
			writeStatus(w, o.code, o.message)
		}
		return o.code, o.answered
	}
	return fp.writeAnswer(w, &o, deadline), o.answered
}

// writeAnswer writes a computed call's answer and says how the call ended. A client that
// does not read it (its flow-control window closed) does not hold the call, and the answer's
// memory, long past the deadline: the stream is reset stuckWriterGrace after it (RST_STREAM;
// gRPC clients have given up by then, at their own deadline). gRPC core, which can drop an
// answer still waiting for the window, ends the call at the deadline with a
// DEADLINE_EXCEEDED status instead.
func (fp *fastPath) writeAnswer(w http.ResponseWriter, o *outcome, deadline time.Time) int {
	return writeBefore(w, o.segments, o.takeFree(), deadline, fp.deadlineSlack)
}

// writeBefore writes a call's one answer (writeMessage) and says how the call ended: OK,
// DEADLINE_EXCEEDED (its stream reset stuckWriterGrace after the deadline, the zero time
// for none, or the write failing at the deadline), or CANCELLED (the client went away).
func writeBefore(w http.ResponseWriter, segments [][]byte, free func(), deadline time.Time,
	slack time.Duration) (code int) {
	if !deadline.IsZero() {
		guard := resetAt(w, deadline.Add(stuckWriterGrace))
		// Stopped before the handler returns, even by a panic (the stream must not be
		// touched after), and before the trailers: a reset after the answer left is no OK.
		defer func() {
			if guard.stop() {
				code = codeDeadlineExceeded
			}
		}()
	}
	if err := writeMessage(w, segments, free); err != nil {
		if !deadline.IsZero() && time.Until(deadline) <= slack {
			return codeDeadlineExceeded
		}
		return codeCancelled // the client went away before it read the answer
	}
	return codeOK
}

// stuckWriterGrace: how long past a call's deadline an answer its client does not read may
// wait before the stream is reset. Not at the deadline itself: a reset (RST_STREAM
// INTERNAL_ERROR, net/http's only code for it) that beats the client's own deadline timer
// reaches a client that does read as INTERNAL, where it would see DEADLINE_EXCEEDED.
const stuckWriterGrace = time.Second

// writeGuard resets a call's stream at a time unless stopped first. A timer of its own
// rather than net/http's write deadline, which costs two messages to the connection's
// goroutine (set, then clear) on every call that has a deadline.
type writeGuard struct {
	mu      sync.Mutex
	stopped bool // the handler is done with the stream: it must not be touched after
	fired   bool
	timer   *time.Timer
}

func resetAt(w http.ResponseWriter, at time.Time) *writeGuard {
	g := &writeGuard{}
	g.timer = time.AfterFunc(time.Until(at), func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		if !g.stopped { // a write deadline in the past resets the stream at once
			g.fired = true
			_ = http.NewResponseController(w).SetWriteDeadline(time.Unix(1, 0))
		}
	})
	return g
}

// stop disarms the guard; true when it had already reset the stream.
func (g *writeGuard) stop() bool {
	g.timer.Stop()
	g.mu.Lock()
	defer g.mu.Unlock()
	g.stopped = true
	return g.fired
}

// outcome is a computed call: its status, and for OK its answer and what that holds.
type outcome struct {
	code     int
	message  string    // the status message, when not OK
	answered time.Time // when the answer (or the error) existed
	segments [][]byte  // OK: the answer, room for the 5-byte gRPC prefix first
	free     func()    // OK: gives back the shared memory the segments reference
	hold     *reservation
}

// takeFree hands over the duty to free the answer's shared memory (writeMessage's).
func (o *outcome) takeFree() func() { return take(&o.free) }

// take hands over the duty to call *f (nil: nothing to do), which is then nobody else's.
func take(f *func()) func() {
	duty := *f
	*f = nil
	if duty == nil {
		return func() {}
	}
	return duty
}

// release gives back what the outcome holds: once its answer was written, or never will be.
func (o *outcome) release() {
	o.takeFree()()
	if o.hold != nil {
		o.hold.release()
		o.hold = nil
	}
}

func failed(code int, message string) outcome {
	return outcome{code: code, message: message, answered: time.Now()}
}

// compute runs a plain call through the worker (ctx ends it early: the client cancelled or
// went away; deadline, when not zero, is the caller's). sent, which may be called more than
// once, is called once its INFER is on its way to the worker (or never will be).
func (fp *fastPath) compute(ctx context.Context, peer string, req *inferRequest, p *plan, deadline time.Time, sent func()) outcome {
	defer sent()
	l := fp.worker.use()
	if l == nil {
		if fp.draining.Load() { // the supervisor restarts no worker lost in a drain
			return failed(codeUnavailable, notAccepting)
		}
		return failed(codeUnavailable, workerRestarting)
	}
	linkHeld := true
	defer func() {
		if linkHeld {
			l.done()
		}
	}()
	// Refused here, by the worker's own rule and words, before the tensor is copied or the
	// worker asked, counting what this link sent that the worker has not read yet; the
	// worker still refuses what slips through between two updates.
	embeddingBytes := uint64(p.shape[0] * p.shape[1] * p.shape[2] * p.dtype.size)
	unread, unreadBytes := l.unread()
	if refusal := fp.worker.status.refusal(embeddingBytes, unread, unreadBytes); refusal != "" {
		return failed(codeResourceExhausted, refusal)
	}
	hold, refusal := fp.answers.reserve(peer, p.answerBytes())
	if refusal != "" {
		return failed(codeResourceExhausted, refusal)
	}
	holdKept := false
	defer func() {
		if !holdKept {
			hold.release()
		}
	}()
	sizes, slots := make([]int, 0, 3), make([]int, 0, 3) // slots: which tensor each is
	for slot, size := range p.slabSizes(len(req.raw)) {
		if size >= 0 {
			sizes, slots = append(sizes, size), append(slots, slot)
		}
	}
	regions, err := l.slab.alloc(sizes)
	if err != nil {
		return failed(codeResourceExhausted, err.Error())
	}
	at := [3]int64{-1, -1, -1} // offsets of input, output, weights in the slab
	for j, slot := range slots {
		at[slot] = int64(regions[j].offset)
	}
	inputParts := btoi(at[0] >= 0) // regions[:inputParts] hold the input
	if at[0] >= 0 {
		copy(l.slab.mem[at[0]:], req.raw)
	}
	workerDeadline := nanDeadline()
	var expired <-chan time.Time
	if !deadline.IsZero() {
		workerDeadline = monotonic() + time.Until(deadline).Seconds()
		timer := time.NewTimer(time.Until(deadline))
		defer timer.Stop()
		expired = timer.C
	}
	call := &pending{done: make(chan answer, 1), regions: regions, traced: req.trace != nil}
	l.mu.Lock()
	fp.worker.nextID++
	id := fp.worker.nextID
	l.calls[id] = call
	l.sentRequests++
	l.sentBytes += embeddingBytes
	l.mu.Unlock()
	var message []byte
	if p.inRegions() {
		message = inferRefsMessage(id, p, at, workerDeadline, req.trace)
	} else {
		message = inferMessage(id, p.weights, p.shape, at, workerDeadline, p.model.Key, p.dtype.numpy)
		if req.trace != nil {
			message = append(message, req.trace.tag()...)
		}
	}
	if !l.send(message) {
		l.slab.release(regions)
		return failed(codeUnavailable, workerGone)
	}
	sent()
	var a answer
	select {
	case a = <-call.done:
	case <-ctx.Done():
		code := codeCancelled
		if !deadline.IsZero() && time.Until(deadline) <= fp.deadlineSlack {
			code = codeDeadlineExceeded
		}
		return fp.abandon(l, id, call, code)
	case <-expired:
		return fp.abandon(l, id, call, codeDeadlineExceeded)
	case <-fp.graceOver:
		o := fp.abandon(l, id, call, codeUnavailable)
		o.message = gracePeriodEnded
		return o
	}
	if req.trace != nil {
		req.trace.done = a.done
	}
	if a.kind != "" {
		l.slab.release(regions)
		if code := codeOfKind(a.kind); code != codeInternal {
			return failed(code, a.message)
		}
		return failed(codeInternal, internalFailure(req, a.message)) // the worker's words stay in the logs
	}
	answers := answerTensors{out: l.slab.span(at[1], p.outBytes), weights: l.slab.span(at[2], p.wBytes)}
	var response [][]byte
	if req.api == apiAttention {
		response = attendResponse(req, p, answers, a)
	} else {
		response = v2Response(req, p, answers)
	}
	l.slab.release(regions[:inputParts]) // the input: read by the worker, not needed any more
	linkHeld, holdKept = false, true
	return outcome{code: codeOK, answered: time.Now(), segments: response, hold: hold,
		free: func() { l.slab.release(regions[inputParts:]); l.done() }}
}

// abandon gives up on a call: the worker drops it (or has computed it), and its regions
// are freed once the worker's final answer says it wrote nothing more into them.
func (fp *fastPath) abandon(l *link, id uint64, call *pending, code int) outcome {
	l.mu.Lock()
	_, waiting := l.calls[id]
	if waiting {
		call.abandoned = true
	}
	l.mu.Unlock()
	if waiting {
		// As Python writes it, without a map to marshal.
		prefix := `{"` + keyType + `":"` + messageCancel + `","` + keyID + `":`
		l.send(append(strconv.AppendUint([]byte(prefix), id, 10), '}'))
	} else {
		<-call.done // answered just as it was given up
		l.slab.release(call.regions)
	}
	if code == codeDeadlineExceeded {
		return failed(code, deadlineExceeded)
	}
	return failed(code, "")
}

// answerTensors are the answer's bytes in the slab; nil for one in a client's region (or
// not computed).
type answerTensors struct{ out, weights []byte }

// v2Response is the ModelInferResponse, its outputs referenced in shared memory; one
// written into a client's region names it in its parameters and has no bytes here.
func v2Response(req *inferRequest, p *plan, answers answerTensors) [][]byte {
	m := newMessage()
	m.built = appendStringField(m.built, fieldModelInferResponseModelName, p.model.Name)
	m.built = appendStringField(m.built, fieldModelInferResponseModelVersion, strconv.FormatInt(p.model.Version, 10))
	if req.id != "" {
		m.built = appendStringField(m.built, fieldModelInferResponseID, req.id)
	}
	for _, name := range p.outputs {
		var tensor []byte
		tensor = appendStringField(tensor, fieldInferOutputTensorName, name)
		if name == outputName {
			tensor = appendStringField(tensor, fieldInferOutputTensorDatatype, p.dtype.v2)
			tensor = appendPackedInt64s(tensor, fieldInferOutputTensorShape, p.shape[:])
		} else {
			weightsShape := []int64{p.shape[0], p.model.NumHeads, p.shape[1], p.shape[1]}
			tensor = appendStringField(tensor, fieldInferOutputTensorDatatype, weightsDatatype)
			tensor = appendPackedInt64s(tensor, fieldInferOutputTensorShape, weightsShape)
		}
		if ref := p.refOf(name); ref != nil {
			tensor = appendRefParameters(tensor, fieldInferOutputTensorParameters, ref)
		}
		m.built = appendBytesField(m.built, fieldModelInferResponseOutputs, tensor)
	}
	for _, name := range p.outputs {
		// raw_output_contents pair with outputs by position: empty for one in a region.
		data := answers.out
		if name == weightsName {
			data = answers.weights
		}
		m.bytesField(fieldModelInferResponseRawOutputContents, data)
	}
	return m.finish()
}

// refOf is the client region output name is written into; nil when none.
func (p *plan) refOf(name string) *shmRef {
	if name == weightsName {
		return p.wRef
	}
	return p.outRef
}

// nanDeadline is "no deadline" in the packed INFER.
func nanDeadline() float64 { return math.NaN() }

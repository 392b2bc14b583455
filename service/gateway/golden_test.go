package main

// The golden gRPC frames and trailers of tests/golden/grpc/, written from the Python protobuf
// classes and the Python front end's words (scripts/golden_grpc.py; checked on the Python
// side by tests/gateway/test_golden_frames.py): the gateway's own reader and parsers read
// each request as frames.json describes it, its own path (check, compute, encode, frame)
// writes each answer byte for byte, and it writes each refusal's trailers in the same
// words. A client cannot tell which side answered.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

var goldenDir = filepath.Join("..", "..", "tests", "golden", "grpc")

type goldenIndex struct {
	Model struct {
		Name     string `json:"name"`
		Version  int64  `json:"version"`
		EmbedDim int64  `json:"embed_dim"`
		NumHeads int64  `json:"num_heads"`
		Dtype    string `json:"dtype"`
	} `json:"model"`
	Frames map[string]goldenFrame `json:"frames"`
}

type goldenFrame struct {
	Message string          `json:"message"`
	Answers string          `json:"answers"` // an answer: the request it answers
	Refusal string          `json:"refusal"` // an error: the refusal it carries
	Fields  json.RawMessage `json:"fields"`
}

type goldenTrailer struct {
	By      string          `json:"by"` // "both", "gateway" or "python"
	Status  string          `json:"grpc-status"`
	Message string          `json:"grpc-message"`
	Args    json.RawMessage `json:"args"`
	Request string          `json:"request"`
}

// The frames' fields as frames.json describes them: protobuf's names, tensors as float32s.
type goldenParam struct {
	Bool   *bool   `json:"bool_param"`
	Int64  *int64  `json:"int64_param"`
	String *string `json:"string_param"`
}

type goldenTensor struct {
	Name       string                 `json:"name"`
	Datatype   string                 `json:"datatype"`
	Shape      []int64                `json:"shape"`
	Parameters map[string]goldenParam `json:"parameters"`
}

type goldenV2Request struct {
	ModelName    string         `json:"model_name"`
	ModelVersion string         `json:"model_version"`
	ID           string         `json:"id"`
	Inputs       []goldenTensor `json:"inputs"`
	Outputs      []goldenTensor `json:"outputs"`
	Raw          [][]float32    `json:"raw_input_contents"`
}

type goldenV2Response struct {
	Outputs []goldenTensor `json:"outputs"`
	Raw     [][]float32    `json:"raw_output_contents"`
}

type goldenAttendTensor struct {
	Shape []int64   `json:"shape"`
	Dtype string    `json:"dtype"`
	Data  []float32 `json:"data"`
}

type goldenAttendRequest struct {
	Model        string             `json:"model"`
	ModelVersion string             `json:"model_version"`
	RequestID    string             `json:"request_id"`
	Embeddings   goldenAttendTensor `json:"embeddings"`
	Weights      bool               `json:"return_attention_weights"`
}

type goldenAttendResponse struct {
	Output  goldenAttendTensor  `json:"output"`
	Weights *goldenAttendTensor `json:"attention_weights"`
	Timing  struct {
		QueueUs   int64 `json:"queue_us"`
		ComputeUs int64 `json:"compute_us"`
		BatchSize int64 `json:"batch_size"`
	} `json:"timing"`
}

func readGolden(t *testing.T) (goldenIndex, map[string]goldenTrailer) {
	t.Helper()
	var index goldenIndex
	var trailers map[string]goldenTrailer
	for name, into := range map[string]any{"frames.json": &index, "trailers.json": &trailers} {
		data, err := os.ReadFile(filepath.Join(goldenDir, name))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(data, into); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	return index, trailers
}

func goldenBytes(t *testing.T, frame string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(goldenDir, frame+".frame"))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func decode(t *testing.T, raw json.RawMessage, into any) {
	t.Helper()
	if err := json.Unmarshal(raw, into); err != nil {
		t.Fatalf("%s: %v", raw, err)
	}
}

// goldenRequest reads a request frame as a unary call's body, with the gateway's reader and
// the parser of its method; nil when it is not plain.
func goldenRequest(t *testing.T, index goldenIndex, name string) *inferRequest {
	t.Helper()
	g := &gateway{maxReceive: 1 << 20}
	_, message, ok := g.readUnary(bytes.NewReader(goldenBytes(t, name)))
	if !ok {
		t.Fatalf("%s is not one whole gRPC message", name)
	}
	if index.Frames[name].Message == "attention.v1.AttendRequest" {
		return parseAttend(message)
	}
	return parseInfer(message)
}

func goldenServed(index goldenIndex) *served {
	m := index.Model
	model := &modelInfo{Key: m.Name + "/" + strconv.FormatInt(m.Version, 10), Name: m.Name, Version: m.Version,
		EmbedDim: m.EmbedDim, NumHeads: m.NumHeads, Dtype: m.Dtype, HasWeightsGraph: true}
	return &served{models: map[string]map[int64]*modelInfo{m.Name: {m.Version: model}}, defaultModel: m.Name, ready: true}
}

var goldenLimits = limits{maxSeqLen: 16, maxBatchSize: 8, clientSharedMemory: true}

func floatBytes(values []float32) []byte {
	if len(values) == 0 {
		return nil
	}
	return floats(values...)
}

func refOf(params map[string]goldenParam, where string) *shmRef {
	region, named := params[paramRegion]
	if !named {
		return nil
	}
	ref := &shmRef{region: *region.String, where: where}
	if offset, set := params[paramOffset]; set {
		ref.offset = *offset.Int64
	}
	ref.byteSize = *params[paramByteSize].Int64
	return ref
}

// described is the inferRequest frames.json describes for a request frame.
func described(t *testing.T, frame goldenFrame) *inferRequest {
	t.Helper()
	if frame.Message == "attention.v1.AttendRequest" {
		var d goldenAttendRequest
		decode(t, frame.Fields, &d)
		req := &inferRequest{api: "attention", modelName: d.Model, modelVersion: d.ModelVersion, id: d.RequestID,
			datatype: "FP32", shape: d.Embeddings.Shape, raw: floatBytes(d.Embeddings.Data), weights: d.Weights,
			outputs: []string{outputName}}
		if len(req.shape) == 2 {
			req.shape, req.flat = append([]int64{1}, req.shape...), true
		}
		if d.Weights {
			req.outputs = append(req.outputs, weightsName)
		}
		return req
	}
	var d goldenV2Request
	decode(t, frame.Fields, &d)
	in := d.Inputs[0]
	req := &inferRequest{api: "v2", modelName: d.ModelName, modelVersion: d.ModelVersion, id: d.ID,
		datatype: in.Datatype, shape: in.Shape, inRef: refOf(in.Parameters, "input '"+inputName+"'")}
	if len(d.Raw) > 0 {
		req.raw = floatBytes(d.Raw[0])
	}
	for _, out := range d.Outputs {
		req.outputs = append(req.outputs, out.Name)
		if ref := refOf(out.Parameters, "output '"+out.Name+"'"); ref != nil {
			if req.outRefs == nil {
				req.outRefs = map[string]*shmRef{}
			}
			req.outRefs[out.Name] = ref
		}
	}
	return req
}

func TestGoldenRequestsAreReadAsDescribed(t *testing.T) {
	index, trailers := readGolden(t)
	toPython := map[string]bool{}
	for _, c := range trailers {
		if c.By == "python" && c.Request != "" {
			toPython[c.Request] = true
		}
	}
	seen := 0
	for name, frame := range index.Frames {
		if frame.Answers != "" || toPython[name] {
			continue // an answer, or a request the gateway hands to Python (below)
		}
		seen++
		req := goldenRequest(t, index, name)
		if req == nil {
			t.Errorf("%s: not read as a plain call", name)
			continue
		}
		if want := described(t, frame); !reflect.DeepEqual(req, want) {
			t.Errorf("%s: read as\n%+v\nframes.json has\n%+v", name, req, want)
		}
		if req.check(goldenServed(index), goldenLimits) == nil {
			t.Errorf("%s: not answered here", name)
		}
	}
	if seen < 5 {
		t.Fatalf("only %d golden requests", seen)
	}
}

// goldenFastPath is a fast path whose worker link is a test's: nothing reads the INFERs it
// sends; the test answers them (answerNext) as the worker would.
func goldenFastPath(t *testing.T, index goldenIndex, slabBytes int) (*fastPath, *link) {
	t.Helper()
	w := newWorker(filepath.Join(t.TempDir(), "worker.sock"), "golden", slabBytes)
	s, err := newSlab(slabBytes, "golden-test")
	if err != nil {
		t.Fatal(err)
	}
	s.closeFd()
	t.Cleanup(s.unmap)
	l := &link{slab: s, calls: map[uint64]*pending{}, wake: make(chan struct{}, 1), alive: true}
	w.link, w.served = l, goldenServed(index)
	m := &metrics{} // written nowhere
	fp := &fastPath{worker: w, limits: goldenLimits, metrics: m, answers: newAnswerBudget(1<<30, 1<<30, m),
		closing: make(chan struct{})}
	fp.accepting.Store(true)
	return fp, l
}

// answerNext answers the next call on l as the worker does: the answer's tensors written
// where the call's regions are in the slab, then its DONE (or error).
func answerNext(fp *fastPath, l *link, p *plan, out, weights []byte, a answer) {
	go func() {
		for {
			l.mu.Lock()
			var id uint64
			var call *pending
			for i, c := range l.calls {
				id, call = i, c
			}
			l.mu.Unlock()
			if call == nil {
				time.Sleep(time.Millisecond)
				continue
			}
			regions := call.regions
			if p.inRef == nil {
				regions = regions[1:]
			}
			if p.outRef == nil {
				copy(l.slab.mem[regions[0].offset:], out)
				regions = regions[1:]
			}
			if p.weights && p.wRef == nil {
				copy(l.slab.mem[regions[0].offset:], weights)
			}
			fp.worker.finish(l, id, a, nil)
			return
		}
	}()
}

func grpcCall(path string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, path, nil)
	r.Header.Set("Content-Type", "application/grpc")
	r.Header.Set("Te", "trailers")
	return r
}

// workerResult is what the worker computed for an answer frame: its tensors and timing.
func workerResult(t *testing.T, frame goldenFrame) (out, weights []byte, a answer) {
	t.Helper()
	a.batch = 1
	switch frame.Message {
	case "inference.ModelInferResponse":
		var d goldenV2Response
		decode(t, frame.Fields, &d)
		for i, output := range d.Outputs {
			if output.Name == weightsName {
				weights = floatBytes(d.Raw[i])
			} else {
				out = floatBytes(d.Raw[i])
			}
		}
	case "attention.v1.AttendResponse":
		var d goldenAttendResponse
		decode(t, frame.Fields, &d)
		out = floatBytes(d.Output.Data)
		if d.Weights != nil {
			weights = floatBytes(d.Weights.Data)
		}
		a = answer{queueS: float64(d.Timing.QueueUs) / 1e6, computeS: float64(d.Timing.ComputeUs) / 1e6,
			batch: d.Timing.BatchSize}
	default:
		t.Fatalf("no worker result in a %s", frame.Message)
	}
	return out, weights, a
}

var streamOf = map[string]string{
	"inference.ModelStreamInferResponse": modelStreamInferPath,
	"attention.v1.AttendStreamResponse":  attendStreamPath,
}

var unaryOf = map[string]string{
	"inference.ModelInferResponse": modelInferPath,
	"attention.v1.AttendResponse":  attendPath,
}

// goldenAnswer is the answer frame the gateway writes for it, through its own path.
func goldenAnswer(t *testing.T, index goldenIndex, trailers map[string]goldenTrailer, frame goldenFrame) []byte {
	t.Helper()
	req := goldenRequest(t, index, frame.Answers)
	fp, l := goldenFastPath(t, index, 1<<16)
	p := req.check(fp.worker.snapshot(), fp.limits)
	if p == nil {
		t.Fatalf("%s is not answered here", frame.Answers)
	}
	recorder := httptest.NewRecorder()
	if path, unary := unaryOf[frame.Message]; unary {
		out, weights, a := workerResult(t, frame)
		answerNext(fp, l, p, out, weights, a)
		if code, _ := fp.infer(recorder, grpcCall(path), req, p, func() {}); code != codeOK {
			t.Fatalf("answered %d: %v", code, recorder.Header())
		}
		return recorder.Body.Bytes()
	}
	method := streamMethods[streamOf[frame.Message]]
	if frame.Refusal != "" {
		fillStatusPage(t, fp, trailers[frame.Refusal])
	} else {
		// The unary answer the stream's message wraps.
		var inner map[string]json.RawMessage
		decode(t, frame.Fields, &inner)
		unary := goldenFrame{Message: "inference.ModelInferResponse", Fields: inner["infer_response"]}
		if frame.Message == "attention.v1.AttendStreamResponse" {
			unary = goldenFrame{Message: "attention.v1.AttendResponse", Fields: inner["response"]}
		}
		out, weights, a := workerResult(t, unary)
		answerNext(fp, l, p, out, weights, a)
	}
	o := fp.compute(context.Background(), "192.0.2.1:1234", req, p, time.Time{}, func() {})
	defer o.release()
	segments := method.failure(req, o.code, o.message)
	if o.code == codeOK {
		segments = method.ok(req, o.segments)
	} else if frame.Refusal == "" {
		t.Fatalf("answered %d %q", o.code, o.message)
	}
	if err := writeSegments(recorder, segments, o.takeFree()); err != nil {
		t.Fatal(err)
	}
	return recorder.Body.Bytes()
}

func TestGoldenAnswersAreWrittenByteForByte(t *testing.T) {
	index, trailers := readGolden(t)
	seen := 0
	for name, frame := range index.Frames {
		if frame.Answers == "" {
			continue
		}
		seen++
		if got, want := goldenAnswer(t, index, trailers, frame), goldenBytes(t, name); !bytes.Equal(got, want) {
			t.Errorf("%s: the gateway writes\n%x\nPython's protobuf\n%x", name, got, want)
		}
	}
	if seen < 9 {
		t.Fatalf("only %d golden answers", seen)
	}
}

// fillStatusPage publishes the queue's fill of a queue-full refusal in the page fp reads.
func fillStatusPage(t *testing.T, fp *fastPath, c goldenTrailer) {
	t.Helper()
	var a struct {
		Pending       uint64 `json:"pending"`
		PendingBytes  uint64 `json:"pending_bytes"`
		MaxQueueSize  uint64 `json:"max_queue_size"`
		MaxQueueBytes uint64 `json:"max_queue_bytes"`
	}
	decode(t, c.Args, &a)
	page := make([]byte, statusPageBytes)
	binary.LittleEndian.PutUint64(page[statusSequenceOffset:], 2)
	binary.LittleEndian.PutUint64(page[statusPendingRequestsOffset:], a.Pending)
	binary.LittleEndian.PutUint64(page[statusPendingBytesOffset:], a.PendingBytes)
	binary.LittleEndian.PutUint64(page[statusMaxQueueSizeOffset:], a.MaxQueueSize)
	binary.LittleEndian.PutUint64(page[statusMaxQueueBytesOffset:], a.MaxQueueBytes)
	if err := os.WriteFile(fp.worker.status.path, page, 0o600); err != nil {
		t.Fatal(err)
	}
}

// refusal is one case of trailers.json as the gateway comes to it; it returns the headers
// (trailers-only) the call ended with.
type refusal func(t *testing.T, index goldenIndex, trailers map[string]goldenTrailer, c goldenTrailer) http.Header

// refuseCall runs a plain call of c's request through the fast path, prepared by prepare,
// with the worker's answer (if it is asked) a.
func refuseCall(prepare func(t *testing.T, fp *fastPath, l *link, r *http.Request, c goldenTrailer), a *answer) refusal {
	return func(t *testing.T, index goldenIndex, _ map[string]goldenTrailer, c goldenTrailer) http.Header {
		req := goldenRequest(t, index, c.Request)
		fp, l := goldenFastPath(t, index, 1<<16)
		r := grpcCall(modelInferPath)
		if prepare != nil {
			prepare(t, fp, l, r, c)
		}
		p := req.check(goldenServed(index), fp.limits)
		if a != nil {
			answerNext(fp, l, p, nil, nil, *a)
		}
		recorder := httptest.NewRecorder()
		fp.infer(recorder, r, req, p, func() {})
		return recorder.Header()
	}
}

func withSlab(t *testing.T, fp *fastPath, l *link, _ *http.Request, c goldenTrailer) {
	var a struct {
		Size int   `json:"size"`
		Held []int `json:"held"`
	}
	decode(t, c.Args, &a)
	s, err := newSlab(a.Size, "golden-test")
	if err != nil {
		t.Fatal(err)
	}
	s.closeFd()
	t.Cleanup(s.unmap)
	l.slab = s
	if _, err := s.alloc(a.Held); err != nil {
		t.Fatal(err)
	}
}

func withAnswersHeld(t *testing.T, fp *fastPath, _ *link, r *http.Request, c goldenTrailer) {
	var a struct {
		MaxBytes   int64  `json:"max_bytes"`
		MaxPerConn int64  `json:"max_bytes_per_connection"`
		Holder     string `json:"holder"`
		Held       int64  `json:"held"`
		Peer       string `json:"peer"`
	}
	decode(t, c.Args, &a)
	fp.answers = newAnswerBudget(a.MaxBytes, a.MaxPerConn, fp.metrics)
	fp.answers.reserve(a.Holder, a.Held)
	r.RemoteAddr = a.Peer
}

// fromWorker is the worker's error of a relayed refusal.
func fromWorker(t *testing.T, index goldenIndex, trailers map[string]goldenTrailer, c goldenTrailer) http.Header {
	var a struct {
		Kind    string `json:"kind"`
		Message string `json:"message"`
	}
	decode(t, c.Args, &a)
	return refuseCall(nil, &answer{kind: a.Kind, message: a.Message})(t, index, trailers, c)
}

// headerCheck is a call with c's request refused for its headers, as gRPC core refuses it.
func headerCheck(set func(r *http.Request, value string)) refusal {
	return func(t *testing.T, _ goldenIndex, _ map[string]goldenTrailer, c goldenTrailer) http.Header {
		var a map[string]string
		decode(t, c.Args, &a)
		r := grpcCall(modelInferPath)
		set(r, a["value"])
		if a["name"] != "" {
			r.Header.Set(a["name"], "!!!")
		}
		recorder := httptest.NewRecorder()
		if !checkCallHeaders(recorder, r) {
			t.Fatal("let through")
		}
		return recorder.Header()
	}
}

func metadataOverTheLimit(t *testing.T, _ goldenIndex, _ map[string]goldenTrailer, c goldenTrailer) http.Header {
	var a struct{ Size, Limit int }
	decode(t, c.Args, &a)
	r := grpcCall(modelInferPath)
	r.Header.Set("X-Pad", "")
	r.Header.Set("X-Pad", strings.Repeat("p", a.Size-headerBlockSize(r)))
	recorder := httptest.NewRecorder()
	(&gateway{maxMetadata: a.Limit}).ServeHTTP(recorder, r)
	return recorder.Header()
}

func permissionDenied(t *testing.T, _ goldenIndex, trailers map[string]goldenTrailer, c goldenTrailer) http.Header {
	var a struct {
		Group  string  `json:"group"`
		Header string  `json:"header"`
		Sent   *string `json:"sent"`
	}
	decode(t, c.Args, &a)
	words := func(name string) string {
		text, err := url.PathUnescape(trailers[name].Message)
		if err != nil {
			t.Fatal(err)
		}
		return text
	}
	// The words come from Python (Restrictions.for_gateway), as the front end passes them.
	rs, err := parseRestrictions(mustJSON(t, map[string]any{
		"methods": map[string]string{modelInferPath: a.Group},
		"keys": map[string]any{a.Group: map[string]string{"header": a.Header, "value": "the-key",
			"without": words("permission-denied-without-key"), "wrong": words("permission-denied-wrong-key")}},
	}), answeredHere())
	if err != nil {
		t.Fatal(err)
	}
	r := grpcCall(modelInferPath)
	if a.Sent != nil {
		r.Header.Set(a.Header, *a.Sent)
	}
	recorder := httptest.NewRecorder()
	if rs.admit(recorder, r) {
		t.Fatal("admitted")
	}
	return recorder.Header()
}

func mustJSON(t *testing.T, value any) []byte {
	data, err := json.Marshal(value)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// streamEnd is how a stream ends when its context ends with cause (closed: by shutdown).
func streamEnd(closed bool, cause error) refusal {
	return func(t *testing.T, _ goldenIndex, _ map[string]goldenTrailer, _ goldenTrailer) http.Header {
		ctx, end := context.WithCancelCause(context.Background())
		if cause != nil {
			end(cause)
		}
		defer end(nil)
		answers := make(chan streamAnswer)
		close(answers)
		s := &stream{r: grpcCall(modelStreamInferPath), ctx: ctx, answers: answers, closed: closed}
		recorder := httptest.NewRecorder()
		s.write(recorder)
		return recorder.Header()
	}
}

func pythonAway(t *testing.T, _ goldenIndex, _ map[string]goldenTrailer, _ goldenTrailer) http.Header {
	proxy := newProxy(newBackend(filepath.Join(t.TempDir(), "no-frontend.sock"), 1<<20))
	recorder := httptest.NewRecorder()
	proxy.ServeHTTP(recorder, grpcCall("/inference.GRPCInferenceService/ServerReady"))
	return recorder.Header()
}

// goldenRefusals are the gateway's ways to each refusal it writes (a list: each must match).
var goldenRefusals = map[string][]refusal{
	"queue-full-by-count": {refuseCall(func(t *testing.T, fp *fastPath, _ *link, _ *http.Request, c goldenTrailer) {
		fillStatusPage(t, fp, c)
	}, nil)},
	"queue-full-by-bytes": {refuseCall(func(t *testing.T, fp *fastPath, _ *link, _ *http.Request, c goldenTrailer) {
		fillStatusPage(t, fp, c)
	}, nil)},
	"answers-backlogged-by-server":     {refuseCall(withAnswersHeld, nil)},
	"answers-backlogged-by-connection": {refuseCall(withAnswersHeld, nil)},
	"slab-too-small":                   {refuseCall(withSlab, nil)},
	"slab-full":                        {refuseCall(withSlab, nil)},
	"not-accepting": {refuseCall(func(_ *testing.T, fp *fastPath, _ *link, _ *http.Request, _ goldenTrailer) {
		fp.accepting.Store(false)
	}, nil)},
	"worker-restarting": {refuseCall(func(_ *testing.T, fp *fastPath, _ *link, _ *http.Request, _ goldenTrailer) {
		fp.worker.link = nil
	}, nil)},
	"worker-gone":            {fromWorker},
	"region-not-found":       {fromWorker},
	"worker-internal":        {fromWorker},
	"worker-internal-odd-id": {fromWorker},
	"deadline-exceeded": {
		refuseCall(func(_ *testing.T, _ *fastPath, _ *link, r *http.Request, _ goldenTrailer) {
			r.Header.Set("Grpc-Timeout", "1n") // never answered: the deadline passes first
		}, nil),
		streamEnd(false, context.DeadlineExceeded),
	},
	"stream-closed":                 {streamEnd(true, nil)},
	"stream-ended-without-status":   {streamEnd(false, pythonFailed{})},
	"permission-denied-without-key": {permissionDenied},
	"permission-denied-wrong-key":   {permissionDenied},
	"metadata-too-large":            {metadataOverTheLimit},
	"bad-binary-header":             {headerCheck(func(*http.Request, string) {})},
	"bad-metadata":                  {headerCheck(func(*http.Request, string) {})},
	"illegal-header-key":            {headerCheck(func(*http.Request, string) {})},
	"bad-te":                        {headerCheck(func(r *http.Request, value string) { r.Header["Te"] = []string{value} })},
	"bad-timeout": {headerCheck(func(r *http.Request, value string) {
		r.Header.Set("Grpc-Timeout", value)
	})},
	"backend-gone": {pythonAway},
}

func TestGoldenRefusalsAreWrittenInTheSameWords(t *testing.T) {
	index, trailers := readGolden(t)
	for name, c := range trailers {
		if c.By == "python" {
			continue // below
		}
		ways := goldenRefusals[name]
		if len(ways) == 0 {
			t.Errorf("%s: written by the gateway (%s), and not tested here", name, c.By)
		}
		for i, way := range ways {
			h := way(t, index, trailers, c)
			if got := [2]string{h.Get("Grpc-Status"), h.Get("Grpc-Message")}; got != [2]string{c.Status, c.Message} {
				t.Errorf("%s (way %d): the gateway writes %q, Python %q", name, i, got, [2]string{c.Status, c.Message})
			}
		}
	}
}

// A refusal only Python writes is of a call the gateway hands to Python as it came.
func TestGoldenRefusalsOfPythonAreOfCallsHandedToIt(t *testing.T) {
	index, trailers := readGolden(t)
	g := &gateway{maxReceive: 1 << 20}
	for name, c := range trailers {
		if c.By != "python" {
			continue
		}
		if c.Request != "" {
			if req := goldenRequest(t, index, c.Request); req != nil && req.check(goldenServed(index), goldenLimits) != nil {
				t.Errorf("%s: %s is answered here", name, c.Request)
			}
			continue
		}
		var a struct{ Body []string }
		decode(t, c.Args, &a)
		var body []byte
		for _, frame := range a.Body {
			body = append(body, goldenBytes(t, frame)...)
		}
		if _, _, ok := g.readUnary(bytes.NewReader(body)); ok {
			t.Errorf("%s: read as a unary call's one message", name)
		}
	}
}

// A call with no request id is named by a new one, as Python's uuid4().hex[:12].
func TestAnInternalFailureWithoutARequestIDNamesANewOne(t *testing.T) {
	first := internalFailure(&inferRequest{api: "v2"}, "the worker failed this request")
	second := internalFailure(&inferRequest{api: "v2"}, "the worker failed this request")
	// internalError's words around a quoted id of 12 lower-case hex digits.
	pattern := regexp.MustCompile("^" + strings.Replace(regexp.QuoteMeta(internalError("ID")), "ID", "'[0-9a-f]{12}'", 1) + "$")
	if !pattern.MatchString(first) || first == second {
		t.Fatalf("%q, then %q", first, second)
	}
}

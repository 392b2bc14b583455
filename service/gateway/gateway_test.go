package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"io"
	"math"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func plainRequest(raw []byte, shape []int64, outputs ...string) []byte {
	var input []byte
	input = appendStringField(input, 1, inputName)
	input = appendStringField(input, 2, "FP32")
	input = appendPackedInt64s(input, 3, shape)
	var msg []byte
	msg = appendStringField(msg, 1, "mha")
	msg = appendStringField(msg, 3, "id-1")
	msg = appendBytesField(msg, 5, input)
	for _, name := range outputs {
		msg = appendBytesField(msg, 6, appendStringField(nil, 1, name))
	}
	return appendBytesField(msg, 7, raw)
}

// unnamedInputRequest is plainRequest with no name field in its input tensor.
func unnamedInputRequest(raw []byte, shape []int64) []byte {
	input := appendStringField(nil, 2, "FP32")
	input = appendPackedInt64s(input, 3, shape)
	msg := appendStringField(nil, 1, "mha")
	msg = appendBytesField(msg, 5, input)
	return appendBytesField(msg, 7, raw)
}

func floats(values ...float32) []byte {
	b := make([]byte, 0, 4*len(values))
	for _, v := range values {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
	}
	return b
}

func servedMHA() *served {
	m := &modelInfo{Key: "mha/1", Name: "mha", Version: 1, EmbedDim: 2, NumHeads: 1,
		Dtype: "float32", HasWeightsGraph: true}
	return &served{models: map[string]map[int64]*modelInfo{"mha": {1: m}}, defaultModel: "mha", ready: true}
}

func TestPlainRequestIsReadAndChecked(t *testing.T) {
	raw := floats(1, 2, 3, 4)
	req := parseInfer(plainRequest(raw, []int64{1, 2, 2}, weightsName, outputName, weightsName))
	if req == nil || req.modelName != "mha" || req.id != "id-1" || len(req.raw) != 16 {
		t.Fatalf("parsed %+v", req)
	}
	p := req.check(servedMHA(), limits{maxSeqLen: 8, maxBatchSize: 4})
	if p == nil || !p.weights || len(p.outputs) != 2 || p.outputs[0] != weightsName {
		t.Fatalf("plan %+v", p)
	}
	if p.wBytes != 4*1*1*2*2 || p.outBytes != 16 {
		t.Fatalf("sizes %d %d", p.outBytes, p.wBytes)
	}
}

func TestTheAnswersSizeCountsTheOutputsAskedForAlone(t *testing.T) {
	lim := limits{maxSeqLen: 8, maxBatchSize: 4}
	raw := floats(1, 2, 3, 4, 5, 6, 7, 8) // [1, 4, 2]: output 32 bytes, weights 1*1*4*4 float32 = 64
	cases := []struct {
		outputs []string
		bytes   int64
	}{
		{nil, 32},                   // none named: output alone
		{[]string{outputName}, 32},  // output alone
		{[]string{weightsName}, 64}, // the weights alone; was 96
		{[]string{outputName, weightsName}, 96},
	}
	for _, c := range cases {
		p := parseInfer(plainRequest(raw, []int64{1, 4, 2}, c.outputs...)).check(servedMHA(), lim)
		if p == nil || p.answerBytes() != c.bytes {
			t.Fatalf("outputs %v: plan %+v, want %d answer bytes", c.outputs, p, c.bytes)
		}
	}
}

func TestAnythingNotPlainIsLeftToPython(t *testing.T) {
	lim := limits{maxSeqLen: 8, maxBatchSize: 4}
	cases := map[string][]byte{
		"non-finite":    plainRequest(floats(1, float32(math.Inf(1)), 3, 4), []int64{1, 2, 2}),
		"NaN":           plainRequest(floats(1, float32(math.NaN()), 3, 4), []int64{1, 2, 2}),
		"wrong d":       plainRequest(floats(1, 2, 3, 4), []int64{1, 1, 4}),
		"byte length":   plainRequest(floats(1, 2, 3), []int64{1, 2, 2}),
		"too long":      plainRequest(make([]byte, 4*2*9), []int64{1, 9, 2}),
		"empty":         plainRequest(nil, []int64{1, 0, 2}),
		"other output":  plainRequest(floats(1, 2, 3, 4), []int64{1, 2, 2}, "logits"),
		"two dims":      plainRequest(floats(1, 2, 3, 4), []int64{2, 2}),
		"truncated":     plainRequest(floats(1, 2, 3, 4), []int64{1, 2, 2})[:20],
		"request param": append(plainRequest(floats(1, 2, 3, 4), []int64{1, 2, 2}), appendBytesField(nil, 4, []byte{10, 1, 'x'})...),
		"unnamed input": unnamedInputRequest(floats(1, 2, 3, 4), []int64{1, 2, 2}),
	}
	for name, msg := range cases {
		if req := parseInfer(msg); req != nil && req.check(servedMHA(), lim) != nil {
			t.Errorf("%s: taken by the fast path", name)
		}
	}
	unready := servedMHA()
	unready.ready = false
	if parseInfer(plainRequest(floats(1, 2, 3, 4), []int64{1, 2, 2})).check(unready, lim) != nil {
		t.Error("served while the worker is not ready")
	}
}

func TestResolveVersions(t *testing.T) {
	s := servedMHA()
	s.models["mha"][3] = &modelInfo{Name: "mha", Version: 3}
	for version, want := range map[string]int64{"": 3, "1": 1, "3": 3} {
		if m := s.resolve("", version); m == nil || m.Version != want {
			t.Errorf("version %q: %+v", version, m)
		}
	}
	for _, version := range []string{"2", "01", "+1", "x"} {
		if s.resolve("mha", version) != nil {
			t.Errorf("version %q resolved", version)
		}
	}
}

func TestSlabFirstFitCoalesces(t *testing.T) {
	s, err := newSlab(4096, "test")
	if err != nil {
		t.Fatal(err)
	}
	defer s.unmap()
	s.closeFd()
	a, err := s.alloc([]int{100, 1000, 10})
	if h := slabHeaderBytes; err != nil || a[0].offset != h || a[1].offset != h+128 || a[2].offset != h+1152 {
		t.Fatalf("%v %v", a, err)
	}
	if _, err := s.alloc([]int{4096}); err == nil {
		t.Fatal("allocated past the end")
	}
	s.release(a[1:2])
	s.release(a[0:1])
	s.release(a[2:3])
	if len(s.free) != 1 || s.free[0] != (region{slabHeaderBytes, 4096}) || s.used != 0 {
		t.Fatalf("free list %v used %d", s.free, s.used)
	}
	if _, err := s.alloc([]int{5000}); err == nil || !err.(*slabError).tooSmall {
		t.Fatalf("too large: %v", err)
	}
}

func TestFieldNumbersAndTagsAsUpbReadsThem(t *testing.T) {
	base := plainRequest(floats(1, 2, 3, 4), []int64{1, 2, 2})
	for name, extra := range map[string][]byte{
		"field 2^29":      appendVarint(appendTag(nil, 1<<29, wireVarint), 1),
		"6-byte tag":      {0x8a, 0x80, 0x80, 0x80, 0x80, 0x00, 0},
		"bad UTF-8 dtype": appendBytesField(nil, 5, appendBytesField(nil, 2, []byte{0xff})),
	} {
		if parseInfer(append(append([]byte{}, base...), extra...)) != nil {
			t.Errorf("%s: taken as plain", name)
		}
	}
}

// The files must read back as prometheus-client's mmap_dict reads them.
func TestMetricsFileLayout(t *testing.T) {
	dir := t.TempDir()
	spec := metricsSpec{Requests: metricSpec{Family: "r", Sample: "r_total", Help: "h"}}
	spec.Duration.Family, spec.Duration.Help = "d", "h"
	spec.Duration.Bounds, spec.Duration.Labels = []float64{0.1, 1e308}, []string{"0.1", "+Inf"}
	m, err := openMetrics(dir, spec)
	if err != nil {
		t.Fatal(err)
	}
	m.finished("mha", "v2", codeOK, 0.05)
	m.finished("mha", "v2", codeOK, 3)
	m.finished("mha", "v2", codeUnavailable, 0.01)
	values := metricValues(t, filepath.Join(dir, "counter_"+itoa(os.Getpid())+".db"))
	for key := range values {
		var parsed []any
		if err := json.Unmarshal([]byte(key), &parsed); err != nil || len(parsed) != 4 {
			t.Fatalf("key %q: %v", key, err)
		}
	}
	ok := key("r", "r_total", map[string]string{"model": "mha", "api": "v2", "code": "OK"}, "h")
	if values[ok] != 2 || len(values) != 2 {
		t.Fatalf("values %v", values)
	}
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

type trickle struct{ chunks [][]byte }

func (t *trickle) Read(p []byte) (int, error) {
	if len(t.chunks) == 0 {
		return 0, io.EOF
	}
	n := copy(p, t.chunks[0])
	if n == len(t.chunks[0]) {
		t.chunks = t.chunks[1:]
	} else {
		t.chunks[0] = t.chunks[0][n:]
	}
	return n, nil
}

func framed(msg []byte, declared int) []byte {
	prefix := []byte{0, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(prefix[1:], uint32(declared))
	return append(prefix, msg...)
}

func TestReadUnaryHoldsWhatArrivedNotWhatWasDeclared(t *testing.T) {
	g := &gateway{maxReceive: 64 << 20}
	read, _, ok := g.readUnary(&trickle{chunks: [][]byte{framed([]byte("abc"), 32<<20)}})
	if ok || cap(read) > 1<<20 {
		t.Fatalf("a 32 MiB declaration with 3 bytes sent: ok=%v, held %d bytes", ok, cap(read))
	}
	msg := make([]byte, 300<<10)
	for i := range msg {
		msg[i] = byte(i)
	}
	whole := framed(msg, len(msg))
	read, got, ok := g.readUnary(&trickle{chunks: [][]byte{whole[:7], whole[7:100000], whole[100000:]}})
	if !ok || !bytes.Equal(got, msg) || !bytes.Equal(read, whole) {
		t.Fatalf("a message in three pieces: ok=%v, %d bytes", ok, len(got))
	}
	if _, _, ok := g.readUnary(&trickle{chunks: [][]byte{whole, {0}}}); ok {
		t.Fatal("a second message taken as unary")
	}
	if _, _, ok := (&gateway{maxReceive: 100}).readUnary(&trickle{chunks: [][]byte{whole}}); ok {
		t.Fatal("a message over the receive limit taken")
	}
}

func TestGrpcPeer(t *testing.T) {
	for remote, want := range map[string]string{"127.0.0.1:5000": "ipv4:127.0.0.1:5000", "[::1]:7": "ipv6:[::1]:7"} {
		if got := grpcPeer(remote); got != want {
			t.Errorf("%s: %s", remote, got)
		}
	}
}

func attendRequest(raw []byte, shape []int64, dtype uint64, weights bool, extra ...byte) []byte {
	var tensor []byte
	tensor = appendPackedInt64s(tensor, 1, shape)
	tensor = appendVarintField(tensor, 2, dtype)
	tensor = appendBytesField(tensor, 3, raw)
	var msg []byte
	msg = appendStringField(msg, 1, "mha")
	msg = appendBytesField(msg, 3, tensor)
	if weights {
		msg = appendVarintField(msg, 4, 1)
	}
	msg = appendStringField(msg, 5, "id-2")
	return append(msg, extra...)
}

func TestPlainAttendIsReadAsTheSamePlan(t *testing.T) {
	lim := limits{maxSeqLen: 8, maxBatchSize: 4}
	req := parseAttend(attendRequest(floats(1, 2, 3, 4), []int64{2, 2}, dataTypeUnspecified, true))
	if req == nil || req.api != "attention" || !req.flat || req.id != "id-2" {
		t.Fatalf("parsed %+v", req)
	}
	p := req.check(servedMHA(), lim)
	if p == nil || !p.weights || p.shape != [3]int64{1, 2, 2} || p.wBytes != 16 {
		t.Fatalf("plan %+v", p)
	}
	if req := parseAttend(attendRequest(floats(1, 2, 3, 4), []int64{1, 2, 2}, dataTypeFloat32, false)); req == nil || req.flat || len(req.outputs) != 1 {
		t.Fatalf("3-D without weights: %+v", req)
	}
	region := appendBytesField(nil, 6, appendStringField(nil, 1, "r"))
	cases := map[string][]byte{
		"float16 for a float32 model": attendRequest(make([]byte, 8), []int64{2, 2}, dataTypeFloat16, false),
		"unknown dtype":               attendRequest(floats(1, 2, 3, 4), []int64{2, 2}, 7, false),
		"one dim":                     attendRequest(floats(1, 2, 3, 4), []int64{4}, 0, false),
		"four dims":                   attendRequest(floats(1, 2, 3, 4), []int64{1, 1, 2, 2}, 0, false),
		"non-finite":                  attendRequest(floats(1, float32(math.NaN()), 3, 4), []int64{2, 2}, 0, false),
		"client shared memory":        attendRequest(floats(1, 2, 3, 4), []int64{2, 2}, 0, false, region...),
		"no embeddings":               appendStringField(nil, 1, "mha"),
	}
	for name, msg := range cases {
		if req := parseAttend(msg); req != nil && req.check(servedMHA(), lim) != nil {
			t.Errorf("%s: taken by the fast path", name)
		}
	}
}

func TestAMessageIsWrittenWholeAndItsSharedMemoryFreedOnce(t *testing.T) {
	for _, size := range []int{100, copyWholeBytes + 3*copyChunkBytes/2} {
		shared := bytes.Repeat([]byte{7}, size)
		m := newMessage()
		m.built = appendStringField(m.built, 1, "mha")
		m.bytesField(6, shared)
		segments := m.finish()
		var want []byte
		for _, s := range segments {
			want = append(want, s...)
		}
		recorder := httptest.NewRecorder()
		frees := 0
		if err := writeMessage(recorder, segments, func() { frees++ }); err != nil {
			t.Fatal(err)
		}
		got := recorder.Body.Bytes()
		if frees != 1 || !bytes.Equal(got[5:], want[5:]) || int(binary.BigEndian.Uint32(got[1:5])) != len(want)-5 {
			t.Fatalf("size %d: freed %d times, body %d bytes of %d", size, frees, len(got), len(want))
		}
	}
}

func TestTimeoutsForwardedToPythonRoundUpWithinEightDigits(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want string
	}{
		{1500 * time.Nanosecond, "2u"}, {0, "1u"}, {-time.Second, "1u"},
		{99 * time.Second, "99000000u"}, {100 * time.Second, "100000m"},
		{1000 * time.Hour, "3600000S"},
	} {
		if got := formatTimeout(c.d); got != c.want {
			t.Errorf("formatTimeout(%v) = %q, want %q", c.d, got, c.want)
		}
		if back, set, valid := grpcTimeout(formatTimeout(c.d)); !set || !valid || back < c.d {
			t.Errorf("%q reads back as %v (set %v, valid %v)", formatTimeout(c.d), back, set, valid)
		}
	}
}

func TestStreamEnvelopesNestTheAnswerWithoutCopyingItsTensors(t *testing.T) {
	tensor := []byte("0123456789")
	inner := newMessage()
	inner.built = appendStringField(inner.built, 1, "mha")
	inner.bytesField(6, tensor)
	segments := attendStreamAnswer(&inferRequest{id: "a1"}, inner.finish())
	if &segments[len(segments)-1][0] != &tensor[0] {
		t.Fatal("the tensor's bytes were copied")
	}
	var whole []byte
	for _, s := range segments {
		whole = append(whole, s...)
	}
	var id string
	var response []byte
	if err := eachField(whole[5:], func(f field) error {
		switch f.num {
		case 1:
			id = string(f.bytes)
		case 2:
			response = f.bytes
		default:
			t.Errorf("unexpected field %d", f.num)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if id != "a1" || !bytes.Equal(response, append(appendStringField(nil, 1, "mha"), append([]byte{6<<3 | 2, 10}, tensor...)...)) {
		t.Fatalf("id %q, response %q", id, response)
	}
	failure := v2StreamError(&inferRequest{modelName: "mha", id: "r3"}, codeInvalidArgument, "bad")
	var message string
	var named []byte
	if err := eachField(failure[0][5:], func(f field) error {
		if f.num == 1 {
			message = string(f.bytes)
		} else {
			named = f.bytes
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	want := appendStringField(appendStringField(nil, 1, "mha"), 3, "r3")
	if message != "bad" || !bytes.Equal(named, want) {
		t.Fatalf("message %q, infer_response %q", message, named)
	}
}

// param is one parameters map entry as field num (4 of an input, 2 of an output).
func param(num int, key string, value []byte) []byte {
	return appendBytesField(nil, num, appendBytesField(appendStringField(nil, 1, key), 2, value))
}

func count(kind int, v uint64) []byte { return appendVarint(appendTag(nil, kind, wireVarint), v) }

// shmRequest is a plain request with its input and output in region "io"; extra parameters
// (map entries) are added to the input's.
func shmRequest(extra ...[]byte) []byte {
	var input []byte
	input = appendStringField(input, 1, inputName)
	input = appendStringField(input, 2, "FP32")
	input = appendPackedInt64s(input, 3, []int64{1, 2, 2})
	input = append(input, param(4, paramRegion, appendStringField(nil, fieldInferParameterStringParam, "io"))...)
	input = append(input, param(4, paramOffset, count(fieldInferParameterInt64Param, 0))...)
	input = append(input, param(4, paramByteSize, count(fieldInferParameterUint64Param, 16))...)
	for _, p := range extra {
		input = append(input, p...)
	}
	output := appendStringField(nil, 1, outputName)
	output = append(output, param(2, paramRegion, appendStringField(nil, fieldInferParameterStringParam, "io"))...)
	output = append(output, param(2, paramByteSize, count(fieldInferParameterInt64Param, 16))...)
	var msg []byte
	msg = appendStringField(msg, 1, "mha")
	msg = appendBytesField(msg, 5, input)
	return appendBytesField(msg, 6, output)
}

func TestRegionReferencesAreReadAsPythonReadsThem(t *testing.T) {
	on := limits{maxSeqLen: 8, maxBatchSize: 4, clientSharedMemory: true}
	p := parseInfer(shmRequest()).check(servedMHA(), on)
	if p == nil || p.inRef == nil || p.outRef == nil || p.answerBytes() != 0 {
		t.Fatalf("plan %+v", p)
	}
	if *p.inRef != (shmRef{"io", 0, 16, "input 'embeddings'"}) || p.outRef.where != "output 'output'" {
		t.Fatalf("refs %+v %+v", *p.inRef, *p.outRef)
	}
	if sizes := p.slabSizes(0); sizes != [3]int{-1, -1, -1} {
		t.Fatalf("slab sizes %v", sizes)
	}
	var message map[string]any
	if err := json.Unmarshal(inferRefsMessage(7, p, [3]int64{-1, -1, -1}, nanDeadline(), nil), &message); err != nil {
		t.Fatal(err)
	}
	if _, has := message["deadline"]; has || message["t"] != "infer" || len(message["iref"].([]any)) != 5 {
		t.Fatalf("INFER %v", message)
	}
	if parseInfer(shmRequest()).check(servedMHA(), limits{maxSeqLen: 8, maxBatchSize: 4}) != nil {
		t.Error("taken with client shared memory off")
	}
	tolerated := param(4, "binary_data_size", count(fieldInferParameterInt64Param, 16))
	if parseInfer(shmRequest(tolerated)) == nil {
		t.Error("binary_data_size made it not plain")
	}
	notPlain := map[string][]byte{
		"negative offset": param(4, paramOffset, count(fieldInferParameterInt64Param, math.MaxUint64)),
		"string size":     param(4, paramByteSize, appendStringField(nil, fieldInferParameterStringParam, "16")),
		"region as int":   param(4, paramRegion, count(fieldInferParameterInt64Param, 1)),
		"unknown":         param(4, "priority", count(fieldInferParameterInt64Param, 1)),
	}
	for name, extra := range notPlain {
		if parseInfer(shmRequest(extra)) != nil {
			t.Errorf("%s: taken by the fast path", name)
		}
	}
	withRaw := appendBytesField(shmRequest(), 7, floats(1, 2, 3, 4))
	if parseInfer(withRaw) != nil {
		t.Error("a region and raw bytes taken by the fast path")
	}
}

func TestParametersProtobufWouldRefuseAreLeftToPython(t *testing.T) {
	badString := param(4, "binary_data_size", appendStringField(nil, fieldInferParameterStringParam, "\xff"))
	entry := appendStringField(nil, 1, paramRegion)
	entry = appendBytesField(entry, 2, appendStringField(nil, fieldInferParameterStringParam, "io"))
	twoValues := appendBytesField(nil, 4, appendBytesField(entry, 2, appendStringField(nil, fieldInferParameterStringParam, "\xff")))
	extraField := appendBytesField(nil, 4, append(appendBytesField(appendStringField(nil, 1, "binary_data_size"), 2,
		count(fieldInferParameterInt64Param, 1)), count(3, 1)...))
	for name, extra := range map[string][]byte{"invalid UTF-8 in a tolerated value": badString,
		"a second value": twoValues, "an entry with a third field": extraField} {
		if parseInfer(shmRequest(extra)) != nil {
			t.Errorf("%s: taken by the fast path", name)
		}
	}
}

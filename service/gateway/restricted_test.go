package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

const (
	testHeader  = "x-admin-key"
	testKey     = "s3cret-Value-42"
	testWithout = "the 'inference' API group is restricted on this server and this call came without the header 'x-admin-key'; send 'x-admin-key' with the key for 'inference'"
	testWrong   = "the 'inference' API group is restricted on this server and this call came with a wrong value in the header 'x-admin-key'; send 'x-admin-key' with the key for 'inference'"
)

// testRestrictions is what Restrictions.for_gateway writes for inference and
// model-repository restricted (only inference is answered here, so only its key comes).
func testRestrictions(t *testing.T, key string) []byte {
	t.Helper()
	data, err := json.Marshal(map[string]any{
		"methods": map[string]string{
			modelInferPath: "inference", attendPath: "inference",
			modelStreamInferPath: "inference", attendStreamPath: "inference",
			"/inference.GRPCInferenceService/RepositoryIndex": "model-repository",
		},
		"keys": map[string]any{"inference": map[string]string{
			"header": testHeader, "value": key, "without": testWithout, "wrong": testWrong}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func restrictedFor(t *testing.T, key string) *restrictions {
	t.Helper()
	rs, err := parseRestrictions(testRestrictions(t, key), answeredHere())
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

// call is a gRPC request to path with the given values of the key's header (in order).
func call(path string, values ...string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, path, nil)
	r.Header.Set("Content-Type", "application/grpc")
	r.Header.Set("Te", "trailers")
	for _, value := range values {
		r.Header.Add(testHeader, value)
	}
	return r
}

func TestTheKeyIsCheckedAsPythonChecksIt(t *testing.T) {
	rs := restrictedFor(t, testKey)
	cases := []struct {
		name    string
		values  []string
		message string // "": admitted
	}{
		{"the key", []string{testKey}, ""},
		{"no header", nil, testWithout},
		{"a wrong value", []string{"guess"}, testWrong},
		{"the key cut short", []string{testKey[:len(testKey)-1]}, testWrong},
		{"the key and more", []string{testKey + "x"}, testWrong},
		{"an empty value", []string{""}, testWrong},
		{"spaces around the key", []string{" " + testKey + " "}, testWrong},
		{"oversized", []string{strings.Repeat(testKey, 1000)}, testWrong},
		{"a byte that is not UTF-8 after the key", []string{testKey + "\x80"}, testWrong},
		{"not UTF-8 at all", []string{"\xff\xfe"}, testWrong},
		// gRPC Python keeps the last of several values.
		{"the key, then a wrong value", []string{testKey, "guess"}, testWrong},
		{"a wrong value, then the key", []string{"guess", testKey}, ""},
		{"the key twice", []string{testKey, testKey}, ""},
		{"the key and another in one value", []string{testKey + "," + testKey}, testWrong},
	}
	for _, path := range []string{modelInferPath, attendPath, modelStreamInferPath, attendStreamPath} {
		for _, c := range cases {
			w := httptest.NewRecorder()
			admitted := rs.admit(w, call(path, c.values...))
			if admitted != (c.message == "") {
				t.Errorf("%s %s: admitted %v", path, c.name, admitted)
				continue
			}
			if admitted {
				if len(w.Header()) != 0 {
					t.Errorf("%s %s: admitted but answered %v", path, c.name, w.Header())
				}
				continue
			}
			status, message := w.Header().Get("Grpc-Status"), w.Header().Get("Grpc-Message")
			if got, _ := url.PathUnescape(message); status != "7" || got != c.message {
				t.Errorf("%s %s: status %s message %q", path, c.name, status, got)
			}
			if strings.Contains(message, testKey) || strings.Contains(message, "guess") {
				t.Errorf("%s %s: the refusal shows the value sent", path, c.name)
			}
		}
	}
}

func TestOtherMethodsAndNoRestrictionsAdmitEverything(t *testing.T) {
	var none *restrictions
	if !none.admit(httptest.NewRecorder(), call(modelInferPath)) {
		t.Error("refused with nothing restricted")
	}
	// Not restricted, or not answered here: Python checks what it answers.
	rs := restrictedFor(t, testKey)
	for _, path := range []string{"/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/RepositoryIndex"} {
		if !rs.admit(httptest.NewRecorder(), call(path)) {
			t.Errorf("%s refused", path)
		}
	}
}

// A key of Latin-1 letters is matched, as in gRPC Python, by its UTF-8 bytes and by the
// Latin-1 bytes that are not UTF-8 (Python reads those as Latin-1).
func TestAValueThatIsNotUTF8IsReadAsLatin1(t *testing.T) {
	rs := restrictedFor(t, "clé-ÿ")
	for value, admitted := range map[string]bool{"clé-ÿ": true, "cl\xe9-\xff": true, "cl\xe9-\xfe": false, "cle-y": false} {
		if got := rs.admit(httptest.NewRecorder(), call(modelInferPath, value)); got != admitted {
			t.Errorf("%q: admitted %v, want %v", value, got, admitted)
		}
	}
}

func TestRefusalsAreCountedInPythonsSeries(t *testing.T) {
	dir := t.TempDir()
	spec := metricsSpec{RestrictedDenials: metricSpec{Family: "d", Sample: "d_total", Help: "h"}}
	m, err := openMetrics(dir, spec)
	if err != nil {
		t.Fatal(err)
	}
	rs := restrictedFor(t, testKey)
	rs.metrics = m
	for _, values := range [][]string{nil, {"guess"}, {testKey}, {testKey, "guess"}} {
		rs.admit(httptest.NewRecorder(), call(attendPath, values...))
	}
	values := metricValues(t, filepath.Join(dir, "counter_"+itoa(os.Getpid())+".db"))
	k := key("d", "d_total", map[string]string{"group": "inference"}, "h")
	if values[k] != 3 {
		t.Errorf("denials %v, want 3 (%v)", values[k], values)
	}
}

func TestRestrictionsThatCannotBeUsedStopTheStart(t *testing.T) {
	data := testRestrictions(t, testKey)
	noKey := bytes.Replace(data, []byte(`"keys":{"inference"`), []byte(`"keys":{"other"`), 1)
	for name, bad := range map[string][]byte{
		"not JSON":           append([]byte(testKey), '{'),
		"no key for a group": noKey,
		"an empty value":     bytes.Replace(data, []byte(`"value":"`+testKey+`"`), []byte(`"value":""`), 1),
	} {
		_, err := parseRestrictions(bad, answeredHere())
		if err == nil {
			t.Errorf("%s: taken", name)
		} else if strings.Contains(err.Error(), testKey) {
			t.Errorf("%s: the error shows the key: %v", name, err)
		}
	}
}

// The restrictions come through an inherited descriptor, read once and closed, and the
// variable naming it is gone from the environment.
func TestRestrictionsAreReadFromTheDescriptorOnce(t *testing.T) {
	if rs, err := loadRestrictions(); rs != nil || err != nil {
		t.Fatalf("with no descriptor: %v %v", rs, err)
	}
	var fds [2]int
	if err := syscall.Pipe(fds[:]); err != nil {
		t.Fatal(err)
	}
	writer := os.NewFile(uintptr(fds[1]), "writer")
	if _, err := writer.Write(testRestrictions(t, testKey)); err != nil {
		t.Fatal(err)
	}
	writer.Close()
	t.Setenv(restrictedFDVariable, strconv.Itoa(fds[0]))
	rs, err := loadRestrictions()
	if err != nil || rs.Keys["inference"].Value != testKey {
		t.Fatalf("%+v %v", rs, err)
	}
	if _, set := os.LookupEnv(restrictedFDVariable); set {
		t.Error("the variable is still set")
	}
	var stat syscall.Stat_t
	if err := syscall.Fstat(fds[0], &stat); err != syscall.EBADF {
		t.Errorf("the descriptor is still open (%v)", err)
	}
}

// Through the gateway's handler: a refused call is answered here and never reaches Python;
// one with the key goes on as before (to Python here: no worker is ready).
func TestRefusedCallsNeverReachPython(t *testing.T) {
	m, err := openMetrics("", metricsSpec{})
	if err != nil {
		t.Fatal(err)
	}
	var proxied []string
	g := &gateway{maxReceive: 1 << 20, restricted: restrictedFor(t, testKey),
		fast: &fastPath{worker: newWorker(filepath.Join(t.TempDir(), "worker.sock"), "t", 1<<20), metrics: m,
			closing: make(chan struct{}), answers: newAnswerBudget(1<<20, 1<<20, m)},
		proxy: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			proxied = append(proxied, r.RequestURI+" "+strconv.Itoa(len(body)))
			writeStatus(w, codeOK, "")
		})}
	g.fast.accepting.Store(true)
	message := plainRequest(floats(1, 2, 3, 4), []int64{1, 2, 2})
	framed := binary.BigEndian.AppendUint32([]byte{0}, uint32(len(message)))
	framed = append(framed, message...)
	for _, c := range []struct {
		path   string
		values []string
		status string
	}{
		{modelInferPath, nil, "7"},
		{modelInferPath, []string{"guess"}, "7"},
		{attendStreamPath, nil, "7"},
		{modelInferPath, []string{testKey}, "0"},
	} {
		r := call(c.path, c.values...)
		r.Body = io.NopCloser(bytes.NewReader(framed))
		w := httptest.NewRecorder()
		g.ServeHTTP(w, r)
		if got := w.Header().Get("Grpc-Status"); got != c.status {
			t.Errorf("%s %v: status %q, want %s", c.path, c.values, got, c.status)
		}
	}
	want := modelInferPath + " " + strconv.Itoa(len(framed))
	if len(proxied) != 1 || proxied[0] != want {
		t.Errorf("proxied %v, want [%s]", proxied, want)
	}
}

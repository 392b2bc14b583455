package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

func TestFrameRoundTrip(t *testing.T) {
	body := frame([]byte("abc"))
	if string(body) != "\x00\x00\x00\x00\x03abc" {
		t.Fatalf("frame: % x", body)
	}
	message, err := checkFrame(body)
	if err != nil || string(message) != "abc" {
		t.Fatalf("checkFrame: %q %v", message, err)
	}
	for _, bad := range [][]byte{nil, []byte("\x00\x00\x00"), []byte("\x01\x00\x00\x00\x00"), []byte("\x00\x00\x00\x00\x02a")} {
		if _, err := checkFrame(bad); err == nil {
			t.Errorf("checkFrame(% x) took it", bad)
		}
	}
}

func TestStatusFromTrailersOrTrailersOnlyHeaders(t *testing.T) {
	cases := []struct {
		name            string
		httpStatus      int
		header, trailer http.Header
		code, message   string
	}{
		{"trailers", 200, http.Header{}, http.Header{"Grpc-Status": {"0"}}, "OK", ""},
		{"trailers-only", 200, http.Header{"Grpc-Status": {"8"}, "Grpc-Message": {"queue%20full%3A 64"}}, http.Header{}, "RESOURCE_EXHAUSTED", "queue full: 64"},
		{"trailers win", 200, http.Header{"Grpc-Status": {"0"}}, http.Header{"Grpc-Status": {"14"}, "Grpc-Message": {"gone"}}, "UNAVAILABLE", "gone"},
		{"unknown code", 200, http.Header{"Grpc-Status": {"42"}}, http.Header{}, "CODE_42", ""},
		{"malformed message kept", 200, http.Header{"Grpc-Status": {"2"}, "Grpc-Message": {"100%"}}, http.Header{}, "UNKNOWN", "100%"},
		{"no status", 200, http.Header{}, http.Header{}, clientError, "no grpc-status in the answer"},
		{"not a number", 200, http.Header{"Grpc-Status": {"x"}}, http.Header{}, clientError, `grpc-status "x"`},
		{"http error", 503, http.Header{"Grpc-Status": {"0"}}, http.Header{}, httpError, "HTTP 503"},
	}
	for _, c := range cases {
		code, message := status(c.httpStatus, c.header, c.trailer)
		if code != c.code || message != c.message {
			t.Errorf("%s: got %s %q, want %s %q", c.name, code, message, c.code, c.message)
		}
	}
}

func TestTimeoutHeaderFitsEightDigitsRoundingUp(t *testing.T) {
	cases := map[time.Duration]string{
		50 * time.Millisecond:   "50000000n",
		10 * time.Second:        "10000000u",
		1500 * time.Millisecond: "1500000u",
		1000 * time.Second:      "1000000m",
		time.Nanosecond:         "1n",
		100001 * time.Second:    "100001S",
	}
	for d, want := range cases {
		if got := timeoutHeader(d); got != want {
			t.Errorf("timeoutHeader(%v) = %s, want %s", d, got, want)
		}
	}
}

func TestServerReady(t *testing.T) {
	for body, want := range map[string]bool{"\x00\x00\x00\x00\x02\x08\x01": true, "\x00\x00\x00\x00\x00": false} {
		if got, err := serverReady([]byte(body)); err != nil || got != want {
			t.Errorf("serverReady(% x) = %v %v", body, got, err)
		}
	}
	if _, err := serverReady(frame([]byte{0x12, 0x00})); err == nil {
		t.Error("serverReady took an unknown field")
	}
}

func TestPoissonScheduleIsSortedWithinDurationAtAboutTheRate(t *testing.T) {
	due := poissonSchedule(1000, 10*time.Second, 7)
	if n := len(due); n < 9_500 || n > 10_500 {
		t.Fatalf("%d arrivals at 1000/s over 10 s", n)
	}
	for i := 1; i < len(due); i++ {
		if due[i] < due[i-1] || due[i] >= 10*time.Second {
			t.Fatalf("arrival %d at %v after %v", i, due[i], due[i-1])
		}
	}
	again := poissonSchedule(1000, 10*time.Second, 7)
	if again[len(again)-1] != due[len(due)-1] {
		t.Fatal("the same seed drew another schedule")
	}
}

// A cleartext HTTP/2 server answering every other call trailers-only RESOURCE_EXHAUSTED,
// the rest with a 3-byte message and grpc-status 0 in trailers, and ServerReady with ready.
func fakeServer(t *testing.T) *httptest.Server {
	var calls atomic.Int64
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.ProtoMajor != 2 || r.Header.Get("Te") != "trailers" || r.Header.Get("Grpc-Timeout") == "" {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/grpc")
		if r.URL.Path == readyPath {
			_, _ = w.Write(frame([]byte{0x08, 0x01}))
			w.Header().Set(http.TrailerPrefix+"Grpc-Status", "0")
			return
		}
		if _, err := checkFrame(body); err != nil || calls.Add(1)%2 == 0 {
			w.Header().Set("Grpc-Status", "8")
			w.Header().Set("Grpc-Message", "queue%20full")
			w.WriteHeader(http.StatusOK)
			return
		}
		_, _ = w.Write(frame([]byte("out")))
		w.Header().Set(http.TrailerPrefix+"Grpc-Status", "0")
	})
	server := httptest.NewUnstartedServer(handler)
	server.Config.Protocols = new(http.Protocols)
	server.Config.Protocols.SetUnencryptedHTTP2(true)
	server.Start()
	t.Cleanup(server.Close)
	return server
}

func TestOpenAndClosedLoopsAgainstAFakeServer(t *testing.T) {
	server := fakeServer(t)
	c := newClient(server.Listener.Addr().String(), 2)
	defer c.close()
	body := frame([]byte("in"))
	due := poissonSchedule(400, 250*time.Millisecond, 1)
	start := time.Now()
	stop, probed := make(chan struct{}), make(chan []record, 1)
	go func() {
		probed <- probe(newClient(server.Listener.Addr().String(), 1), start, 20*time.Millisecond, stop)
	}()
	open := openLoop(c, start, due, "/m", body, time.Second, 10000)
	close(stop)
	probes := <-probed
	closed := closedLoop(c, time.Now(), 4, 100*time.Millisecond, "/m", body, time.Second)
	var s summary
	summarize(&s, append(open, closed...), probes)
	if len(open) != len(due) || s.Calls != len(open)+len(closed) {
		t.Fatalf("%d calls for %d due, %d in the summary", len(open), len(due), s.Calls)
	}
	if s.Codes["OK"]+s.Codes["RESOURCE_EXHAUSTED"] != s.Calls || s.Codes["OK"] == 0 || s.Codes["RESOURCE_EXHAUSTED"] == 0 {
		t.Fatalf("codes %v", s.Codes)
	}
	for _, r := range open {
		if r.Code == "OK" && r.Bytes != 8 || r.Code == "RESOURCE_EXHAUSTED" && (r.Message != "queue full" || r.Bytes != 0) {
			t.Fatalf("call %+v", r)
		}
	}
	if len(probes) == 0 || probes[0].Ready == nil || !*probes[0].Ready {
		t.Fatalf("probes %+v", probes)
	}
}

// Command openloop is a small gRPC load generator: it posts one prebuilt gRPC request (a
// length-prefixed message, read from a file) over cleartext HTTP/2 and records every call.
//
// Open loop (-mode open): calls are due at Poisson arrival times at -rate per second for
// -duration, and each is sent at its time whether or not earlier calls were answered (up to
// -max-inflight outstanding; past it a call is recorded as NOT_SENT). Closed loop (-mode
// closed): -concurrency callers, each sending its next call when its last was answered.
// Calls go round-robin over -conns HTTP/2 connections. With -probe-every, V2 ServerReady is
// called on a connection of its own at that period while the load runs.
//
// Each call is a JSON line in -out (kind "call": when it was due, how late it started, its
// latency, its grpc-status name and grpc-message, the answer's bytes; kind "probe" likewise),
// and a summary line ends the file and is printed: the counts by status and how far the
// generator fell behind its schedule.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"
)

const (
	readyPath = "/inference.GRPCInferenceService/ServerReady"
	// How long past its deadline a call may take at the client before it is given up: the
	// server answers DEADLINE_EXCEEDED itself within that.
	deadlineGrace = 250 * time.Millisecond
	lateAfter     = time.Millisecond // a call that started later than this is counted as late
)

// record is one call's line in the output.
type record struct {
	Kind      string `json:"kind"`   // "call" or "probe"
	AtUs      int64  `json:"at_us"`  // when it was due, from the start of the run
	LagUs     int64  `json:"lag_us"` // how long after that it started
	LatencyUs int64  `json:"latency_us"`
	Code      string `json:"code"`
	Message   string `json:"message,omitempty"`
	Bytes     int64  `json:"bytes"`
	Ready     *bool  `json:"ready,omitempty"` // a probe's answer
}

// summary is the last line of the output and what the command prints.
type summary struct {
	Kind        string         `json:"kind"`
	Mode        string         `json:"mode"`
	Rate        float64        `json:"rate"`
	Concurrency int            `json:"concurrency"`
	DurationS   float64        `json:"duration_s"`
	WallS       float64        `json:"wall_s"` // until the last answer
	Calls       int            `json:"calls"`
	Codes       map[string]int `json:"codes"`
	Probes      int            `json:"probes"`
	LagP50Us    int64          `json:"lag_p50_us"`
	LagP99Us    int64          `json:"lag_p99_us"`
	LagMaxUs    int64          `json:"lag_max_us"`
	Late        int            `json:"late"`  // calls that started more than 1 ms after their time
	CPUS        float64        `json:"cpu_s"` // the generator's own CPU time (user + system)
}

type outcome struct {
	code, message string
	body          []byte // kept for probes only
	bytes         int64
}

// client sends calls to one server over its connections, one http.Transport each (a
// transport keeps one HTTP/2 connection while the server's stream limit allows, and opens
// another rather than hold a call back when it does not).
type client struct {
	base       string
	transports []*http.Transport
}

func newTransport() *http.Transport {
	protocols := new(http.Protocols)
	protocols.SetUnencryptedHTTP2(true)
	return &http.Transport{
		Protocols:          protocols,
		DisableCompression: true,
	}
}

func newClient(target string, conns int) *client {
	c := &client{base: "http://" + target}
	for range conns {
		c.transports = append(c.transports, newTransport())
	}
	return c
}

func (c *client) close() {
	for _, t := range c.transports {
		t.CloseIdleConnections()
	}
}

// call posts body to path on transport t with a grpc-timeout of deadline.
func (c *client) call(t *http.Transport, path string, body []byte, deadline time.Duration, keep bool) outcome {
	ctx, cancel := context.WithTimeout(context.Background(), deadline+deadlineGrace)
	defer cancel()
	request, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+path, bytes.NewReader(body))
	if err != nil {
		return outcome{code: clientError, message: err.Error()}
	}
	request.Header = http.Header{
		"Content-Type": {"application/grpc"},
		"Te":           {"trailers"},
		"Grpc-Timeout": {timeoutHeader(deadline)},
		"User-Agent":   {"openloop"},
	}
	answer, err := t.RoundTrip(request)
	if err != nil {
		return failed(ctx, err)
	}
	defer answer.Body.Close()
	var kept bytes.Buffer
	sink := io.Discard
	if keep {
		sink = &kept
	}
	n, err := io.Copy(sink, answer.Body)
	if err != nil {
		return failed(ctx, err)
	}
	code, message := status(answer.StatusCode, answer.Header, answer.Trailer)
	return outcome{code: code, message: message, body: kept.Bytes(), bytes: n}
}

func failed(ctx context.Context, err error) outcome {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return outcome{code: clientLate, message: "no answer by the deadline at the client"}
	}
	return outcome{code: clientError, message: err.Error()}
}

func callRecord(at, lag, latency time.Duration, o outcome) record {
	return record{
		Kind: "call", AtUs: at.Microseconds(), LagUs: lag.Microseconds(),
		LatencyUs: latency.Microseconds(), Code: o.code, Message: o.message, Bytes: o.bytes,
	}
}

// poissonSchedule is when each call is due: exponential gaps at rate per second.
func poissonSchedule(rate float64, duration time.Duration, seed uint64) []time.Duration {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	var due []time.Duration
	at := 0.0
	for {
		at += rng.ExpFloat64() / rate
		offset := time.Duration(at * float64(time.Second))
		if offset >= duration {
			return due
		}
		due = append(due, offset)
	}
}

// openLoop sends each call at its due time (relative to start) without waiting for answers.
func openLoop(c *client, start time.Time, due []time.Duration, path string, body []byte,
	deadline time.Duration, maxInFlight int) []record {
	records := make([]record, len(due))
	slots := make(chan struct{}, maxInFlight)
	var wg sync.WaitGroup
	for i := 0; i < len(due); {
		if wait := time.Until(start.Add(due[i])); wait > 0 {
			time.Sleep(wait)
		}
		now := time.Since(start)
		for ; i < len(due) && due[i] <= now; i++ {
			select {
			case slots <- struct{}{}:
			default:
				records[i] = callRecord(due[i], now-due[i], 0, outcome{code: notSent})
				continue
			}
			wg.Add(1)
			go func(i int, t *http.Transport) {
				defer wg.Done()
				defer func() { <-slots }()
				began := time.Since(start)
				o := c.call(t, path, body, deadline, false)
				records[i] = callRecord(due[i], began-due[i], time.Since(start)-began, o)
			}(i, c.transports[i%len(c.transports)])
		}
	}
	wg.Wait()
	return records
}

// closedLoop runs concurrency callers until duration has passed.
func closedLoop(c *client, start time.Time, concurrency int, duration time.Duration,
	path string, body []byte, deadline time.Duration) []record {
	each := make([][]record, concurrency)
	var wg sync.WaitGroup
	for k := range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := c.transports[k%len(c.transports)]
			for began := time.Since(start); began < duration; began = time.Since(start) {
				o := c.call(t, path, body, deadline, false)
				each[k] = append(each[k], callRecord(began, 0, time.Since(start)-began, o))
			}
		}()
	}
	wg.Wait()
	return slices.Concat(each...)
}

// probe calls ServerReady every period on a connection of its own until stop is closed.
func probe(c *client, start time.Time, every time.Duration, stop <-chan struct{}) []record {
	var records []record
	ready := frame(nil)
	t := c.transports[0]
	for {
		began := time.Since(start)
		o := c.call(t, readyPath, ready, every+time.Second, true)
		r := callRecord(began, 0, time.Since(start)-began, o)
		r.Kind = "probe"
		if o.code == "OK" {
			yes, err := serverReady(o.body)
			if err != nil {
				r.Code, r.Message = clientError, err.Error()
			} else {
				r.Ready = &yes
			}
		}
		records = append(records, r)
		select {
		case <-stop:
			return records
		case <-time.After(time.Until(start.Add(began + every))):
		}
	}
}

// cpuSeconds is the CPU time this process has used so far (0 where it cannot be read).
func cpuSeconds() float64 {
	var usage syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &usage) != nil {
		return 0
	}
	return time.Duration(usage.Utime.Nano() + usage.Stime.Nano()).Seconds()
}

// percentile is the nearest-rank percentile of sorted values (0 when there are none).
func percentile(sorted []int64, p float64) int64 {
	if len(sorted) == 0 {
		return 0
	}
	rank := min(max(int(math.Ceil(p/100*float64(len(sorted)))), 1), len(sorted))
	return sorted[rank-1]
}

func summarize(s *summary, calls, probes []record) {
	s.Kind, s.Calls, s.Probes, s.Codes = "summary", len(calls), len(probes), map[string]int{}
	lags := make([]int64, 0, len(calls))
	for _, r := range calls {
		s.Codes[r.Code]++
		lags = append(lags, r.LagUs)
		if time.Duration(r.LagUs)*time.Microsecond > lateAfter {
			s.Late++
		}
	}
	slices.Sort(lags)
	s.LagP50Us, s.LagP99Us = percentile(lags, 50), percentile(lags, 99)
	if len(lags) > 0 {
		s.LagMaxUs = lags[len(lags)-1]
	}
}

func write(path string, records []record, s summary) error {
	file, err := os.Create(path)
	if err != nil {
		return err
	}
	out := bufio.NewWriter(file)
	encoder := json.NewEncoder(out)
	for _, r := range records {
		if err := encoder.Encode(r); err != nil {
			file.Close()
			return err
		}
	}
	if err := encoder.Encode(s); err != nil {
		file.Close()
		return err
	}
	if err := out.Flush(); err != nil {
		file.Close()
		return err
	}
	return file.Close()
}

func main() {
	target := flag.String("target", "127.0.0.1:8001", "host:port of the server (cleartext HTTP/2)")
	path := flag.String("path", "/inference.GRPCInferenceService/ModelInfer", "the method's path")
	bodyFile := flag.String("body", "", "file holding the request body: one length-prefixed gRPC message")
	mode := flag.String("mode", "open", "open (Poisson arrivals at -rate) or closed (-concurrency callers)")
	rate := flag.Float64("rate", 100, "open loop: calls due per second")
	concurrency := flag.Int("concurrency", 32, "closed loop: callers")
	duration := flag.Duration("duration", 5*time.Second, "how long calls are sent")
	conns := flag.Int("conns", 4, "HTTP/2 connections the calls go over")
	maxInFlight := flag.Int("max-inflight", 10000, "open loop: outstanding calls at most")
	deadline := flag.Duration("deadline", 10*time.Second, "each call's deadline (grpc-timeout)")
	seed := flag.Uint64("seed", 0, "seed of the arrival times")
	probeEvery := flag.Duration("probe-every", 0, "period of the ServerReady probe (0: none)")
	outFile := flag.String("out", "", "JSON lines file for the calls, probes and summary")
	flag.Parse()
	if err := run(*target, *path, *bodyFile, *mode, *rate, *concurrency, *duration, *conns,
		*maxInFlight, *deadline, *seed, *probeEvery, *outFile); err != nil {
		fmt.Fprintln(os.Stderr, "openloop:", err)
		os.Exit(1)
	}
}

func run(target, path, bodyFile, mode string, rate float64, concurrency int,
	duration time.Duration, conns, maxInFlight int, deadline time.Duration, seed uint64,
	probeEvery time.Duration, outFile string) error {
	body, err := os.ReadFile(bodyFile)
	if err != nil {
		return err
	}
	if _, err := checkFrame(body); err != nil {
		return fmt.Errorf("%s: %w", bodyFile, err)
	}
	if conns < 1 || maxInFlight < 1 || (mode == "open" && rate <= 0) ||
		(mode == "closed" && concurrency < 1) || (mode != "open" && mode != "closed") {
		return errors.New("need -mode open with -rate > 0 or closed with -concurrency > 0, -conns > 0, -max-inflight > 0")
	}
	c := newClient(target, conns)
	defer c.close()
	// One call on each connection first, so none is dialled inside the measured time.
	for _, t := range c.transports {
		if o := c.call(t, path, body, deadline, false); o.code == clientError {
			return fmt.Errorf("first call to %s: %s", target, o.message)
		}
	}
	var due []time.Duration
	if mode == "open" {
		due = poissonSchedule(rate, duration, seed)
	}
	s := summary{Mode: mode, Rate: rate, Concurrency: concurrency, DurationS: duration.Seconds()}
	stop, probed := make(chan struct{}), make(chan []record, 1)
	start := time.Now()
	if probeEvery > 0 {
		prober := newClient(target, 1)
		defer prober.close()
		go func() { probed <- probe(prober, start, probeEvery, stop) }()
	} else {
		probed <- nil
	}
	var calls []record
	if mode == "open" {
		calls = openLoop(c, start, due, path, body, deadline, maxInFlight)
	} else {
		calls = closedLoop(c, start, concurrency, duration, path, body, deadline)
	}
	s.WallS = time.Since(start).Seconds()
	close(stop)
	probes := <-probed
	summarize(&s, calls, probes)
	s.CPUS = cpuSeconds()
	if outFile != "" {
		if err := write(outFile, slices.Concat(calls, probes), s); err != nil {
			return err
		}
	}
	return json.NewEncoder(os.Stdout).Encode(s)
}

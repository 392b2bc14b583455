// The gateway: a front end's gRPC port, in Go. It answers plain V2 ModelInfer and Attend
// calls itself, decoding each request's tensor from the wire straight into shared memory
// and framing the answer from it with one copy, with the ONNX Runtime worker on the other side of the same link
// a Python front end uses; every other call it hands to its Python front end.
//
// Started and watched by the Python front end (service/frontend/gateway.py), which passes
// every setting; it dies with it.
package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// fastMethods are the unary methods answered here when a call is plain: each reads its
// request into the same terms (nil: not plain).
var fastMethods = map[string]func([]byte) *inferRequest{modelInferPath: parseInfer, attendPath: parseAttend}

type gateway struct {
	fast       *fastPath     // nil: every call goes to the Python front end
	restricted *restrictions // the keys the calls answered here need; nil: none
	proxy      http.Handler
	backend    *http.Transport // to the Python front end
	maxReceive int64
	// The largest header block of a call, counted as gRPC core counts it; larger ones are
	// refused here for both paths, so Python's port (given more for the headers the gateway
	// adds) never decides it.
	maxMetadata int
	busy        atomic.Int64 // fast-path calls being answered; read by returnMemoryWhenIdle
	taken       atomic.Int64 // calls and stream messages ever taken, here or by Python
}

// agedAtKey holds when a connection is past its age: --max-connection-age-s spread by
// +-10 percent, as gRPC spreads it, so connections made together do not all go at once.
type agedAtKey struct{}

func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	g.taken.Add(1) // busy counts fast-path calls only: an open stream must not stop the trim
	// net/http's own headers, which gRPC's servers never send (content-length: 0 on an
	// answer with no message)
	w.Header()["Date"] = nil
	w.Header()["Content-Length"] = nil
	if aged, ok := r.Context().Value(agedAtKey{}).(time.Time); ok && time.Now().After(aged) {
		// Past its age: net/http answers "Connection: close" on HTTP/2 with a graceful
		// GOAWAY, so clients reconnect (and client-side balancing spreads them again)
		// while this call and the others in flight finish.
		w.Header().Set("Connection", "close")
	}
	if size := headerBlockSize(r); g.maxMetadata > 0 && size >= g.maxMetadata {
		// gRPC core's check comes first, before any other header's, and refuses a block of
		// exactly the limit too: so here.
		writeStatus(w, codeResourceExhausted, metadataTooLarge(size, g.maxMetadata))
		return
	}
	if checkCallHeaders(w, r) {
		return // answered here as gRPC core answers it, and never passed on
	}
	// Of several grpc-encoding headers gRPC core takes the last (each one checked above).
	encoding := lastValue(r.Header, "Grpc-Encoding")
	plainCall := g.fast != nil && r.Method == http.MethodPost &&
		strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc") &&
		(encoding == "" || encoding == "identity")
	// RequestURI is the :path as sent: a query or percent-encoding is not this method.
	if method := streamMethods[r.RequestURI]; plainCall && method != nil && g.fast.accepting.Load() {
		if g.restricted.admit(w, r) {
			g.serveStream(w, r, method)
		}
		return
	}
	parse, health := fastMethods[r.RequestURI], healthMethods[r.RequestURI]
	if health != nil && (g.fast == nil || !g.fast.answersHealth.Load()) {
		health = nil // the front end has not started: it answers
	}
	if plainCall && (parse != nil || health != nil) {
		timeout, limited, _ := grpcTimeout(r.Header.Get("Grpc-Timeout"))
		deadline := time.Now().Add(timeout)
		if limited {
			// The body is read within the call's deadline, as gRPC core reads it: a body
			// that does not end is DEADLINE_EXCEEDED then, not held until the client resets.
			_ = http.NewResponseController(w).SetReadDeadline(deadline)
		}
		read, message, ok := g.readUnary(r.Body)
		if limited && !time.Now().Before(deadline) {
			// Past its deadline, read or not (one over on arrival, "0S", usually is read):
			// gRPC core ends such a call before any handler, so it is neither computed nor
			// counted, in the request metric or V2 statistics.
			writeStatus(w, codeDeadlineExceeded, deadlineExceeded)
			return
		}
		if ok && read[0] > 1 && health == nil { // a flag byte gRPC gives no meaning: INTERNAL, as grpc-go answers
			writeStatus(w, codeInternal, unexpectedPayloadFormat(int(read[0])))
			return
		}
		served := false
		if health != nil {
			served = ok && read[0] == 0 && g.fast.serveHealth(w, r, health, message, deadlineIf(limited, deadline),
				func() bool { return g.restricted.admit(w, r) })
		} else {
			var request *inferRequest
			if ok {
				request = parse(message)
			}
			if request != nil && !g.restricted.admit(w, r) {
				return // refused as Python refuses it: after reading the message, as Python does
			}
			g.busy.Add(1)
			served = g.fast.serve(w, r, request)
			g.busy.Add(-1)
		}
		if served {
			recycle(read)
			return
		}
		// Not plain, or larger than a message may be: the Python front end decides.
		r.Body = io.NopCloser(io.MultiReader(bytes.NewReader(read), r.Body))
		r.ContentLength = -1
	}
	if t, set, _ := grpcTimeout(r.Header.Get("Grpc-Timeout")); set {
		// Python ends the call at its deadline; a client that stops reading must not hold
		// the answer here long past it: net/http resets the stream stuckWriterGrace later
		// (Python's DEADLINE_EXCEEDED goes first where the client's window lets it).
		_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(t).Add(stuckWriterGrace))
	}
	if g.fast != nil {
		held := &heldAnswer{ResponseWriter: w, metrics: g.fast.metrics}
		defer held.settle()
		w = held
	}
	g.proxy.ServeHTTP(w, r)
}

// lastValue is the last of a header's values ("" when it has none).
func lastValue(header http.Header, name string) string {
	values := header.Values(name)
	if len(values) == 0 {
		return ""
	}
	return values[len(values)-1]
}

// heldAnswer counts a proxied answer's bytes from when Python's front end handed them here
// until the client's connection took them (a slow reader holds them here, up to the
// proxy's stream window), in the undelivered-answers gauge as the fast path's answers.
type heldAnswer struct {
	http.ResponseWriter
	metrics *metrics
	held    int
}

func (h *heldAnswer) Write(p []byte) (int, error) {
	h.metrics.undelivered(float64(len(p)))
	h.held += len(p)
	return h.ResponseWriter.Write(p)
}

// FlushError returns once the client's flow control let the bytes out (or the call ended).
func (h *heldAnswer) FlushError() error {
	err := http.NewResponseController(h.ResponseWriter).Flush()
	h.settle()
	return err
}

func (h *heldAnswer) settle() {
	h.metrics.undelivered(-float64(h.held))
	h.held = 0
}

func (h *heldAnswer) Unwrap() http.ResponseWriter { return h.ResponseWriter }

// returnMemoryWhenIdle gives the heap's free pages back to the kernel once calls have
// stopped for a moment after a burst, as the Python front end trims its memory: a burst's
// message buffers would otherwise stay resident (counted against the container) until the
// runtime's slow background scavenger got to them. It looks after the slab's pages too
// (releaseSlab), every interval.
func (g *gateway) returnMemoryWhenIdle() {
	const idleFor = 500 * time.Millisecond
	seen, wasBusy := int64(0), false
	for range time.Tick(idleFor) {
		taken := g.taken.Load()
		quiet := taken == seen && g.busy.Load() == 0 // a whole interval without a call or message
		seen = taken
		g.releaseSlab(quiet)
		if !quiet {
			wasBusy = true
			continue
		}
		// Every quiet interval: a buffer recycled after the last one (an answer a slow
		// reader took late) is not kept until the next burst.
		largeBuffers.empty()
		if wasBusy {
			wasBusy = false
			// Twice: a sync.Pool's contents (net/http's write queues among them, which
			// still reference the last answers) survive one collection.
			runtime.GC()
			debug.FreeOSMemory()
		}
	}
}

// releaseSlab gives back what a past spike left in the slab, even while calls go on, and
// once quiet every page (shared memory is charged to the container too), as soon as the
// slab is empty: its last regions may be freed after the quiet interval began (an answer
// held for a slow reader, a computation whose caller left).
func (g *gateway) releaseSlab(quiet bool) {
	if g.fast == nil {
		return
	}
	if l := g.fast.worker.use(); l != nil {
		l.slab.releaseAfterSpike()
		if quiet {
			l.slab.releaseIfEmpty()
		}
		l.done()
	}
}

// readUnary reads one uncompressed message of at most maxReceive bytes and the end of the
// body; ok false (with what was read) for anything else. A whole message whose flag byte is
// neither 0 nor 1 is ok too, at once (read[0] is its flag): the caller refuses it.
func (g *gateway) readUnary(body io.Reader) (read, message []byte, ok bool) {
	var prefix [6]byte
	if n, err := io.ReadFull(body, prefix[:5]); err != nil {
		return prefix[:n], nil, false
	}
	length := int64(binary.BigEndian.Uint32(prefix[1:5]))
	if prefix[0] == 1 || length > g.maxReceive {
		return prefix[:5], nil, false
	}
	buffer, complete := readMessage(body, prefix[:5], int(length))
	if !complete {
		return buffer, nil, false
	}
	if prefix[0] != 0 {
		return buffer, buffer[5:], true
	}
	n, err := body.Read(prefix[5:])
	for n == 0 && err == nil {
		n, err = body.Read(prefix[5:])
	}
	if n > 0 { // more than one message: not unary
		return append(buffer, prefix[5]), nil, false
	}
	if err != io.EOF { // the body did not end (the call's deadline, a reset)
		return buffer, nil, false
	}
	return buffer, buffer[5:], true
}

type options struct {
	listen, backend, workerSocket, name, metricsDir string
	tlsCert, tlsKey, tlsClientCA                    string
	fastPath                                        bool
	slabBytes                                       int
	maxSeqLen, maxBatchSize, maxReceive             int64
	clientSharedMemory                              bool
	maxUndelivered, maxUndeliveredPerConnection     int64
	maxStreams, maxMetadata                         int
	streams                                         streamLimits
	pings                                           pingPolicy
	keepalive, keepaliveTimeout, deadlineSlack      time.Duration
	refuseLinger, writeMargin, heartbeat            time.Duration
	idle, maxAge, notServing, grace                 time.Duration
	traceSampler, spansSocket                       string
	drainClock                                      string
}

func parseOptions() options {
	var o options
	var idleS, ageS, notServingS, graceS, keepaliveS, keepaliveTimeoutS, slackS, lingerS, marginS, beatS float64
	var fast string
	flag.StringVar(&o.listen, "listen", defaultListen, "HOST:PORT of the gRPC port")
	flag.StringVar(&o.backend, "backend", "", "Unix socket of this front end's Python process")
	flag.StringVar(&o.workerSocket, "worker-socket", "", "Unix socket of the worker")
	flag.StringVar(&o.name, "name", "gateway", "this front end's name in the worker's logs")
	flag.StringVar(&o.metricsDir, "metrics-dir", os.Getenv("PROMETHEUS_MULTIPROC_DIR"), "prometheus-client multiprocess folder")
	flag.StringVar(&o.tlsCert, "tls-cert", "", "server certificate (PEM)")
	flag.StringVar(&o.tlsKey, "tls-key", "", "server key (PEM)")
	flag.StringVar(&o.tlsClientCA, "tls-client-ca", "", "CA that client certificates must chain to")
	flag.StringVar(&fast, "fast-path", "on", "on: answer plain ModelInfer calls here; off: hand every call on")
	flag.StringVar(&acceptEncoding, "accept-encoding", defaultAcceptEncoding, "grpc-accept-encoding of the answers: the encodings the Python front end takes")
	flag.IntVar(&o.slabBytes, "slab-bytes", defaultSlabBytes, "shared memory for tensors in flight")
	flag.Int64Var(&o.maxSeqLen, "max-seq-len", defaultMaxSeqLen, "")
	flag.BoolVar(&o.clientSharedMemory, "client-shared-memory", defaultClientSharedMemory, "tensors may be in clients' shared-memory regions (the worker holds them)")
	flag.Int64Var(&o.maxBatchSize, "max-batch-size", defaultMaxBatchSize, "")
	flag.Int64Var(&o.maxReceive, "max-receive-bytes", defaultMaxReceiveBytes, "largest request message")
	flag.Int64Var(&o.maxUndelivered, "max-undelivered-bytes", defaultMaxUndeliveredBytes, "this front end's share")
	flag.Int64Var(&o.maxUndeliveredPerConnection, "max-undelivered-bytes-per-connection", defaultMaxUndeliveredBytesPerConnection, "")
	flag.IntVar(&o.maxMetadata, "max-metadata-bytes", defaultMaxMetadataBytes, "largest header block of a call (names, values and 32 bytes each); 0: none")
	flag.Float64Var(&idleS, "max-connection-idle-s", defaultMaxConnectionIdleS, "")
	flag.Float64Var(&ageS, "max-connection-age-s", defaultMaxConnectionAgeS, "0: no limit")
	flag.IntVar(&o.maxStreams, "max-concurrent-streams", defaultMaxConcurrentStreams, "calls at once on one connection")
	flag.IntVar(&o.streams.maxInflight, "max-stream-inflight-requests", defaultMaxStreamInflightRequests, "unanswered messages of one streaming call")
	flag.Int64Var(&o.streams.maxPending, "max-stream-pending-bytes", defaultMaxStreamPendingBytes, "answers' bytes one streaming call may hold unread")
	flag.Float64Var(&keepaliveS, "keepalive-s", defaultKeepaliveS, "ping a connection silent this long")
	flag.Float64Var(&keepaliveTimeoutS, "keepalive-timeout-s", defaultKeepaliveTimeoutS, "close it when the ping goes unanswered this long")
	var minPingS float64
	flag.Float64Var(&minPingS, "min-client-ping-interval-s", defaultMinClientPingIntervalS, "a client ping sooner than this after the last is a strike")
	flag.IntVar(&o.pings.maxStrikes, "max-ping-strikes", defaultMaxPingStrikes, "strikes before GOAWAY too_many_pings; 0: never")
	flag.Float64Var(&slackS, "deadline-slack-s", defaultDeadlineSlackS, "a call cancelled this close to its deadline counts DEADLINE_EXCEEDED")
	flag.Float64Var(&notServingS, "shutdown-not-serving-s", defaultShutdownNotServingS, "")
	flag.Float64Var(&graceS, "grace-period-s", defaultGracePeriodS, "")
	flag.StringVar(&o.drainClock, "drain-clock", "", "file holding the shutdown signal's wall-clock time: the drain runs from it, not from this process's SIGTERM")
	flag.Float64Var(&lingerS, "refuse-linger-s", defaultRefuseLingerS, "drain: refuse new calls this long before closing")
	flag.Float64Var(&marginS, "write-margin-s", defaultWriteMarginS, "drain: fail unfinished calls this long before the grace period ends")
	flag.Float64Var(&beatS, "heartbeat-s", defaultHeartbeatS, "write \"alive\" to standard output this often once listening; 0: never")
	flag.StringVar(&o.traceSampler, "trace-sampler", "", "[parentbased_](always_on|always_off|ratio:BOUND); empty: tracing off")
	flag.StringVar(&o.spansSocket, "spans-socket", "", "Unix socket the Python front end reads sampled calls' records from")
	flag.Parse()
	o.fastPath = fast == "on"
	o.idle = time.Duration(idleS * float64(time.Second))
	o.maxAge = time.Duration(ageS * float64(time.Second))
	o.keepalive = time.Duration(keepaliveS * float64(time.Second))
	o.keepaliveTimeout = time.Duration(keepaliveTimeoutS * float64(time.Second))
	o.pings.minInterval = time.Duration(minPingS * float64(time.Second))
	o.deadlineSlack = time.Duration(slackS * float64(time.Second))
	o.refuseLinger = time.Duration(lingerS * float64(time.Second))
	o.writeMargin = time.Duration(marginS * float64(time.Second))
	o.heartbeat = time.Duration(beatS * float64(time.Second))
	o.notServing = time.Duration(notServingS * float64(time.Second))
	o.grace = time.Duration(graceS * float64(time.Second))
	return o
}

func main() {
	// The heap is mostly short-lived message buffers, bounded by the shared memory and the
	// answers budget: collect less often than the default (profiled: 8% of CPU in GC).
	debug.SetGCPercent(400)
	// But past this much memory, collect as often as it takes: a heap five times the live
	// one is cheap for small messages and hundreds of megabytes for large ones (measured:
	// 160-430 MiB resident over bursts of 16-32 MiB calls).
	debug.SetMemoryLimit(128 << 20)
	// Die with the Python front end that started this process: its restart starts another.
	syscall.RawSyscall(syscall.SYS_PRCTL, syscall.PR_SET_PDEATHSIG, uintptr(syscall.SIGKILL), 0)
	if os.Getppid() == 1 {
		os.Exit(1)
	}
	o := parseOptions()
	startLogging()
	stopProfile, err := profileCPU()
	if err != nil {
		fatal(err)
	}
	startStackBallast()
	err = run(o)
	stopProfile()
	if err != nil {
		fatal(err)
	}
}

func run(o options) error {
	backend := newBackend(o.backend, 1<<20)
	g := &gateway{proxy: newProxy(backend), backend: backend, maxReceive: o.maxReceive,
		maxMetadata: o.maxMetadata}
	restricted, err := loadRestrictions()
	if err != nil {
		return err
	}
	g.restricted = restricted
	var welcomed chan struct{} // closed at the worker's first welcome
	if o.fastPath {
		var spec metricsSpec
		if err := json.Unmarshal([]byte(os.Getenv(metricsVariable)), &spec); err != nil {
			return fmt.Errorf("%s: %w", metricsVariable, err)
		}
		m, err := openMetrics(o.metricsDir, spec)
		if err != nil {
			return fmt.Errorf("metrics files: %w", err)
		}
		w := newWorker(o.workerSocket, o.name, o.slabBytes)
		welcomed = make(chan struct{})
		go w.connectForever(welcomed)
		g.fast = &fastPath{worker: w, limits: limits{o.maxSeqLen, o.maxBatchSize, o.clientSharedMemory}, metrics: m,
			deadlineSlack: o.deadlineSlack, closing: make(chan struct{}), graceOver: make(chan struct{}), streams: o.streams,
			answers: newAnswerBudget(o.maxUndelivered, o.maxUndeliveredPerConnection, m)}
		g.fast.accepting.Store(true)
		if g.restricted != nil {
			g.restricted.metrics = m
		}
		if g.fast.sampler, err = parseSampler(o.traceSampler); err != nil {
			return err
		}
		if g.fast.sampler != nil {
			g.fast.spans = newSpanSink(o.spansSocket)
		}
	}
	go g.returnMemoryWhenIdle()
	listener, err := listen(o.listen)
	if err != nil {
		return err
	}
	server := &http.Server{Handler: logCalls(g), IdleTimeout: o.idle, ReadHeaderTimeout: 10 * time.Second,
		// Past net/http's 500 header values it answers 431, which gRPC clients report as
		// UNKNOWN; gRPC core bounds only the block's size. Every value costs at least 32
		// bytes of the header list, so its size bound comes first and the metadata check
		// in ServeHTTP answers as core does.
		MaxHeaderValueCount: http.DefaultMaxHeaderBytes / 32,
		ErrorLog:            log.New(serverErrors{}, "", 0),
		ConnContext: func(ctx context.Context, _ net.Conn) context.Context {
			if o.maxAge <= 0 {
				return ctx
			}
			spread := time.Duration((0.9 + 0.2*rand.Float64()) * float64(o.maxAge))
			return context.WithValue(ctx, agedAtKey{}, time.Now().Add(spread))
		}}
	var protocols http.Protocols
	policed := policedListener{Listener: listener, policy: o.pings}
	listener = policed
	if o.tlsCert != "" {
		config, err := tlsConfig(o)
		if err != nil {
			return err
		}
		protocols.SetHTTP2(true)
		server.TLSConfig = config
		policed.tls = config
		listener = policed
	} else {
		protocols.SetUnencryptedHTTP2(true)
	}
	server.Protocols = &protocols
	server.HTTP2 = &http.HTTP2Config{
		// As the Python front end's gRPC server (service/transport/grpc_options.py): calls
		// past the bound on one connection are refused (UNAVAILABLE), and a connection
		// silent this long is pinged and closed when the ping goes unanswered.
		MaxConcurrentStreams: o.maxStreams,
		SendPingTimeout:      o.keepalive,
		PingTimeout:          o.keepaliveTimeout,
		// Bigger DATA frames and windows than HTTP/2's defaults (16 KiB, 64 KiB): a 256 KiB
		// tensor in 16 frames and one window update, not 16 and four; what a connection may
		// buffer unread stays bounded by the connection window.
		MaxReadFrameSize:              1 << 20,
		MaxReceiveBufferPerStream:     1 << 20,
		MaxReceiveBufferPerConnection: 8 << 20,
	}
	if g.fast != nil {
		// Asked for before "listening": the front end sends SIGUSR1 once it has started. The
		// health calls are answered here once this gateway has the worker's served set too.
		started := make(chan os.Signal, 1)
		signal.Notify(started, syscall.SIGUSR1)
		go func() {
			<-started
			<-welcomed
			g.fast.worker.startShowing()
			g.fast.answersHealth.Store(true)
		}()
	}
	served := make(chan error, 1)
	go func() { served <- server.Serve(listener) }()
	fmt.Printf("listening %s\n", listener.Addr())
	os.Stdout.Sync()
	if o.heartbeat > 0 {
		go beat(os.Stdout, o.heartbeat)
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	select {
	case err := <-served:
		return err
	case <-signals:
	}
	started := drainStarted(o.drainClock, time.Now())
	wasReady := false
	if g.fast != nil {
		g.fast.draining.Store(true) // grpc.health.v1 says NOT_SERVING from now on, as Python's
		wasReady = g.fast.answersHealth.Load() && g.fast.worker.snapshot().ready
	}
	return drain(server, g.fast, o, wasReady, started)
}

// A shutdown signal's recorded time is this run's when it is neither after this process
// heard of it (clocks read apart by a few milliseconds at most) nor a day before.
const (
	drainClockSlack     = 5 * time.Millisecond
	drainClockPlausible = 24 * time.Hour
)

// drainStarted: when the drain began. The supervisor's shutdown signal, as the file at path
// records it (seconds since the epoch), where that is plausibly this run's (not after heard,
// not a day before it); else heard, the moment this process's SIGTERM came. A gateway hears
// of the signal from its front end, late where that front end's event loop was busy, and
// its drain must end with theirs: one heard later than the grace period gets no time.
func drainStarted(path string, heard time.Time) time.Time {
	if path == "" {
		return heard
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return heard
	}
	seconds, err := strconv.ParseFloat(strings.TrimSpace(string(raw)), 64)
	if err != nil {
		return heard
	}
	agoS := float64(heard.UnixNano())/1e9 - seconds
	if !(agoS >= -drainClockSlack.Seconds() && agoS <= drainClockPlausible.Seconds()) { // NaN too
		return heard
	}
	return heard.Add(-time.Duration(max(0, agoS) * float64(time.Second))) // keeps heard's monotonic reading
}

// beat tells the front end this process still runs, on the standard output it read
// "listening" from: one that stops (the process stopped, or its runtime stalled; handlers
// stuck while it runs do not stop it) is killed there, as the supervisor's watchdog kills
// its children, and restarted with its front end.
func beat(out *os.File, every time.Duration) {
	for range time.Tick(every) {
		if _, err := out.Write([]byte("alive\n")); err != nil {
			return // the front end has gone (this process follows it)
		}
	}
}

// drain: still serving while the health checks say NOT_SERVING (when the server was ready
// at SIGTERM, as the front end does), then refuse new work with UNAVAILABLE, finish what
// was accepted, close; all within the grace period.
func drain(server *http.Server, fast *fastPath, o options, wasReady bool, started time.Time) error {
	deadline := started.Add(o.grace)
	if wasReady || fast == nil { // as the front end: no endpoints to leave when it was not ready
		time.Sleep(min(time.Until(started.Add(o.notServing)), time.Until(deadline)))
	}
	if fast != nil {
		fast.accepting.Store(false)
		close(fast.closing)
		idle := make(chan struct{})
		go func() { fast.inFlight.Wait(); close(idle) }()
		// What is not computed a margin before the end fails UNAVAILABLE, as in the front
		// end, so that its answer is written before the connections close.
		margin := min(o.writeMargin, o.grace/5)
		select {
		case <-idle:
		case <-time.After(time.Until(deadline) - margin):
			close(fast.graceOver)
			select {
			case <-idle:
			case <-time.After(time.Until(deadline)):
			}
		}
	}
	// Refusing a moment longer: a call already on the wire when the connections close would
	// end without the refusal's message, and its client could not tell it was never taken.
	time.Sleep(min(o.refuseLinger, time.Until(deadline)/2))
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	if err := server.Shutdown(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}

func listen(address string) (net.Listener, error) {
	config := net.ListenConfig{Control: func(_, _ string, raw syscall.RawConn) error {
		var setErr error
		err := raw.Control(func(fd uintptr) {
			// Several front ends share the port, as the Python ones do.
			setErr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, 0xf /* SO_REUSEPORT */, 1)
		})
		if err != nil {
			return err
		}
		return setErr
	}}
	listener, err := config.Listen(context.Background(), "tcp", address)
	if err != nil {
		return nil, fmt.Errorf("cannot bind gRPC to %s: %w", address, err)
	}
	return listener, nil
}

// tlsConfig serves the certificate and key as they are on disk at each handshake (a
// renewed certificate is picked up without a restart), and asks for client certificates
// when a client CA is given.

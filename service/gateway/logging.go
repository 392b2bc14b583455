package main

// The gateway's log lines, in the format and at the level of every Python process
// (service/observability/logs.py): text, "TIME LEVEL [gateway-K] gateway: MESSAGE", or one
// JSON object per line with time (RFC 3339, UTC), level, process, logger and message, and
// trace_id inside a call where the caller sent one. The level and format follow the run
// directory's settings file, which a v2/logging or LogSettings call rewrites: this process
// looks at it a few times a second, as the Python processes do.

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode"
)

const (
	loggerName         = "gateway"
	levelOff           = slog.Level(1000) // Triton's settings can turn every level off
	followLogSettingsS = 250 * time.Millisecond
	jsonTime           = "2006-01-02T15:04:05.000000Z"
	textTime           = "2006-01-02 15:04:05,000" // Python logging's asctime
	maxLoggedPath      = 200                       // of a call's path, as the client sent it
)

var (
	logProcess      = flag.String("log-process", "gateway", "this process's name in its log lines (gateway-K)")
	logLevelFlag    = flag.String("log-level", defaultLogLevel, "DEBUG, INFO, WARNING, ERROR or OFF")
	logFormatFlag   = flag.String("log-format", defaultLogFormat, "text or json")
	logSettingsFile = flag.String("log-settings", "", "the run directory's log settings file, followed for changes")
	logs            = newLineHandler(os.Stderr, "gateway")
)

// logSettings is the settings file's content (logs.LogState.to_json on the Python side).
type logSettings struct {
	Level  string `json:"level"`
	Format string `json:"format"`
}

var levelOf = map[string]slog.Level{
	"DEBUG": slog.LevelDebug, "INFO": slog.LevelInfo, "WARNING": slog.LevelWarn,
	"ERROR": slog.LevelError, "OFF": levelOff,
}

func levelName(l slog.Level) string {
	switch {
	case l < slog.LevelInfo:
		return "DEBUG"
	case l < slog.LevelWarn:
		return "INFO"
	case l < slog.LevelError:
		return "WARNING"
	}
	return "ERROR"
}

// lineHandler is a slog.Handler writing whole lines; its level and format change at run
// time, for every logger made from it.
type lineHandler struct {
	shared *lineOutput
	attrs  []slog.Attr
}

type lineOutput struct {
	mu      sync.Mutex
	out     io.Writer
	process string
	level   slog.LevelVar
	json    atomic.Bool
}

func newLineHandler(out io.Writer, process string) *lineHandler {
	return &lineHandler{shared: &lineOutput{out: out, process: process}}
}

// apply switches to s's level and format; false (and no change) when s names neither.
func (h *lineHandler) apply(s logSettings) bool {
	level, ok := levelOf[s.Level]
	if !ok || (s.Format != "text" && s.Format != "json") {
		return false
	}
	h.shared.level.Set(level)
	h.shared.json.Store(s.Format == "json")
	return true
}

func (h *lineHandler) Enabled(_ context.Context, l slog.Level) bool {
	return l >= h.shared.level.Level()
}

func (h *lineHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &lineHandler{shared: h.shared, attrs: append(append([]slog.Attr{}, h.attrs...), attrs...)}
}

func (h *lineHandler) WithGroup(string) slog.Handler { return h } // no groups are logged

func (h *lineHandler) Handle(_ context.Context, r slog.Record) error {
	attrs := append([]slog.Attr{}, h.attrs...)
	r.Attrs(func(a slog.Attr) bool { attrs = append(attrs, a); return true })
	var line bytes.Buffer
	if h.shared.json.Load() {
		h.jsonLine(&line, r, attrs)
	} else {
		h.textLine(&line, r, attrs)
	}
	h.shared.mu.Lock()
	defer h.shared.mu.Unlock()
	_, err := h.shared.out.Write(line.Bytes())
	return err
}

func (h *lineHandler) jsonLine(line *bytes.Buffer, r slog.Record, attrs []slog.Attr) {
	fields := []struct {
		key   string
		value any
	}{
		{"time", r.Time.UTC().Format(jsonTime)}, {"level", levelName(r.Level)},
		{"process", h.shared.process}, {"logger", loggerName}, {"message", r.Message},
	}
	line.WriteByte('{')
	for i, f := range fields {
		if i > 0 {
			line.WriteByte(',')
		}
		writeJSONField(line, f.key, f.value)
	}
	for _, a := range attrs {
		line.WriteByte(',')
		writeJSONField(line, a.Key, a.Value.Resolve().Any())
	}
	line.WriteString("}\n")
}

func writeJSONField(line *bytes.Buffer, key string, value any) {
	encoded, err := json.Marshal(value)
	if err != nil {
		encoded, _ = json.Marshal(fmt.Sprint(value))
	}
	name, _ := json.Marshal(key)
	line.Write(name)
	line.WriteByte(':')
	line.Write(encoded)
}

func (h *lineHandler) textLine(line *bytes.Buffer, r slog.Record, attrs []slog.Attr) {
	fmt.Fprintf(line, "%s %s [%s] %s: %s", r.Time.Format(textTime), levelName(r.Level),
		h.shared.process, loggerName, r.Message)
	for _, a := range attrs {
		value := a.Value.Resolve().Any()
		if s, ok := value.(string); ok && !bare(s) {
			value = strconv.Quote(s) // a client's string (a request id) forges no line or field
		}
		fmt.Fprintf(line, " %s=%v", a.Key, value)
	}
	line.WriteByte('\n')
}

// bare: a text line's attribute value written as it is (no space, quote, '=' or character
// that is not printed).
func bare(s string) bool {
	for _, r := range s {
		if !unicode.IsPrint(r) || r == ' ' || r == '"' || r == '=' {
			return false
		}
	}
	return s != ""
}

// startLogging makes every log line of this process (log.Printf's included) one of ours, as
// the flags say, and follows the settings file.
func startLogging() {
	logs.shared.process = *logProcess
	logTo, logFDErr := logOutput()
	if logTo != nil {
		logs.shared.out = logTo
	}
	understood := logs.apply(logSettings{Level: *logLevelFlag, Format: *logFormatFlag})
	if !understood {
		logs.apply(logSettings{Level: "INFO", Format: "text"})
	}
	slog.SetDefault(slog.New(logs))
	slog.SetLogLoggerLevel(slog.LevelInfo) // log.Printf's lines: INFO
	if !understood {
		slog.Warn(fmt.Sprintf("--log-level %q / --log-format %q not understood: INFO, text",
			*logLevelFlag, *logFormatFlag))
	}
	if logFDErr != nil {
		slog.Warn(fmt.Sprintf("logging to standard error: %v", logFDErr))
	}
	slog.Info(fmt.Sprintf("gateway %s started (pid %d)", *logProcess, os.Getpid()))
	if *logSettingsFile != "" {
		go logs.follow(*logSettingsFile, followLogSettingsS)
	}
}

// logOutput is the descriptor logFDVariable names, where the front end has made standard
// error a FIFO that relays what Go's runtime writes there (a panic, a goroutine dump) as log
// lines: this process's own lines go to the descriptor, never through the relay. nil, nil
// when it names none (standard error, then).
func logOutput() (*os.File, error) {
	fd, named, err := inheritedFD(logFDVariable)
	if !named {
		return nil, err
	}
	var stat syscall.Stat_t
	if err := syscall.Fstat(fd, &stat); err != nil {
		return nil, fmt.Errorf("%s=%d: %w", logFDVariable, fd, err)
	}
	return os.NewFile(uintptr(fd), "log"), nil
}

// serverErrors is net/http's ErrorLog. It logs a handler's panic, which net/http recovers
// (resetting the call) and reports only there, at ERROR, its stack cut to maxPanicBytes;
// the rest it reports there (a client's broken TLS handshake or HTTP/2 preface) is the
// client's doing, and not logged.
type serverErrors struct{}

const maxPanicBytes = 3000

func (serverErrors) Write(p []byte) (int, error) {
	line := strings.TrimRight(string(p), "\n")
	if strings.Contains(line, ": panic serving ") {
		if len(line) > maxPanicBytes {
			line = fmt.Sprintf("%s ... (%d bytes more)", strings.ToValidUTF8(line[:maxPanicBytes], ""),
				len(line)-maxPanicBytes)
		}
		slog.Error(line)
	}
	return len(p), nil
}

// inheritedFD is the descriptor the front end names in variable, which it unsets so that
// what this process starts never sees it; named is false when the variable names none (err
// says why where it holds something else).
func inheritedFD(variable string) (fd int, named bool, err error) {
	number := os.Getenv(variable)
	if number == "" {
		return 0, false, nil
	}
	os.Unsetenv(variable)
	fd, err = strconv.Atoi(number)
	if err != nil || fd < 3 {
		return 0, false, fmt.Errorf("%s=%q is not a file descriptor", variable, number)
	}
	return fd, true, nil
}

// fileSignature tells a rewritten settings file (renamed over the old one) from the last.
type fileSignature struct {
	inode uint64
	mtime int64
	size  int64
}

// follow applies the settings file whenever it changes.
func (h *lineHandler) follow(path string, every time.Duration) {
	var seen fileSignature
	for range time.Tick(every) {
		seen = h.applyIfChanged(path, seen)
	}
}

func (h *lineHandler) applyIfChanged(path string, seen fileSignature) fileSignature {
	info, err := os.Stat(path)
	if err != nil {
		return seen
	}
	now := fileSignature{mtime: info.ModTime().UnixNano(), size: info.Size()}
	if stat, ok := info.Sys().(*syscall.Stat_t); ok {
		now.inode = stat.Ino
	}
	if now == seen {
		return seen
	}
	raw, err := os.ReadFile(path)
	var s logSettings
	if err == nil && json.Unmarshal(raw, &s) == nil {
		h.changeTo(s)
	}
	return now
}

// changeTo applies s when it changes something, saying so where it shows: before a change
// that hides INFO lines, after one that shows them (as the Python processes do).
func (h *lineHandler) changeTo(s logSettings) {
	level, ok := levelOf[s.Level]
	if !ok || (s.Format != "text" && s.Format != "json") ||
		(level == h.shared.level.Level() && (s.Format == "json") == h.shared.json.Load()) {
		return
	}
	said := fmt.Sprintf("log settings changed: level %s, format %s", s.Level, s.Format)
	logger := slog.New(h)
	if level > slog.LevelInfo {
		logger.Info(said)
		h.apply(s)
	} else {
		h.apply(s)
		logger.Info(said)
	}
}

// fatal logs why the gateway cannot go on and tells the front end that started it (on
// standard output, where it waits for "listening ..."), then exits.
func fatal(err error) {
	slog.Error("cannot go on: " + err.Error())
	fmt.Printf("failed %s\n", err)
	os.Stdout.Sync()
	os.Exit(1)
}

// logCalls logs each call at DEBUG as it arrives, before it is answered (no line per call at
// INFO or above: only a level check).
func logCalls(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if logs.Enabled(r.Context(), slog.LevelDebug) {
			path := r.URL.Path
			if len(path) > maxLoggedPath {
				path = path[:maxLoggedPath] + "..."
			}
			attrs := []any{"peer", r.RemoteAddr}
			if traceID, ok := traceIDOf(r.Header.Get("Traceparent")); ok {
				attrs = append(attrs, "trace_id", traceID)
			}
			slog.Debug("call "+strconv.Quote(path), attrs...)
		}
		next.ServeHTTP(w, r)
	})
}

// logEnded logs a call this process answered itself at DEBUG as it ends, as the Python
// front end logs each of its calls: with the call's request id and, when it is traced, the
// trace and span ids of its span here (the caller's trace id alone when not sampled).
func logEnded(r *http.Request, req *inferRequest, code int, took time.Duration) {
	if !logs.Enabled(r.Context(), slog.LevelDebug) {
		return
	}
	var attrs []any
	if req.trace != nil {
		attrs = append(attrs, "trace_id", hex.EncodeToString(req.trace.traceID[:]),
			"span_id", hex.EncodeToString(req.trace.spanID[:]))
	} else if traceID, ok := traceIDOf(r.Header.Get("Traceparent")); ok {
		attrs = append(attrs, "trace_id", traceID)
	}
	if req.id != "" {
		attrs = append(attrs, "request_id", firstChars(req.id, shownChars)) // a client's: bounded
	}
	method := r.URL.Path[strings.LastIndexByte(r.URL.Path, '/')+1:]
	slog.Debug(fmt.Sprintf("%s %s ended %s after %.6f s", req.api, method, codeNames[code], took.Seconds()), attrs...)
}

// logStreamEnded writes a stream's end at DEBUG, as the Python front end does: how it ended,
// after how long, and how many requests were read from it (each has an answer or an error
// message of its own in the stream).
func logStreamEnded(r *http.Request, api string, code int, took time.Duration, read int64) {
	if !logs.Enabled(r.Context(), slog.LevelDebug) {
		return
	}
	var attrs []any
	if traceID, ok := traceIDOf(r.Header.Get("Traceparent")); ok {
		attrs = append(attrs, "trace_id", traceID)
	}
	method := r.URL.Path[strings.LastIndexByte(r.URL.Path, '/')+1:]
	slog.Debug(fmt.Sprintf("%s %s ended %s after %.6f s, %s", api, method, codeNames[code], took.Seconds(), requestsRead(read)), attrs...)
}

// requestsRead: "1 request read", "3 requests read" (worded as the Python front end's).
func requestsRead(count int64) string {
	if count == 1 {
		return "1 request read"
	}
	return fmt.Sprintf("%d requests read", count)
}

// firstChars is text cut after n characters.
func firstChars(text string, n int) string {
	for i := range text {
		if n == 0 {
			return text[:i]
		}
		n--
	}
	return text
}

// traceIDOf is a W3C traceparent's trace id (32 lower-case hex digits, not all zero).
func traceIDOf(traceparent string) (string, bool) {
	if len(traceparent) < 55 || traceparent[2] != '-' || traceparent[35] != '-' {
		return "", false
	}
	id := traceparent[3:35]
	zero := true
	for _, c := range []byte(id) {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return "", false
		}
		zero = zero && c == '0'
	}
	if zero {
		return "", false
	}
	return id, true
}

package main

import (
	"bytes"
	"encoding/json"
	"io"
	"log"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestJSONLinesCarryThePythonFields(t *testing.T) {
	var out bytes.Buffer
	h := newLineHandler(&out, "gateway-3")
	h.apply(logSettings{Level: "INFO", Format: "json"})
	logger := slog.New(h)
	logger.Debug("not shown at INFO")
	logger.Info("worker link: \"quoted\"\nnewline", "trace_id", "0af7651916cd43dd8448eb211c80319c")
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 1 {
		t.Fatalf("want one line, got %q", out.String())
	}
	var line map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &line); err != nil {
		t.Fatalf("%q: %v", lines[0], err)
	}
	want := map[string]any{
		"level": "INFO", "process": "gateway-3", "logger": "gateway",
		"message": "worker link: \"quoted\"\nnewline", "trace_id": "0af7651916cd43dd8448eb211c80319c",
	}
	for key, value := range want {
		if line[key] != value {
			t.Errorf("%s = %v, want %v", key, line[key], value)
		}
	}
	stamp, err := time.Parse(time.RFC3339Nano, line["time"].(string))
	if err != nil || !strings.HasSuffix(line["time"].(string), "Z") || time.Since(stamp) > time.Minute {
		t.Errorf("time %v is not RFC 3339 in UTC, now: %v", line["time"], err)
	}
}

func TestTextLinesAndLevelsAsPythonNamesThem(t *testing.T) {
	var out bytes.Buffer
	h := newLineHandler(&out, "gateway-0")
	h.apply(logSettings{Level: "WARNING", Format: "text"})
	logger := slog.New(h)
	logger.Info("hidden")
	logger.Warn("shown", "peer", "127.0.0.1:5")
	got := out.String()
	if !strings.Contains(got, " WARNING [gateway-0] gateway: shown peer=127.0.0.1:5\n") || strings.Contains(got, "hidden") {
		t.Fatalf("text line %q", got)
	}
	out.Reset()
	logger.Warn("ended", "request_id", "nl\n{\"level\":\"ERROR\"} x=1\x1b[31m\u2028")
	if got := out.String(); !strings.HasSuffix(got, ` ended request_id="nl\n{\"level\":\"ERROR\"} x=1\x1b[31m\u2028"`+"\n") || strings.Count(got, "\n") != 1 {
		t.Fatalf("a client's string forged a text line or field: %q", got)
	}
	if h.apply(logSettings{Level: "VERBOSE", Format: "text"}) || h.apply(logSettings{Level: "INFO", Format: "xml"}) {
		t.Fatal("unknown level or format applied")
	}
	h.apply(logSettings{Level: "OFF", Format: "text"})
	out.Reset()
	logger.Error("nothing at all")
	if out.Len() != 0 {
		t.Fatalf("OFF logged %q", out.String())
	}
}

// The settings file as Python writes it (tests/golden/log-settings.json, checked byte for
// byte by tests/observability/test_logs.py), followed when it is replaced.
func TestTheSettingsFileIsFollowed(t *testing.T) {
	golden, err := os.ReadFile(filepath.Join("..", "..", "tests", "golden", "log-settings.json"))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "log-settings.json")
	h := newLineHandler(&bytes.Buffer{}, "gateway-0")
	h.apply(logSettings{Level: "INFO", Format: "text"})
	seen := h.applyIfChanged(path, fileSignature{}) // no file yet: nothing changes
	if err := os.WriteFile(path, golden, 0o600); err != nil {
		t.Fatal(err)
	}
	seen = h.applyIfChanged(path, seen)
	if h.shared.level.Level() != slog.LevelDebug || !h.shared.json.Load() {
		t.Fatalf("golden settings not applied: level %v json %v", h.shared.level.Level(), h.shared.json.Load())
	}
	replacement := filepath.Join(filepath.Dir(path), ".new")
	if err := os.WriteFile(replacement, []byte(`{"level": "ERROR", "format": "text"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(replacement, path); err != nil {
		t.Fatal(err)
	}
	h.applyIfChanged(path, seen)
	if h.shared.level.Level() != slog.LevelError || h.shared.json.Load() {
		t.Fatal("the replaced file was not applied")
	}
}

func TestTraceIDOfATraceparent(t *testing.T) {
	for header, want := range map[string]string{
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01": "0af7651916cd43dd8448eb211c80319c",
		"00-00000000000000000000000000000000-b7ad6b7169203331-01": "",
		"00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01": "",
		"00-0af7651916cd43dd8448eb211c80319c":                     "",
		"":                                                        "",
	} {
		if got, _ := traceIDOf(header); got != want {
			t.Errorf("traceIDOf(%q) = %q, want %q", header, got, want)
		}
	}
}

func TestLogLinesGoToTheDescriptorTheFrontEndNames(t *testing.T) {
	read, write, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer read.Close()
	// A descriptor of its own, as an inherited one is: the *os.File of write would close its
	// number again when collected, by then perhaps another test's file (TempDir's cleanup
	// failed with EBADF).
	named, err := syscall.Dup(int(write.Fd()))
	write.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(logFDVariable, strconv.Itoa(named))
	out, err := logOutput()
	if err != nil || out == nil {
		t.Fatalf("logOutput() = %v, %v", out, err)
	}
	if os.Getenv(logFDVariable) != "" {
		t.Error("the variable is left for processes this one starts")
	}
	h := newLineHandler(out, "gateway-0")
	h.apply(logSettings{Level: "INFO", Format: "text"})
	slog.New(h).Info("to the descriptor")
	out.Close()
	got, _ := io.ReadAll(read)
	if !strings.Contains(string(got), "INFO [gateway-0] gateway: to the descriptor") {
		t.Errorf("read %q", got)
	}

	for _, bad := range []string{"two", "1", "999999"} {
		t.Setenv(logFDVariable, bad)
		if out, err := logOutput(); out != nil || err == nil {
			t.Errorf("%s=%s: %v, %v; want an error", logFDVariable, bad, out, err)
		}
	}
	os.Unsetenv(logFDVariable)
	if out, err := logOutput(); out != nil || err != nil {
		t.Errorf("unset: %v, %v; want nil, nil", out, err)
	}
}

func TestAHandlersPanicIsLoggedAndClientNoiseIsNot(t *testing.T) {
	var out bytes.Buffer
	h := newLineHandler(&out, "gateway-0")
	h.apply(logSettings{Level: "INFO", Format: "json"})
	previous := slog.Default()
	slog.SetDefault(slog.New(h))
	defer slog.SetDefault(previous)
	server := &http.Server{ErrorLog: log.New(serverErrors{}, "", 0)}
	server.ErrorLog.Printf("http: TLS handshake error from 127.0.0.1:5: EOF")
	server.ErrorLog.Printf("http2: server: error reading preface from client 127.0.0.1:6: EOF")
	if out.Len() != 0 {
		t.Fatalf("client noise logged: %q", out.String())
	}
	stack := strings.Repeat("main.(*fastPath).serve(...)\n\t/src/infer.go:1 +0x1d\n", 200)
	server.ErrorLog.Printf("http2: panic serving 127.0.0.1:7: runtime error: index out of range\n%s", stack)
	var record map[string]any
	if err := json.Unmarshal(out.Bytes(), &record); err != nil {
		t.Fatalf("%v: %q", err, out.String())
	}
	message, _ := record["message"].(string)
	if record["level"] != "ERROR" || !strings.HasPrefix(message, "http2: panic serving 127.0.0.1:7: runtime error") ||
		!strings.HasSuffix(message, "bytes more)") || len(message) > maxPanicBytes+40 {
		t.Errorf("record %v", record)
	}
}

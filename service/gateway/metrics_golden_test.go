package main

// The golden multiprocess files of tests/golden/metrics/, written by prometheus-client itself
// for the gateway's series (scripts/golden_metrics.py; checked on the Python side by
// tests/gateway/test_golden_metrics.py): the gateway's writer lays their entries out byte
// for byte, and its metrics calls write the same series, with the same values, into files
// of the same names, as prometheus-client's metrics do for the same events.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"syscall"
	"testing"
)

var goldenMetricsDir = filepath.Join("..", "..", "tests", "golden", "metrics")

type goldenMetrics struct {
	PID   int         `json:"pid"`
	Spec  metricsSpec `json:"spec"`
	Calls []struct {
		Call    string  `json:"call"`
		Model   string  `json:"model"`
		API     string  `json:"api"`
		Code    string  `json:"code"`
		Seconds float64 `json:"seconds"`
		Delta   float64 `json:"delta"`
		Scope   string  `json:"scope"`
		Group   string  `json:"group"`
	} `json:"calls"`
	Files map[string][]struct {
		Key       string  `json:"key"`
		Value     float64 `json:"value"`
		Timestamp float64 `json:"timestamp"`
	} `json:"files"`
}

func readGoldenMetrics(t *testing.T) goldenMetrics {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(goldenMetricsDir, "samples.json"))
	if err != nil {
		t.Fatal(err)
	}
	var g goldenMetrics
	if err := json.Unmarshal(data, &g); err != nil {
		t.Fatal(err)
	}
	if len(g.Files) != 3 || len(g.Calls) == 0 {
		t.Fatalf("samples.json: %d files, %d calls", len(g.Files), len(g.Calls))
	}
	return g
}

// The writer's layout: each golden file's entries, added in its order, give its bytes.
func TestGoldenMetricsFilesAreWrittenByteForByte(t *testing.T) {
	g := readGoldenMetrics(t)
	for name, entries := range g.Files {
		path := filepath.Join(t.TempDir(), name)
		f, err := openMmapFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if e.Timestamp != 0 {
				t.Fatalf("%s: %s has a timestamp; the gateway writes none", name, e.Key)
			}
			f.add(e.Key, e.Value)
		}
		syscall.Munmap(f.mem)
		f.file.Close()
		got, want := readFile(t, path), readFile(t, filepath.Join(goldenMetricsDir, name))
		if !bytes.Equal(got, want) {
			at := 0
			for at < len(got) && at < len(want) && got[at] == want[at] {
				at++
			}
			t.Errorf("%s: %d bytes, prometheus-client's %d; the first difference at byte %d", name, len(got), len(want), at)
		}
	}
}

// The gateway's calls: the same series and values as prometheus-client's metrics write for
// the same events, in files named alike (this process's id for the golden one's).
func TestGoldenMetricsSeriesAreWrittenByTheGatewaysCalls(t *testing.T) {
	g := readGoldenMetrics(t)
	dir := t.TempDir()
	m, err := openMetrics(dir, g.Spec)
	if err != nil {
		t.Fatal(err)
	}
	codes := map[string]int{}
	for code, name := range codeNames {
		codes[name] = code
	}
	for _, c := range g.Calls {
		switch c.Call {
		case "finished":
			code, known := codes[c.Code]
			if !known {
				t.Fatalf("no status code %q", c.Code)
			}
			m.finished(c.Model, c.API, code, c.Seconds)
		case "in_flight":
			m.inFlight(c.API, c.Delta)
		case "undelivered":
			m.undelivered(c.Delta)
		case "refused":
			m.refused(c.Scope)
		case "restricted_denial":
			m.restrictedDenial(c.Group)
		default:
			t.Fatalf("a call the test does not know: %q", c.Call)
		}
	}
	written, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names, want []string
	for _, entry := range written {
		names = append(names, entry.Name())
	}
	goldenSuffix := fmt.Sprintf("_%d.db", g.PID)
	for name := range g.Files {
		if !strings.HasSuffix(name, goldenSuffix) {
			t.Fatalf("%s: not a file of process %d", name, g.PID)
		}
		ours := strings.TrimSuffix(name, goldenSuffix) + fmt.Sprintf("_%d.db", os.Getpid())
		want = append(want, ours)
		got := series(t, metricValues(t, filepath.Join(dir, ours)))
		expected := series(t, metricValues(t, filepath.Join(goldenMetricsDir, name)))
		if !reflect.DeepEqual(got, expected) {
			t.Errorf("%s: the gateway wrote\n%v\nprometheus-client\n%v", ours, got, expected)
		}
	}
	sort.Strings(names)
	sort.Strings(want)
	if !reflect.DeepEqual(names, want) {
		t.Errorf("files %v, want %v", names, want)
	}
}

// series reads each key as the multiprocess collector does (JSON: family, sample, labels,
// help), whatever its spelling: the collector merges series by what the keys say.
func series(t *testing.T, values map[string]float64) map[string]float64 {
	t.Helper()
	read := map[string]float64{}
	for key, value := range values {
		var parts []any
		if err := json.Unmarshal([]byte(key), &parts); err != nil || len(parts) != 4 {
			t.Fatalf("a key that is not [family, sample, labels, help]: %s", key)
		}
		canonical, _ := json.Marshal(parts)
		read[string(canonical)] = value
	}
	return read
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

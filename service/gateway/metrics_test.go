package main

import (
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"testing"
)

// metricValues reads a prometheus-client multiprocess file: key -> value.
func metricValues(t *testing.T, path string) map[string]float64 {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	used := int(binary.LittleEndian.Uint32(data))
	values := map[string]float64{}
	for pos := 8; pos < used; {
		length := int(binary.LittleEndian.Uint32(data[pos:]))
		pos += 4
		name := string(data[pos : pos+length])
		pos += length + (8 - (length+4)%8)
		values[name] = math.Float64frombits(binary.LittleEndian.Uint64(data[pos:]))
		pos += 16
	}
	return values
}

// A series the gateway alone writes still has every bucket, +Inf included: without it the
// merged histogram has no quantiles (histogram_quantile answers NaN).
func TestEveryBucketOfANewSeriesIsWritten(t *testing.T) {
	dir := t.TempDir()
	spec := metricsSpec{Requests: metricSpec{Family: "r", Sample: "r_total", Help: "h"}}
	spec.Duration.Family, spec.Duration.Help = "d", "h"
	spec.Duration.Bounds = []float64{0.01, 0.1, 1e308}
	spec.Duration.Labels = []string{"0.01", "0.1", "+Inf"}
	m, err := openMetrics(dir, spec)
	if err != nil {
		t.Fatal(err)
	}
	m.finished("causal", "attention", codeOK, 0.005)
	m.finished("causal", "attention", codeOK, 0.006)
	values := metricValues(t, filepath.Join(dir, "histogram_"+itoa(os.Getpid())+".db"))
	want := map[string]float64{"0.01": 2, "0.1": 0, "+Inf": 0}
	for le, count := range want {
		k := key("d", "d_bucket", map[string]string{"model": "causal", "api": "attention", "le": le}, "h")
		got, ok := values[k]
		if !ok || got != count {
			t.Errorf("bucket le=%s: %v (present %v), want %v", le, got, ok, count)
		}
	}
}

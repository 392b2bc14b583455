package main

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestTheDrainRunsFromTheSupervisorsSignal(t *testing.T) {
	grace := 2 * time.Second
	heard := time.Now()
	write := func(content string) string {
		path := filepath.Join(t.TempDir(), "shutdown-signal")
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	epoch := func(at time.Time) string { return fmt.Sprintf("%.6f", float64(at.UnixNano())/1e9) }
	signalled := heard.Add(-700 * time.Millisecond)
	got := drainStarted(write(epoch(signalled)), grace, heard)
	if d := heard.Sub(got); d < 699*time.Millisecond || d > 701*time.Millisecond {
		t.Errorf("signal 700ms before SIGTERM was heard: drain started %v before it", d)
	}
	for name, path := range map[string]string{
		"no flag":                  "",
		"no file":                  filepath.Join(t.TempDir(), "absent"),
		"not a number":             write("soon"),
		"older than the grace":     write(epoch(heard.Add(-3 * time.Second))),
		"after this process heard": write(epoch(heard.Add(time.Second))),
	} {
		if got := drainStarted(path, grace, heard); !got.Equal(heard) {
			t.Errorf("%s: drain started %v before SIGTERM was heard, want from then", name, heard.Sub(got))
		}
	}
}

package main

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestTheDrainRunsFromTheSupervisorsSignal(t *testing.T) {
	heard := time.Now()
	write := func(content string) string {
		path := filepath.Join(t.TempDir(), "shutdown-signal")
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	epoch := func(at time.Time) string { return fmt.Sprintf("%.6f", float64(at.UnixNano())/1e9) }
	for _, ago := range []time.Duration{700 * time.Millisecond, time.Hour} { // an hour: no time left
		got := drainStarted(write(epoch(heard.Add(-ago))), heard)
		if d := heard.Sub(got); d < ago-time.Millisecond || d > ago+time.Millisecond {
			t.Errorf("signal %v before SIGTERM was heard: drain started %v before it", ago, d)
		}
	}
	for name, path := range map[string]string{
		"no flag":                  "",
		"no file":                  filepath.Join(t.TempDir(), "absent"),
		"not a number":             write("soon"),
		"older than a day":         write(epoch(heard.Add(-25 * time.Hour))),
		"after this process heard": write(epoch(heard.Add(time.Second))),
		"NaN":                      write("NaN"),
		"infinite":                 write("-Inf"),
		"out of range":             write("1e300"),
	} {
		if got := drainStarted(path, heard); !got.Equal(heard) {
			t.Errorf("%s: drain started %v before SIGTERM was heard, want from then", name, heard.Sub(got))
		}
	}
}

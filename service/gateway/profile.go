package main

import (
	"fmt"
	"os"
	"runtime/pprof"
)

// profileCPU writes a CPU profile of this gateway to the file that
// ATTENTION_GATEWAY_CPU_PROFILE names, from start to a clean exit (SIGTERM), for
// `go tool pprof`; the returned stop ends it. Unset, it does nothing.
func profileCPU() (stop func(), err error) {
	path := os.Getenv("ATTENTION_GATEWAY_CPU_PROFILE")
	if path == "" {
		return func() {}, nil
	}
	file, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("ATTENTION_GATEWAY_CPU_PROFILE: %w", err)
	}
	if err := pprof.StartCPUProfile(file); err != nil {
		file.Close()
		return nil, fmt.Errorf("ATTENTION_GATEWAY_CPU_PROFILE: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		file.Close()
	}, nil
}

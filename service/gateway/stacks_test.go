package main

import (
	"os"
	"runtime"
	runtimemetrics "runtime/metrics"
	"strings"
	"testing"
)

// startingStack is the first stack a goroutine started now gets.
func startingStack(t *testing.T) uint64 {
	sample := []runtimemetrics.Sample{{Name: "/gc/stack/starting-size:bytes"}}
	runtimemetrics.Read(sample)
	if sample[0].Value.Kind() != runtimemetrics.KindUint64 {
		t.Skip("this Go runtime does not report its goroutines' starting stack size")
	}
	return sample[0].Value.Uint64()
}

// The ballast makes new goroutines start at ballastStack: not smaller (a call's goroutines
// would grow theirs), and not larger (every goroutine would hold more memory than a call
// needs).
func TestTheBallastStartsNewGoroutinesAtTheStackACallNeeds(t *testing.T) {
	if strings.Contains(os.Getenv("GODEBUG"), "adaptivestackstart=0") {
		t.Skip("GODEBUG turns the runtime's adaptive starting stacks off")
	}
	runtime.GC()
	before := startingStack(t)
	startStackBallast()
	after := startingStack(t)
	if after != ballastStack {
		t.Fatalf("new goroutines start with %d bytes of stack (%d before the ballast); want %d",
			after, before, ballastStack)
	}
	runtime.GC() // a later collection, with the ballast still parked, keeps it
	if again := startingStack(t); again != ballastStack {
		t.Fatalf("after another collection new goroutines start with %d bytes; want %d", again, ballastStack)
	}
}

package main

import "runtime"

// Go starts each goroutine with a stack the size of the average in use at the last
// collection, and copies it to one twice the size each time it runs out. Most of this
// process's goroutines are connections' readers, parked with little stack in use, so the
// average is small; but every unary call runs on goroutines net/http starts for it (its
// handler, and one per frame write), whose deeper stacks then grew two or three times a
// call. Profiled at one caller (seq 16): 9% of the gateway's CPU in runtime.copystack,
// about 30 us a call. Parked goroutines with a stack of their own in use tilt the average
// so that new ones start at ballastStack.
const (
	ballastGoroutines = 256
	ballastStack      = 8 << 10 // what a call's goroutines use (measured: none grew at 8 KiB)
	// What each of them keeps in use: the average rounds up to a power of two above it,
	// with room for the runtime's guard.
	ballastUse = ballastStack * 3 / 4
)

// startStackBallast parks the goroutines that raise new goroutines' first stack to
// ballastStack (2 MiB in all), and collects once so that the next stacks start so. With many
// connections open the average falls back towards what it was without them, never below.
func startStackBallast() {
	started := make(chan struct{})
	for range ballastGoroutines {
		go holdStack(started)
	}
	for range ballastGoroutines {
		<-started
	}
	runtime.GC()
}

// holdStack keeps ballastUse bytes of its stack in use for the life of the process.
func holdStack(started chan<- struct{}) {
	var frame [ballastUse]byte
	parkOn(frame[:], started)
}

//go:noinline
func parkOn(frame []byte, started chan<- struct{}) {
	frame[len(frame)-1] = 1 // the frame is used, so it is kept
	started <- struct{}{}
	select {}
}

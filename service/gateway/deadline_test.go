package main

import (
	"context"
	"testing"
	"time"
)

func TestAStreamPastItsDeadlineEndsDeadlineExceeded(t *testing.T) {
	// The call's context as it is before the deadline's timer fires: not done yet.
	ctx, end := context.WithCancelCause(context.Background())
	defer end(nil)
	for deadline, want := range map[time.Time]int{
		time.Now().Add(-time.Millisecond): codeDeadlineExceeded,
		time.Now().Add(time.Hour):         codeOK,
		{}:                                codeOK, // none
	} {
		s := &stream{ctx: ctx, deadline: deadline}
		code, message := s.status()
		if code != want || (want == codeDeadlineExceeded && message != grpcMessage(deadlineExceeded)) {
			t.Errorf("deadline %v: ends %d %q, want %d", deadline, code, message, want)
		}
	}
}

func TestAStreamPastItsDeadlineWritesNoMoreAnswers(t *testing.T) {
	// A message's own deadline timer (in compute) can fire before the call's context's: its
	// DEADLINE_EXCEEDED then ends the call, it is not an answer to write.
	ctx, end := context.WithCancelCause(context.Background())
	defer end(nil)
	for deadline, want := range map[time.Time]bool{
		time.Now().Add(-time.Millisecond): true,
		time.Now().Add(time.Hour):         false,
		{}:                                false, // none
	} {
		if got := (&stream{ctx: ctx, deadline: deadline}).ended(); got != want {
			t.Errorf("deadline %v: ended() = %v, want %v", deadline, got, want)
		}
	}
	end(nil)
	if !(&stream{ctx: ctx}).ended() {
		t.Error("a stream whose context has ended is not ended()")
	}
}

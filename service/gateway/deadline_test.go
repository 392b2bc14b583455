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

package main

import (
	"encoding/binary"
	"testing"
)

func TestTensorsStartAfterTheWorkersHeader(t *testing.T) {
	s, err := newSlab(4096, "test")
	if err != nil {
		t.Fatal(err)
	}
	defer s.unmap()
	regions, err := s.alloc([]int{100, 4096 - 128})
	if err != nil {
		t.Fatal(err)
	}
	if regions[0].offset != slabHeaderBytes || regions[1].offset != slabHeaderBytes+128 {
		t.Fatalf("regions %+v overlap the header or each other", regions)
	}
	if _, err := s.alloc([]int{1}); err == nil || err.Error() != slabFull(4096, 4096, 64) {
		t.Fatalf("a full slab: %v", err)
	}
	if _, err := s.alloc([]int{4097}); err == nil || err.Error() != slabTooSmall(4160, 4096) {
		t.Fatalf("more than its capacity: %v", err)
	}
}

func TestUnreadIsWhatWasSentLessWhatTheWorkerRead(t *testing.T) {
	s, err := newSlab(4096, "test")
	if err != nil {
		t.Fatal(err)
	}
	defer s.unmap()
	l := &link{slab: s, sentRequests: 7, sentBytes: 7000}
	if requests, nbytes := l.unread(); requests != 7 || nbytes != 7000 {
		t.Fatalf("nothing read: unread %d, %d", requests, nbytes)
	}
	binary.LittleEndian.PutUint64(s.mem[slabReadRequestsOffset:], 5) // as the worker writes
	binary.LittleEndian.PutUint64(s.mem[slabReadBytesOffset:], 5000)
	if requests, nbytes := l.unread(); requests != 2 || nbytes != 2000 {
		t.Fatalf("unread %d, %d", requests, nbytes)
	}
	s.releaseIfEmpty() // gives the tensors' pages back, never the header's
	if requests, _ := s.readCounts(); requests != 5 {
		t.Fatalf("the header was released: %d", requests)
	}
}

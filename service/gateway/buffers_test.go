package main

import "testing"

// The shelf keeps buffers over maxPooledBuffer for reuse, never more than shelfBytes of them,
// and hands back one at least as large as asked.
func TestTheShelfIsBoundedInBytesAndFitsWhatItHandsBack(t *testing.T) {
	var s shelf
	size := maxPooledBuffer + 5
	for range shelfBytes/size + 3 {
		s.keep(make([]byte, 7, size))
	}
	if s.bytes > shelfBytes || s.bytes+size <= shelfBytes {
		t.Fatalf("kept %d bytes, bound %d", s.bytes, shelfBytes)
	}
	if b := s.take(size + 1); b != nil {
		t.Fatalf("took a buffer of %d bytes for %d", cap(b), size+1)
	}
	held := s.bytes
	b := s.take(size)
	if b == nil || len(b) != 0 || cap(b) < size || s.bytes != held-cap(b) {
		t.Fatalf("took len %d cap %d, shelf %d of %d", len(b), cap(b), s.bytes, held)
	}
	s.empty()
	if s.take(1) != nil || s.bytes != 0 {
		t.Fatalf("an emptied shelf still holds %d bytes", s.bytes)
	}
}

// Messages up to slabReleaseBytes go back for reuse; larger ones to the collector.
func TestRecycleShelvesLargeBuffersUpToTheReleaseSize(t *testing.T) {
	largeBuffers.empty()
	defer largeBuffers.empty()
	recycle(make([]byte, 0, slabReleaseBytes+1))
	if largeBuffers.bytes != 0 {
		t.Fatalf("a buffer over slabReleaseBytes was shelved")
	}
	recycle(make([]byte, 0, slabReleaseBytes))
	if got := largeBuffer(maxPooledBuffer + 1); cap(got) != slabReleaseBytes {
		t.Fatalf("a recycled buffer was not reused: cap %d", cap(got))
	}
	if got := largeBuffer(maxPooledBuffer + 1); cap(got) != maxPooledBuffer+1 {
		t.Fatalf("a new buffer has cap %d", cap(got))
	}
}

package main

import (
	"bytes"
	"testing"
)

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

// The smallest kept buffer that fits is taken: a small message leaves the large ones.
func TestTheShelfHandsBackTheSmallestThatFits(t *testing.T) {
	var s shelf
	s.keep(make([]byte, 0, slabReleaseBytes))
	s.keep(make([]byte, 0, 2<<20))
	if b := s.take(3 << 19); cap(b) != 2<<20 {
		t.Fatalf("took %d bytes for 1.5 MiB with 2 MiB kept", cap(b))
	}
}

// A message declared large, with none kept, is not allocated at its declared size before its
// body comes.
func TestALargeDeclarationAloneAllocatesNothingLarge(t *testing.T) {
	largeBuffers.empty()
	length := 4 << 20
	prefix := []byte{0, 0, 0x40, 0, 0}
	buffer, ok := readMessage(bytes.NewReader(make([]byte, 100)), prefix, length)
	if ok || cap(buffer) > maxPooledBuffer {
		t.Fatalf("five bytes and a prefix took %d bytes (ok %v)", cap(buffer), ok)
	}
}

// A read that grows through 1, 2 and 4 MiB keeps none of the buffers it outgrew (smaller than
// the messages that grow them, they would fill the shelf), and its own is kept for the next.
func TestOutgrownBuffersDoNotFillTheShelf(t *testing.T) {
	largeBuffers.empty()
	defer largeBuffers.empty()
	length := 5<<20 + 100
	buffer, ok := readMessage(bytes.NewReader(make([]byte, length)), []byte{0, 0, 0x50, 0, 0x64}, length)
	if !ok || largeBuffers.bytes != 0 {
		t.Fatalf("ok %v, outgrown buffers kept: %d bytes", ok, largeBuffers.bytes)
	}
	recycle(buffer)
	if largeBuffers.take(5+length) == nil {
		t.Fatal("the message's own buffer was not kept")
	}
}

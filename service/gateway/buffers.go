package main

import "sync"

// Message buffers between calls. Those up to maxPooledBuffer go to a sync.Pool: a 256 KiB
// tensor per call would otherwise be garbage for the collector to chase. Larger ones, up to
// slabReleaseBytes (a [4, 128, 512] tensor is 1 MiB and a prefix), go on a shelf bounded in
// bytes: allocated afresh for every call, the request and the answer of that size cost the
// gateway a quarter of its CPU per call. A sync.Pool cannot hold them: it keeps one per call
// in flight until two collections have passed. The shelf, one per gateway (so per front
// end), is emptied on every interval without a call or a stream message
// (returnMemoryWhenIdle); larger messages go back to the collector.
var buffers = sync.Pool{New: func() any { return new([]byte) }}

const (
	maxPooledBuffer = 1 << 20
	shelfBytes      = 4 * slabReleaseBytes // at most four of the largest shelved at once
)

var largeBuffers shelf

// shelf keeps at most shelfBytes of buffers for reuse.
type shelf struct {
	mu    sync.Mutex
	kept  [][]byte
	bytes int
}

// take returns the smallest kept buffer with room for size bytes, empty, or nil when none is.
func (s *shelf) take(size int) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	best := -1
	for i, b := range s.kept { // a few at most: each is over maxPooledBuffer
		if cap(b) >= size && (best < 0 || cap(b) < cap(s.kept[best])) {
			best = i
		}
	}
	if best < 0 {
		return nil
	}
	b := s.kept[best]
	last := len(s.kept) - 1
	s.kept[best], s.kept[last] = s.kept[last], nil
	s.kept = s.kept[:last]
	s.bytes -= cap(b)
	return b[:0]
}

// keep shelves b for a later take, unless that would pass shelfBytes.
func (s *shelf) keep(b []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.bytes+cap(b) <= shelfBytes {
		s.kept = append(s.kept, b[:0])
		s.bytes += cap(b)
	}
}

// empty hands every kept buffer to the collector.
func (s *shelf) empty() {
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.kept)
	s.kept, s.bytes = s.kept[:0], 0
}

// largeBuffer returns an empty buffer with room for size bytes (over maxPooledBuffer): a kept
// one, or a new one of exactly that size.
func largeBuffer(size int) []byte {
	if b := largeBuffers.take(size); b != nil {
		return b
	}
	return make([]byte, 0, size)
}

// recycle keeps buffer for a later message once nothing references it any more.
func recycle(buffer []byte) {
	switch {
	case cap(buffer) <= maxPooledBuffer:
		buffers.Put(&buffer)
	case cap(buffer) <= slabReleaseBytes:
		largeBuffers.keep(buffer)
	}
}

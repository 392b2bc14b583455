package main

import (
	"encoding/binary"
	"syscall"
	"testing"
	"unsafe"
)

// residentPages counts the whole pages inside b that are in memory (mincore).
func residentPages(t *testing.T, b []byte) int {
	t.Helper()
	page := uintptr(syscall.Getpagesize())
	start := uintptr(unsafe.Pointer(&b[0]))
	first, end := (start+page-1)/page*page, (start+uintptr(len(b)))/page*page
	vec := make([]byte, (end-first)/page)
	_, _, errno := syscall.Syscall(syscall.SYS_MINCORE, first, end-first, uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		t.Fatal(errno)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}

// Regions under slabReleaseBytes keep their pages when freed. Once a whole interval has held
// that much less than the slab held before, the free blocks' pages go back and the held
// region's stay; use that dips and climbs again within an interval keeps its pages.
func TestASpikesPagesGoBackWhileARegionIsHeld(t *testing.T) {
	const mib = 1 << 20
	s, err := newSlab(64*mib, "test")
	if err != nil {
		t.Fatal(err)
	}
	defer s.unmap()
	regions, err := s.alloc([]int{4 * mib, 4 * mib, 4 * mib, 4 * mib})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range regions {
		for i := r.offset; i < r.offset+r.size; i += 4096 {
			s.mem[i] = 1
		}
	}
	pages := func(r region) int { return residentPages(t, s.mem[r.offset:r.offset+r.size]) }
	whole := func(r region) int { return (r.offset+r.size)/4096 - (r.offset+4095)/4096 }
	held, freed := regions[0], region{regions[1].offset, 12 * mib}
	s.release(regions[1:])
	if pages(freed) != whole(freed) {
		t.Fatalf("freed regions under slabReleaseBytes gave pages back: %d left", pages(freed))
	}
	s.releaseAfterSpike() // this interval held 16 MiB: a dip, not yet a spike that ended
	if got := pages(freed); got != whole(freed) {
		t.Fatalf("a dip within the interval gave back pages: %d of %d left", got, whole(freed))
	}
	s.releaseAfterSpike() // a whole interval at 4 MiB after 16: the spike is over
	if got := pages(freed); got != 0 {
		t.Fatalf("after the spike %d pages of free blocks stay resident", got)
	}
	if got := pages(held); got != whole(held) {
		t.Fatalf("the held region kept %d of its pages", got)
	}
	if s.peak != 4*mib || s.recent != 4*mib {
		t.Fatalf("peak %d, recent %d after the release (4 MiB held)", s.peak, s.recent)
	}
	// Steady traffic: each interval takes 12 MiB more and gives it back before the look.
	for round := 0; round < 3; round++ {
		again, err := s.alloc([]int{4 * mib, 4 * mib, 4 * mib})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range again {
			for i := r.offset; i < r.offset+r.size; i += 4096 {
				s.mem[i] = 1
			}
		}
		s.release(again)
		s.releaseAfterSpike()
		if got := pages(freed); got != whole(freed) {
			t.Fatalf("round %d: steady use lost its pages: %d of %d left", round, got, whole(freed))
		}
	}
	s.release([]region{held})
	s.releaseIfEmpty()
	if got := pages(region{slabHeaderBytes, 64 * mib}); got != 0 || s.peak != 0 {
		t.Fatalf("empty: %d pages stay, peak %d", got, s.peak)
	}
}

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

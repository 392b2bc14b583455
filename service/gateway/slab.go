package main

// The shared-memory slab this front end sends the worker: one memfd (no name to leak when
// a process is killed), mapped here and there. Requests' tensors are copied into it once
// from the received message; the worker writes each answer back into it. Its header is the
// worker's: how many INFERs (and bytes of their embeddings) it has read from this link
// (service/ipc/slab.py); tensors start after it.

import (
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"
)

const (
	slabAlign  = 64 // cache-line aligned regions, as the Python front end's
	madvRemove = 9
)

type region struct{ offset, size int }

type slab struct {
	fd       int
	mem      []byte // the header, then capacity bytes for tensors
	capacity int
	mu       sync.Mutex
	free     []region // sorted by offset, coalesced
	used     int
	peak     int // most bytes in use since free pages were last given back
	recent   int // most bytes in use since the last look (releaseAfterSpike)
}

// newSlab makes a slab with capacity bytes for tensors after its header.
func newSlab(capacity int, name string) (*slab, error) {
	size := slabHeaderBytes + capacity
	cname := append([]byte(name), 0)
	fd, _, errno := syscall.Syscall(sysMemfdCreate, uintptr(unsafe.Pointer(&cname[0])), 1 /* MFD_CLOEXEC */, 0)
	if errno != 0 {
		return nil, fmt.Errorf("memfd_create: %w", errno)
	}
	if err := syscall.Ftruncate(int(fd), int64(size)); err != nil {
		syscall.Close(int(fd))
		return nil, fmt.Errorf("ftruncate shared memory: %w", err)
	}
	mem, err := syscall.Mmap(int(fd), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		syscall.Close(int(fd))
		return nil, fmt.Errorf("mmap shared memory: %w", err)
	}
	return &slab{fd: int(fd), mem: mem, capacity: capacity, free: []region{{slabHeaderBytes, capacity}}}, nil
}

// closeFd drops this process's descriptor once the worker has its own; the mapping stays.
func (s *slab) closeFd() {
	if s.fd >= 0 {
		syscall.Close(s.fd)
		s.fd = -1
	}
}

func (s *slab) unmap() { syscall.Munmap(s.mem) }

// span is n bytes at offset; nil for offset -1 (a tensor not in the slab).
func (s *slab) span(offset, n int64) []byte {
	if offset < 0 {
		return nil
	}
	return s.mem[offset : offset+n]
}

func aligned(n int) int {
	if n < slabAlign {
		return slabAlign
	}
	return (n + slabAlign - 1) / slabAlign * slabAlign
}

// alloc takes a region of each size, or none: errSlabFull / errSlabTooSmall.
func (s *slab) alloc(sizes []int) ([]region, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	taken := make([]region, 0, len(sizes))
	for _, size := range sizes {
		r, err := s.take(aligned(size))
		if err != nil {
			for _, t := range taken {
				s.give(t)
			}
			return nil, err
		}
		taken = append(taken, r)
	}
	return taken, nil
}

func (s *slab) take(need int) (region, error) {
	if need > s.capacity {
		return region{}, &slabError{tooSmall: true, need: need, size: s.capacity}
	}
	for i, block := range s.free {
		if block.size >= need {
			if block.size == need {
				s.free = append(s.free[:i], s.free[i+1:]...)
			} else {
				s.free[i] = region{block.offset + need, block.size - need}
			}
			s.used += need
			s.peak, s.recent = max(s.peak, s.used), max(s.recent, s.used)
			return region{block.offset, need}, nil
		}
	}
	return region{}, &slabError{need: need, used: s.used, size: s.capacity}
}

func (s *slab) release(regions []region) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range regions {
		s.give(r)
		if r.size >= slabReleaseBytes { // smaller ones stay for reuse until the link idles
			s.releasePages(r)
		}
	}
}

func (s *slab) give(r region) {
	s.used -= r.size
	i := sort.Search(len(s.free), func(i int) bool { return s.free[i].offset > r.offset })
	s.free = append(s.free, region{})
	copy(s.free[i+1:], s.free[i:])
	s.free[i] = r
	// Merge with the following block, then with the preceding one.
	if i+1 < len(s.free) && s.free[i].offset+s.free[i].size == s.free[i+1].offset {
		s.free[i].size += s.free[i+1].size
		s.free = append(s.free[:i+1], s.free[i+2:]...)
	}
	if i > 0 && s.free[i-1].offset+s.free[i-1].size == s.free[i].offset {
		s.free[i-1].size += s.free[i].size
		s.free = append(s.free[:i], s.free[i+1:]...)
	}
}

// releasePages gives the whole pages inside r back to the kernel.
func (s *slab) releasePages(r region) {
	page := syscall.Getpagesize()
	start := (r.offset + page - 1) / page * page
	end := (r.offset + r.size) / page * page
	if end > start {
		syscall.Madvise(s.mem[start:end], madvRemove)
	}
}

type slabError struct {
	tooSmall         bool
	need, used, size int
}

func (e *slabError) Error() string {
	if e.tooSmall {
		return slabTooSmall(e.need, e.size)
	}
	return slabFull(e.used, e.size, e.need)
}

// releaseIfEmpty gives every page back when no region is held (after a burst).
func (s *slab) releaseIfEmpty() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.used == 0 && s.peak > 0 {
		s.releasePages(region{slabHeaderBytes, s.capacity}) // the header's page stays
		s.peak, s.recent = 0, 0
	}
}

// releaseAfterSpike, called at a steady interval, gives back the pages of every free block
// once a whole interval has held slabReleaseBytes less than the slab held before: freed
// regions under that size keep their pages for reuse, so without it a spike's pages would
// stay resident (charged to the container) for as long as calls keep coming and the slab
// never empties. Steady traffic, whose use dips and climbs within an interval, keeps its
// pages.
func (s *slab) releaseAfterSpike() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.peak-s.recent >= slabReleaseBytes {
		for _, block := range s.free {
			s.releasePages(block)
		}
		s.peak = s.recent
	}
	s.recent = s.used
}

// readCounts is what the worker has read from this link so far: INFERs and the bytes of
// their embeddings (two loads that agree: a load racing the worker's write is taken again).
func (s *slab) readCounts() (requests, nbytes uint64) {
	at := func(offset int) *uint64 { return (*uint64)(unsafe.Pointer(&s.mem[offset])) }
	for {
		requests, nbytes = atomic.LoadUint64(at(slabReadRequestsOffset)), atomic.LoadUint64(at(slabReadBytesOffset))
		if atomic.LoadUint64(at(slabReadRequestsOffset)) == requests && atomic.LoadUint64(at(slabReadBytesOffset)) == nbytes {
			return requests, nbytes
		}
	}
}

package main

// The worker's status page (service/ipc/status_page.py; layout and words in contract_gen.go):
// how full its queue is, read without a message so that a request the queue cannot take is
// refused here, before its tensor is copied into the slab or the worker is asked. The
// worker stays the authority: what slips through between two updates it refuses itself.

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"
)

type statusPage struct {
	path string
	once sync.Mutex
	mem  atomic.Pointer[[]byte] // nil until the worker has made the page
}

func newStatusPage(workerSocket string) *statusPage {
	return &statusPage{path: filepath.Join(filepath.Dir(workerSocket), statusPageName)}
}

func (s *statusPage) mapped() []byte {
	if mem := s.mem.Load(); mem != nil {
		return *mem
	}
	s.once.Lock()
	defer s.once.Unlock()
	if mem := s.mem.Load(); mem != nil {
		return *mem
	}
	file, err := os.OpenFile(s.path, os.O_RDONLY, 0)
	if err != nil {
		return nil // not made yet: the worker is starting
	}
	defer file.Close() // the mapping keeps the page
	if info, err := file.Stat(); err != nil || info.Size() < statusPageBytes {
		return nil
	}
	mem, err := syscall.Mmap(int(file.Fd()), 0, statusPageBytes, syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil
	}
	s.mem.Store(&mem)
	return mem
}

// queueFill is the queue as last published: ok false before the first publication, or when
// no consistent read was had.
type queueFill struct {
	pending, pendingBytes, maxQueueSize, maxQueueBytes uint64
}

func (s *statusPage) fill() (queueFill, bool) {
	mem := s.mapped()
	if mem == nil {
		return queueFill{}, false
	}
	sequence := (*uint64)(unsafe.Pointer(&mem[statusSequenceOffset]))
	for i := 0; i < statusReadTries; i++ {
		before := atomic.LoadUint64(sequence)
		if before == 0 {
			return queueFill{}, false // never published
		}
		if before&1 == 1 {
			continue // being written
		}
		f := queueFill{
			pending:       binary.LittleEndian.Uint64(mem[statusPendingRequestsOffset:]),
			pendingBytes:  binary.LittleEndian.Uint64(mem[statusPendingBytesOffset:]),
			maxQueueSize:  binary.LittleEndian.Uint64(mem[statusMaxQueueSizeOffset:]),
			maxQueueBytes: binary.LittleEndian.Uint64(mem[statusMaxQueueBytesOffset:]),
		}
		if atomic.LoadUint64(sequence) == before {
			return f, true
		}
	}
	return queueFill{}, false
}

// refusal is why the worker would refuse a request of nbytes of embeddings now ("" if it
// would take it), by the rule of status_page.QueueFill.refusal: what this front end sent
// that the worker has not read yet (unread requests and bytes) reaches the queue first.
func (f queueFill) refusal(nbytes, unread, unreadBytes uint64) string {
	pending, pendingBytes := f.pending+unread, f.pendingBytes+unreadBytes
	// The numbers shown are what the queue can hold: of the unread requests, the worker
	// refuses those past its bounds (service/ipc/status_page.py, the same).
	if pending >= f.maxQueueSize {
		return queueFullByCount(f.maxQueueSize, f.maxQueueSize)
	}
	if pending > 0 && pendingBytes+nbytes > f.maxQueueBytes {
		shown := max(f.pendingBytes, min(pendingBytes, f.maxQueueBytes))
		if f.pending == 0 && unread == 1 { // an empty queue takes one request of any size
			shown = pendingBytes
		}
		return queueFullByBytes(shown, nbytes, f.maxQueueBytes)
	}
	return ""
}

// refusal reads the page: "" when it says nothing yet.
func (s *statusPage) refusal(nbytes, unread, unreadBytes uint64) string {
	f, ok := s.fill()
	if !ok {
		return ""
	}
	return f.refusal(nbytes, unread, unreadBytes)
}

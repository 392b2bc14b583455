package main

// This front end's connection to the ONNX Runtime worker: the same Unix socket and messages
// as a Python front end's (service/ipc/channel.py, packed.py). A hello carries the slab's
// descriptor; INFER and DONE travel in the packed layout; the served set, failures and SYNC
// as JSON. A lost worker fails every call in flight at once; the link reconnects. The
// messages' words, layouts and sizes are generated from the Python's (wire_gen.go).

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// served is one snapshot of the served set; replaced whole, never changed.
type served struct {
	models       map[string]map[int64]*modelInfo
	defaultModel string
	ready        bool
}

// answer is the worker's final word on a request: done (err empty) or failed.
type answer struct {
	queueS, computeS float64
	batch            int64
	kind, message    string
	done             []byte // a traced call's DONE as the worker packed it
}

type pending struct {
	done      chan answer
	regions   []region
	abandoned bool
	traced    bool // its answer keeps the DONE, for its spans
}

type link struct {
	slab  *slab
	conn  *net.UnixConn
	io    rawIO      // conn's reads and writes, as raw calls
	mu    sync.Mutex // calls, out, alive
	calls map[uint64]*pending
	out   []byte
	wake  chan struct{}
	alive bool
	users int // requests using the slab; the last one after the link is lost unmaps it
	// INFERs sent on this link and their embeddings' bytes, under mu; with what the worker
	// has read (the slab's header), what is on its way to its queue.
	sentRequests, sentBytes uint64
}

// unread is what this link sent that the worker has not read yet: INFERs and their
// embeddings' bytes, which reach its queue before anything sent after them.
func (l *link) unread() (requests, nbytes uint64) {
	readRequests, readBytes := l.slab.readCounts()
	l.mu.Lock()
	sentRequests, sentBytes := l.sentRequests, l.sentBytes
	l.mu.Unlock()
	return sentRequests - min(readRequests, sentRequests), sentBytes - min(readBytes, sentBytes)
}

type worker struct {
	socketPath string
	name       string
	slabBytes  int
	status     *statusPage // the worker's queue fill

	mu     sync.Mutex
	link   *link
	served *served
	// The names of every model served since health calls began to be answered here (nil
	// before): the front end's health service keeps an entry, NOT_SERVING, for a model no
	// longer served.
	shown  map[string]bool
	nextID uint64
	// Held for reading from a request's model lookup until its INFER is queued, and for
	// writing while a SYNC is answered: once the worker has SYNCED, every request that saw
	// an older served set has reached it.
	order sync.RWMutex
}

func newWorker(socketPath, name string, slabBytes int) *worker {
	return &worker{socketPath: socketPath, name: name, slabBytes: slabBytes, status: newStatusPage(socketPath),
		served: &served{models: map[string]map[int64]*modelInfo{}}}
}

func (w *worker) snapshot() *served {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.served
}

// startShowing begins to keep the names of the models served (now, and from now on).
func (w *worker) startShowing() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.shown = map[string]bool{}
	for name := range w.served.models {
		w.shown[name] = true
	}
}

// wasShown reports whether a model of that name has been served since startShowing.
func (w *worker) wasShown(name string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.shown[name]
}

// use is the live link, held until done(); nil while the worker is away.
func (w *worker) use() *link {
	w.mu.Lock()
	l := w.link
	w.mu.Unlock()
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.alive {
		return nil
	}
	l.users++
	return l
}

func (l *link) done() {
	l.mu.Lock()
	l.users--
	last := l.users == 0 && !l.alive
	l.mu.Unlock()
	if last {
		l.slab.unmap()
	}
}

// connectForever keeps a link to the worker, reconnecting with backoff while it restarts.
func (w *worker) connectForever(welcomed chan<- struct{}) {
	delay := 50 * time.Millisecond
	once := sync.Once{}
	for {
		l, err := w.connect()
		if err != nil {
			time.Sleep(delay)
			delay = min(delay*2, time.Second)
			continue
		}
		w.mu.Lock()
		w.link = l
		w.mu.Unlock()
		go l.writeLoop()
		greeted := false
		w.readLoop(l, func() {
			greeted = true
			once.Do(func() { close(welcomed) })
		})
		w.lost(l)
		if greeted {
			delay = 50 * time.Millisecond // a worker that served this link: it restarts
		} else {
			// Refused before its welcome (a failed handshake): retrying at once would spin,
			// each try a new slab on both sides.
			time.Sleep(delay)
			delay = min(delay*2, time.Second)
		}
	}
}

func (w *worker) connect() (*link, error) {
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: w.socketPath, Net: "unix"})
	if err != nil {
		return nil, err
	}
	s, err := newSlab(w.slabBytes, "attention-"+w.name)
	if err != nil {
		conn.Close()
		return nil, err
	}
	hello, _ := json.Marshal(map[string]any{keyName: w.name, keyPid: os.Getpid()})
	frame := binary.LittleEndian.AppendUint32(nil, uint32(len(hello)))
	frame = append(frame, hello...)
	if _, _, err := conn.WriteMsgUnix(frame, syscall.UnixRights(s.fd), nil); err != nil {
		conn.Close()
		s.closeFd()
		s.unmap()
		return nil, err
	}
	s.closeFd() // the worker holds its own descriptor now
	io, err := newRawIO(conn)
	if err != nil {
		conn.Close()
		s.unmap()
		return nil, err
	}
	return &link{slab: s, conn: conn, io: io, calls: map[uint64]*pending{}, wake: make(chan struct{}, 1), alive: true}, nil
}

// send queues a framed message; the writer sends everything queued in one write.
func (l *link) send(body []byte) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.alive {
		return false
	}
	l.out = binary.LittleEndian.AppendUint32(l.out, uint32(len(body)))
	l.out = append(l.out, body...)
	select {
	case l.wake <- struct{}{}:
	default:
	}
	return true
}

func (l *link) sendJSON(message map[string]any) {
	body, _ := json.Marshal(message)
	l.send(body)
}

func (l *link) writeLoop() {
	var buffer []byte
	for range l.wake {
		l.mu.Lock()
		buffer, l.out = l.out, buffer[:0]
		alive := l.alive
		l.mu.Unlock()
		if !alive {
			return
		}
		if _, err := l.io.write(buffer); err != nil {
			l.conn.Close() // the reader notices and fails the calls
			return
		}
	}
}

func (w *worker) readLoop(l *link, welcomed func()) {
	var buffer []byte
	chunk := make([]byte, 1<<16)
	for {
		n, err := l.io.read(chunk)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				log.Printf("worker link: %v", err)
			}
			log.Printf("the worker closed its connection; failing calls in flight, reconnecting")
			return
		}
		buffer = append(buffer, chunk[:n]...)
		start := 0
		for len(buffer)-start >= 4 {
			length := int(binary.LittleEndian.Uint32(buffer[start:]))
			if length > maxMessage {
				log.Printf("control message of %d bytes from the worker; reconnecting", length)
				return
			}
			if len(buffer)-start-4 < length {
				break
			}
			body := buffer[start+4 : start+4+length]
			start += 4 + length
			if err := w.dispatch(l, body, welcomed); err != nil {
				log.Printf("malformed message from the worker (%v); reconnecting", err)
				return
			}
		}
		buffer = append(buffer[:0], buffer[start:]...)
	}
}

func (w *worker) dispatch(l *link, body []byte, welcomed func()) error {
	// A DONE; a traced call's has the tags of its batch's traced calls after it.
	if len(body) >= doneSize && body[doneAtKind] == doneKind && (len(body)-doneSize)%tagSize == 0 {
		id := binary.LittleEndian.Uint64(body[doneAtRequestID:])
		w.finish(l, id, answer{
			queueS:   math.Float64frombits(binary.LittleEndian.Uint64(body[doneAtQueueS:])),
			computeS: math.Float64frombits(binary.LittleEndian.Uint64(body[doneAtComputeS:])),
			batch:    int64(binary.LittleEndian.Uint64(body[doneAtBatchSize:])),
		}, body)
		return nil
	}
	var message workerMessage
	if err := json.Unmarshal(body, &message); err != nil {
		return err
	}
	switch message.Type {
	case messageDone:
		w.finish(l, message.ID, answer{queueS: message.QueueS, computeS: message.ComputeS, batch: message.BatchSize}, nil)
	case messageFail:
		w.finish(l, message.ID, answer{kind: message.ErrorKind, message: message.ErrorMessage}, nil)
	case messageReply:
		// control calls are the Python front end's; none are made here
	case messageWelcome, messageModels:
		snapshot := &served{models: map[string]map[int64]*modelInfo{},
			defaultModel: message.DefaultModel, ready: message.Ready}
		for _, m := range message.Models {
			if snapshot.models[m.Name] == nil {
				snapshot.models[m.Name] = map[int64]*modelInfo{}
			}
			snapshot.models[m.Name][m.Version] = m
		}
		w.mu.Lock()
		w.served = snapshot
		if w.shown != nil {
			for name := range snapshot.models {
				w.shown[name] = true
			}
		}
		w.mu.Unlock()
		welcomed()
	case messageSync:
		w.order.Lock()
		l.sendJSON(map[string]any{keyType: messageSynced, keyID: message.ID})
		w.order.Unlock()
	default:
		return fmt.Errorf("unknown message type %q", message.Type)
	}
	return nil
}

// finish hands the call its answer; packed is the DONE as read (kept only for a traced call:
// the read buffer is reused).
func (w *worker) finish(l *link, id uint64, a answer, packed []byte) {
	l.mu.Lock()
	call := l.calls[id]
	delete(l.calls, id)
	l.mu.Unlock()
	if call == nil {
		return
	}
	if call.traced && packed != nil {
		a.done = append([]byte(nil), packed...)
	}
	if call.abandoned {
		l.slab.release(call.regions) // the worker wrote nothing more into them
		return
	}
	call.done <- a
}

// lost fails every call in flight with UNAVAILABLE; the slab goes with the link.
func (w *worker) lost(l *link) {
	w.mu.Lock()
	if w.link == l {
		w.link = nil
	}
	w.served = &served{models: w.served.models, defaultModel: w.served.defaultModel, ready: false}
	w.mu.Unlock()
	l.mu.Lock()
	l.alive = false
	calls := l.calls
	l.calls = map[uint64]*pending{}
	unused := l.users == 0
	l.mu.Unlock()
	if unused {
		defer l.slab.unmap()
	}
	l.conn.Close()
	close(l.wake)
	for _, call := range calls {
		if !call.abandoned {
			call.done <- answer{kind: kindShuttingDown, message: workerGone}
		}
	}
}

// inferMessage is the packed INFER (service/ipc/packed.py INFER_FIELDS): each field at its
// generated offset, then the key and the dtype; an offset of -1 is none, a NaN deadline none.
// Written through an array pointer at constant offsets: no bounds checks (faster than appends).
func inferMessage(id uint64, weights bool, shape [3]int64, at [3]int64, deadline float64, key, dtype string) []byte {
	b := make([]byte, inferHeadSize, inferHeadSize+len(key)+len(dtype))
	h := (*[inferHeadSize]byte)(b)
	h[inferAtKind] = inferKind
	binary.LittleEndian.PutUint64(h[inferAtRequestID:], id)
	if weights {
		h[inferAtWithWeights] = 1
	}
	binary.LittleEndian.PutUint64(h[inferAtN:], uint64(shape[0]))
	binary.LittleEndian.PutUint64(h[inferAtSeq:], uint64(shape[1]))
	binary.LittleEndian.PutUint64(h[inferAtD:], uint64(shape[2]))
	binary.LittleEndian.PutUint64(h[inferAtInputOffset:], uint64(at[0]))
	binary.LittleEndian.PutUint64(h[inferAtOutputOffset:], uint64(at[1]))
	binary.LittleEndian.PutUint64(h[inferAtWeightsOffset:], uint64(at[2]))
	binary.LittleEndian.PutUint64(h[inferAtDeadline:], math.Float64bits(deadline))
	binary.LittleEndian.PutUint16(h[inferAtKeyLength:], uint16(len(key)))
	h[inferAtDtypeLength] = byte(len(dtype))
	b = append(b, key...)
	return append(b, dtype...)
}

// monotonic is CLOCK_MONOTONIC in seconds: the clock of the worker's deadlines
// (Python's time.monotonic()).
func monotonic() float64 {
	var ts syscall.Timespec
	syscall.Syscall(syscall.SYS_CLOCK_GETTIME, 1 /* CLOCK_MONOTONIC */, uintptr(unsafe.Pointer(&ts)), 0)
	return float64(ts.Sec) + float64(ts.Nsec)/1e9
}

package main

// Answers leave in as few writes as their gRPC messages allow.
//
// net/http's HTTP/2 server writes every DATA frame larger than its 4 KiB buffer with a write
// of its own, from a goroutine of its own: a seq-128 answer (256 KiB in 16 KiB frames) took
// 17 writes, and on loopback each write also runs the receiving side's TCP path on this core.
// A gRPC client can do nothing with an answer's headers alone or with part of a message, so
// those are held back, and leave with everything held before them in one write: when the
// message is whole, when any other frame is written (trailers, RST_STREAM, PING, SETTINGS,
// WINDOW_UPDATE, GOAWAY), when holdBytes are held, or holdFor after the hold began at the
// latest. An answer of one message then takes two writes: headers with the message, then
// the trailers. Nothing is held that needs the client's flow-control window to grow before
// it can be made whole: the client grows it only for bytes it has received, so such a hold
// would last until the backstop at every window's worth (a client with HTTP/2's default
// 64 KiB windows took 10.7 ms instead of 5.3 ms for a seq-128 answer, 311 ms instead of 93 ms
// for a seq-512 answer with weights). The connection follows the client's windows from the
// SETTINGS and WINDOW_UPDATE frames it reads and the DATA frames it writes (flowWindows).
//
// net/http also grants the client more of the connection's window, in a WINDOW_UPDATE of its
// own write, for every request body it reads: one caller's call took three writes to its
// socket (that update, the answer, the trailers), a refusal two. While the client can still
// send windowHoldFloor bytes on the connection without it, such an update is owed instead:
// its increment is kept (no buffer, no backstop timer) and a WINDOW_UPDATE of the sum goes
// in front of the next write on the connection (the answer or refusal that follows). The
// connection counts the DATA bytes it reads and the increments that reached the socket
// (receiveWindow); once the client's room falls under the floor, the owed update leaves at
// once, from the next update net/http writes or from the reading side itself (flushOwed),
// so a client is never short of window for it.

import (
	"encoding/binary"
	"sync"
	"time"
)

const (
	// Room for a whole seq-128 answer of the default model (256 KiB and its frame headers).
	// A hold lasts only while the handler that wrote the message waits for its last frame,
	// so what is held is part of an answer the undelivered-bytes bound already counts.
	holdBytes = 320 << 10
	// A backstop only: a message's bytes come from one handler write (net/http splits it
	// into frames), so its last frame follows its first within microseconds.
	holdFor = time.Millisecond
	// Streams reset mid-message leave their message state behind; past this many the
	// connection stops holding rather than track more.
	maxHeldStreams  = 4096
	grpcPrefixBytes = 5
	flagEndStream   = 0x1
	flagPadded      = 0x8
	frameRSTStream  = 0x3
	// Flow control (RFC 9113 6.9): every window starts at 65535 bytes.
	frameWindowUpdate    = 0x8
	settingInitialWindow = 0x4
	defaultWindow        = 65535
	// A connection-level WINDOW_UPDATE is owed only while the client may still send this
	// much on the connection without it (the gateway grants 8 MiB).
	windowHoldFloor   = 1 << 20
	windowUpdateBytes = 4
)

var holdBuffers = sync.Pool{New: func() any {
	b := make([]byte, 0, holdBytes+32<<10) // room for the frame that makes a message whole
	return &b
}}

// outMessage is where one stream's outbound bytes stand in its current gRPC message.
type outMessage struct {
	prefix [grpcPrefixBytes]byte
	have   int // prefix bytes seen
	left   int // message bytes after the prefix still to come
}

// answerFrames follows the frames a connection writes, their headers and the gRPC messages
// in their DATA payloads, stream by stream.
type answerFrames struct {
	header    [frameHeaderBytes]byte
	have      int // bytes of the next frame header gathered so far
	left      int // payload bytes of the current frame still to come
	kind      byte
	flags     byte
	stream    uint32
	messages  map[uint32]*outMessage // streams in the middle of a message
	untracked bool                   // something it cannot follow was written: hold nothing
	flow      flowWindows
	receive   receiveWindow
	increment [windowUpdateBytes]byte // a WINDOW_UPDATE's payload as it passes
}

// receiveWindow is how many DATA bytes this side lets the client send on the connection:
// defaultWindow + granted - received. Increments fed but not yet on the socket are owed;
// those of a lone update taken back before feeding (windowUpdateToOwe) are unsent.
type receiveWindow struct {
	granted, owed, unsent int64
	received              int64 // DATA bytes read from the client: set before each feed
}

func (w *receiveWindow) room() int64 { return defaultWindow + w.granted - w.received }

// windowUpdateToOwe takes p back when it is exactly one connection-level WINDOW_UPDATE and
// the client can do without it for now (the room it has without it is windowHoldFloor or
// more): its increment is added to the unsent one, which the next write carries
// (owedWindowUpdate). Nothing else needs writing then, so no backstop is armed: the client
// never waits on it, since each update net/http writes for further reads is looked at
// again, and leaves with the unsent increment once the room is short.
func (f *answerFrames) windowUpdateToOwe(p []byte) bool {
	if len(p) != frameHeaderBytes+windowUpdateBytes || p[3] != frameWindowUpdate || f.untracked {
		return false
	}
	length := int(p[0])<<16 | int(p[1])<<8 | int(p[2])
	stream := binary.BigEndian.Uint32(p[5:9]) & 0x7fffffff
	if length != windowUpdateBytes || stream != 0 || f.receive.room() < windowHoldFloor {
		return false
	}
	f.receive.unsent += int64(binary.BigEndian.Uint32(p[9:]) & 0x7fffffff)
	return true
}

// owedWindowUpdate is the WINDOW_UPDATE frame that grants the unsent increment (nil: none),
// to be fed and written before what comes next; only at a frame boundary.
func (f *answerFrames) owedWindowUpdate() []byte {
	if f.receive.unsent == 0 || !f.atBoundary() {
		return nil
	}
	frame := make([]byte, frameHeaderBytes+windowUpdateBytes)
	frame[2], frame[3] = windowUpdateBytes, frameWindowUpdate
	binary.BigEndian.PutUint32(frame[9:], uint32(f.receive.unsent))
	f.receive.unsent = 0
	return frame
}

// written: everything fed so far reached the socket, its increments with it.
func (f *answerFrames) written() {
	f.receive.granted += f.receive.owed
	f.receive.owed = 0
}

// flowWindows is how many DATA bytes the client lets this side send, on the connection and
// per stream, as far as the frames seen so far say. Its zero value is HTTP/2's start.
type flowWindows struct {
	connGranted, connSent int64 // the connection's window: defaultWindow + granted - sent
	initialDelta          int64 // the client's SETTINGS_INITIAL_WINDOW_SIZE - defaultWindow
	// Streams the client opened or this side sent DATA on, until they end: WINDOW_UPDATE
	// increments granted minus DATA bytes sent (a stream's window: initial + this).
	streams map[uint32]int64
}

// room is how many more DATA bytes stream may take now without a WINDOW_UPDATE.
func (w *flowWindows) room(stream uint32) int64 {
	return min(defaultWindow+w.connGranted-w.connSent, defaultWindow+w.initialDelta+w.streams[stream])
}

func (w *flowWindows) track(stream uint32) bool {
	if _, ok := w.streams[stream]; ok {
		return true
	}
	if len(w.streams) >= maxHeldStreams {
		return false
	}
	if w.streams == nil {
		w.streams = make(map[uint32]int64)
	}
	w.streams[stream] = 0
	return true
}

// opened: the client opened stream (its first HEADERS).
func (f *answerFrames) opened(stream uint32) {
	if !f.flow.track(stream) {
		f.untracked = true
	}
}

// windowUpdate: the client granted increment more bytes on stream (0: the connection).
func (f *answerFrames) windowUpdate(stream uint32, increment int64) {
	if stream == 0 {
		f.flow.connGranted += increment
	} else if _, open := f.flow.streams[stream]; open {
		f.flow.streams[stream] += increment
	}
}

// initialWindow: the client's SETTINGS_INITIAL_WINDOW_SIZE, which moves every stream's window.
func (f *answerFrames) initialWindow(size int64) { f.flow.initialDelta = size - defaultWindow }

// reset: the client reset stream.
func (f *answerFrames) reset(stream uint32) { delete(f.flow.streams, stream) }

// feed walks p, calling onHeader at each complete frame header; it reports whether more of
// what p is part of must come before a client can use it (moreToCome).
func (f *answerFrames) feed(p []byte, onHeader func(h []byte)) bool {
	for len(p) > 0 {
		if f.left == 0 && f.have < frameHeaderBytes {
			n := copy(f.header[f.have:], p)
			f.have += n
			p = p[n:]
			if f.have == frameHeaderBytes {
				f.started(onHeader)
			}
			continue
		}
		n := min(f.left, len(p))
		if f.kind == frameData && !f.untracked {
			f.follow(p[:n])
		} else if f.kind == frameWindowUpdate && f.stream == 0 {
			at := windowUpdateBytes - f.left
			copy(f.increment[max(0, at):], p[:n])
		}
		f.left -= n
		p = p[n:]
		if f.left == 0 {
			f.ended()
		}
	}
	return f.moreToCome()
}

func (f *answerFrames) started(onHeader func(h []byte)) {
	onHeader(f.header[:])
	f.left = int(f.header[0])<<16 | int(f.header[1])<<8 | int(f.header[2])
	f.kind, f.flags = f.header[3], f.header[4]
	f.stream = binary.BigEndian.Uint32(f.header[5:9]) & 0x7fffffff
	if f.kind == frameData && f.flags&flagPadded != 0 {
		f.untracked = true // net/http never pads; padding bytes would read as message bytes
	}
	if f.kind == frameWindowUpdate && f.stream == 0 && f.left != windowUpdateBytes {
		f.untracked = true // net/http writes none: nothing to read an increment from
	}
	if f.kind == frameData && f.left > 0 { // the whole frame counts against both windows
		f.flow.connSent += int64(f.left)
		if f.flow.track(f.stream) {
			f.flow.streams[f.stream] -= int64(f.left)
		} else {
			f.untracked = true
		}
	}
	if f.left == 0 {
		f.ended()
	}
}

// ended closes the current frame: the header of the next one comes.
func (f *answerFrames) ended() {
	f.have = 0
	if f.kind == frameWindowUpdate && f.stream == 0 {
		f.receive.owed += int64(binary.BigEndian.Uint32(f.increment[:]) & 0x7fffffff)
	}
	if f.flags&flagEndStream != 0 || f.kind == frameRSTStream {
		delete(f.messages, f.stream)
		delete(f.flow.streams, f.stream)
	}
}

// follow reads DATA payload bytes as gRPC messages: a 5-byte prefix, its length, the bytes.
func (f *answerFrames) follow(p []byte) {
	m := f.messages[f.stream]
	for len(p) > 0 {
		if m == nil {
			if len(f.messages) >= maxHeldStreams {
				f.untracked = true
				return
			}
			if f.messages == nil {
				f.messages = make(map[uint32]*outMessage)
			}
			m = &outMessage{}
			f.messages[f.stream] = m
		}
		if m.have < grpcPrefixBytes {
			n := copy(m.prefix[m.have:], p)
			m.have += n
			p = p[n:]
			if m.have == grpcPrefixBytes {
				m.left = int(binary.BigEndian.Uint32(m.prefix[1:]))
			}
		} else {
			n := min(m.left, len(p))
			m.left -= n
			p = p[n:]
		}
		if m.have == grpcPrefixBytes && m.left == 0 {
			delete(f.messages, f.stream)
			m = nil
		}
	}
}

// moreToCome: the bytes so far end where a client can do nothing with them yet: in or after
// an answer's HEADERS that do not end its stream (its messages or trailers follow), or inside
// a gRPC message that is not whole; and what follows can be sent within the client's windows
// (else it waits for a WINDOW_UPDATE, which the client sends for bytes it has received).
func (f *answerFrames) moreToCome() bool {
	if f.untracked || f.flags&flagEndStream != 0 {
		return false
	}
	if f.left == 0 && f.have > 0 { // part of the next frame's header: of unknown kind
		return false
	}
	room := f.flow.room(f.stream)
	switch f.kind {
	case frameHeaders:
		return room > 0
	case frameData:
		m, mid := f.messages[f.stream]
		if !mid {
			return false
		}
		if m.have < grpcPrefixBytes { // the message's length is not known yet
			return room > 0
		}
		// The rest of this frame is granted already; the message's bytes beyond it are not.
		return int64(m.left-f.left) <= room
	case frameWindowUpdate:
		return f.stream == 0 && f.receive.room() >= windowHoldFloor
	}
	return false
}

func (f *answerFrames) atBoundary() bool { return f.left == 0 && f.have == 0 }

// heldAnswers is a connection's outbound bytes written by net/http but not yet to the socket.
type heldAnswers struct {
	buf      *[]byte // from holdBuffers while something is held
	timer    *time.Timer
	err      error         // a late flush failed: the connection is closed, writes fail with it
	backstop time.Duration // 0: holdFor (tests that count writes set one that never fires)
}

func (h *heldAnswers) size() int {
	if h.buf == nil {
		return 0
	}
	return len(*h.buf)
}

// keep holds p (copied: net/http reuses its buffer), starting the backstop with the hold.
func (h *heldAnswers) keep(p []byte, flushLate func()) {
	if h.buf == nil {
		h.buf = holdBuffers.Get().(*[]byte)
		after := h.backstop
		if after == 0 {
			after = holdFor
		}
		if h.timer == nil {
			h.timer = time.AfterFunc(after, flushLate)
		} else {
			h.timer.Reset(after)
		}
	}
	*h.buf = append(*h.buf, p...)
}

// release gives the buffer back and stops the backstop.
func (h *heldAnswers) release() {
	if h.buf == nil {
		return
	}
	h.timer.Stop()
	*h.buf = (*h.buf)[:0]
	holdBuffers.Put(h.buf)
	h.buf = nil
}

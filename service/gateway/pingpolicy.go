package main

// Keepalive enforcement, as gRPC core enforces it for the Python front end
// (service/transport/grpc_options.py): a client may ping, but a ping that comes sooner than
// minInterval after the previous one, with no HEADERS or DATA sent to it in between, is a
// strike; past maxStrikes the connection is sent GOAWAY (ENHANCE_YOUR_CALM,
// "too_many_pings") and closed. net/http answers every ping and has no hook to refuse one,
// so the policy reads the HTTP/2 frame headers as they pass through the connection.

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

const (
	frameData          = 0x0
	frameHeaders       = 0x1
	frameSettings      = 0x4
	framePing          = 0x6
	frameGoAway        = 0x7
	flagAck            = 0x1
	errEnhanceYourCalm = 0xb
	frameHeaderBytes   = 9
)

const clientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

type pingPolicy struct {
	minInterval time.Duration
	maxStrikes  int // 0: pings are never refused
}

// policedConn applies the ping policy to one HTTP/2 connection. Reads come from net/http's
// one reading goroutine; writes (its frame writer) and the policy's state are under mu.
type policedConn struct {
	net.Conn
	policy pingPolicy

	prefaceSeen int         // bytes of the client preface checked so far
	off         atomic.Bool // not HTTP/2 with prior knowledge or ALPN: nothing to police
	inSkip      int         // bytes of the current inbound frame's payload still to pass
	inFlow      []byte      // a WINDOW_UPDATE's or SETTINGS' payload as it passes; nil: none
	inStream    uint32      // the stream of that frame
	held        []byte      // the start of a frame header still arriving
	pending     []byte      // inspected, not yet read (a Read too small for a header)
	scratch     []byte
	scratchFlow []byte

	dataRead atomic.Int64 // DATA bytes read from the client (the receive window's use)
	// While a WINDOW_UPDATE's increment is owed (coalesce.go): the top of the client's
	// connection window without it (room = owedTop - dataRead); 0 when none is owed. The
	// reading side sends the owed update once the room falls short (flushOwed).
	owedTop      atomic.Int64
	flushingOwed atomic.Bool

	mu         sync.Mutex
	out        answerFrames
	answers    heldAnswers // outbound bytes held back (coalesce.go)
	lastPing   time.Time   // zero: none since the last HEADERS or DATA sent
	strikes    int
	lastStream uint32
	goAwayOwed bool // strikes exceeded; GOAWAY goes at the next outbound frame boundary
	goneAway   bool
}

func (c *policedConn) Read(p []byte) (int, error) {
	switch {
	case len(c.pending) > 0:
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	case c.off.Load():
		return c.Conn.Read(p)
	case c.inSkip > 0 && len(c.held) == 0 && c.inFlow == nil: // a payload to pass as it is
		n, err := c.Conn.Read(p[:min(len(p), c.inSkip)])
		c.inSkip -= n
		return n, err
	case len(p) < frameHeaderBytes: // too small to hold a header: read through scratch
		if c.scratch == nil {
			c.scratch = make([]byte, 4<<10)
		}
		n, err := c.readInspected(c.scratch)
		c.pending = c.scratch[:n]
		m := copy(p, c.pending)
		c.pending = c.pending[m:]
		return m, err
	}
	return c.readInspected(p)
}

func (c *policedConn) readInspected(p []byte) (int, error) {
	for {
		start := copy(p, c.held)
		n, err := c.Conn.Read(p[start:])
		kept := c.inspect(p[:start+n])
		if kept > 0 || err != nil {
			return kept, err
		}
	}
}

// inspect checks the client preface, then walks the frames in p and returns how many of
// its bytes net/http gets. It drops SETTINGS acknowledgements, and holds back the start of
// a frame header that has not fully arrived (in held, for the next Read) so that a whole
// header can still be dropped.
//
// Why drop the acknowledgements: net/http resets a stream past the connection's stream
// bound with PROTOCOL_ERROR (gRPC clients report INTERNAL, a bug of theirs) once the client
// has acknowledged its SETTINGS, and with REFUSED_STREAM (UNAVAILABLE, retryable, never
// reached a handler) while it has not; gRPC core always refuses. Nothing else in net/http
// waits for the acknowledgement (TestStreamsPastTheBoundAreRefused checks both).
func (c *policedConn) inspect(p []byte) int {
	read, kept := 0, 0
	for c.prefaceSeen < len(clientPreface) && read < len(p) {
		if p[read] != clientPreface[c.prefaceSeen] {
			c.off.Store(true)
			return len(p)
		}
		c.prefaceSeen++
		read++
	}
	kept = read
	c.held = c.held[:0]
	for read < len(p) {
		if c.inSkip > 0 { // payload: passed on as it is
			n := min(c.inSkip, len(p)-read)
			if c.inFlow != nil {
				c.inFlow = append(c.inFlow, p[read:read+n]...)
			}
			copy(p[kept:], p[read:read+n])
			c.inSkip -= n
			read += n
			kept += n
			if c.inSkip == 0 && c.inFlow != nil {
				c.flowControl()
			}
			continue
		}
		if len(p)-read < frameHeaderBytes {
			c.held = append(c.held, p[read:]...)
			break
		}
		header := p[read : read+frameHeaderBytes]
		length := int(header[0])<<16 | int(header[1])<<8 | int(header[2])
		read += frameHeaderBytes
		if header[3] == frameSettings && header[4]&flagAck != 0 && length == 0 {
			continue
		}
		c.received(header)
		copy(p[kept:], header)
		kept += frameHeaderBytes
		c.inSkip = length
		if (header[3] == frameWindowUpdate || header[3] == frameSettings) && !flowPayloadFits(header[3], length) {
			// Malformed (net/http ends the connection over it): not collected, so a client's
			// claimed length never sizes a buffer here; the hold stops following this connection.
			c.mu.Lock()
			c.out.untracked = true
			c.mu.Unlock()
		} else if header[3] == frameWindowUpdate || header[3] == frameSettings { // not an ack: kept above
			if c.scratchFlow == nil {
				c.scratchFlow = make([]byte, 0, 64)
			}
			c.inFlow = c.scratchFlow[:0]
			c.inStream = binary.BigEndian.Uint32(header[5:9]) & 0x7fffffff
			if length == 0 {
				c.flowControl()
			}
		}
	}
	return kept
}

// maxSettingsPayload bounds the SETTINGS payload collected: each setting takes 6 bytes and
// HTTP/2 defines six (a client may repeat or add unknown ones; more than this is not followed).
const maxSettingsPayload = 6 * 64

// flowPayloadFits: a WINDOW_UPDATE's or SETTINGS' payload of length is one to collect.
func flowPayloadFits(kind byte, length int) bool {
	if kind == frameWindowUpdate {
		return length == 4
	}
	return length%6 == 0 && length <= maxSettingsPayload
}

// flowControl reads a WINDOW_UPDATE's or SETTINGS' payload, whole: the client's windows,
// which the answers' hold follows (answerFrames.moreToCome).
func (c *policedConn) flowControl() {
	payload := c.inFlow
	c.scratchFlow, c.inFlow = payload[:0], nil
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(payload) == 4 { // WINDOW_UPDATE (a SETTINGS payload is a multiple of 6 bytes)
		c.out.windowUpdate(c.inStream, int64(binary.BigEndian.Uint32(payload)&0x7fffffff))
		return
	}
	for ; len(payload) >= 6; payload = payload[6:] {
		if binary.BigEndian.Uint16(payload) == settingInitialWindow {
			c.out.initialWindow(int64(binary.BigEndian.Uint32(payload[2:])))
		}
	}
}

// received sees each frame header the client sends.
func (c *policedConn) received(h []byte) {
	kind, flags := h[3], h[4]
	if kind == frameData {
		read := c.dataRead.Add(int64(h[0])<<16 | int64(h[1])<<8 | int64(h[2]))
		if top := c.owedTop.Load(); top > 0 && top-read < windowHoldFloor && c.flushingOwed.CompareAndSwap(false, true) {
			go c.flushOwed() // the client is running short: no write may come to carry it
		}
		return
	}
	stream := binary.BigEndian.Uint32(h[5:9]) & 0x7fffffff
	if kind == frameHeaders || kind == frameRSTStream {
		c.mu.Lock()
		if kind == frameRSTStream {
			c.out.reset(stream)
		} else if stream > c.lastStream {
			c.out.opened(stream)
			c.lastStream = stream
		}
		c.mu.Unlock()
		return
	}
	if kind != framePing || flags&flagAck != 0 || c.policy.maxStrikes <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if !c.lastPing.IsZero() && now.Sub(c.lastPing) < c.policy.minInterval {
		c.strikes++
	}
	c.lastPing = now
	if c.strikes > c.policy.maxStrikes && !c.goAwayOwed {
		c.goAwayOwed = true
		if c.out.atBoundary() {
			c.sendAway()
		}
	}
}

// sent sees each frame header this side sends: an answer's HEADERS or DATA clears the
// strikes, as gRPC core does.
func (c *policedConn) sent(h []byte) {
	if h[3] == frameHeaders || h[3] == frameData {
		c.lastPing = time.Time{}
		c.strikes = 0
	}
}

func (c *policedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.goneAway {
		return 0, net.ErrClosed
	}
	if c.off.Load() {
		return c.Conn.Write(p)
	}
	if c.answers.err != nil {
		return 0, c.answers.err
	}
	c.out.receive.received = c.dataRead.Load()
	defer c.noteOwed()
	holding := c.answers.size() > 0
	if !holding && c.out.atBoundary() && c.out.windowUpdateToOwe(p) {
		c.noteOwed()
		// Published, then the room looked at again: DATA the reading side counted before the
		// top was published was checked against none.
		if c.owedTop.Load()-c.dataRead.Load() >= windowHoldFloor {
			return len(p), nil // owed: it leaves with the next write, no timer for it
		}
		p = c.out.owedWindowUpdate() // the client ran short meanwhile: the sum, now
	} else if owed := c.out.owedWindowUpdate(); owed != nil {
		c.out.feed(owed, c.sent) // counted as written with what follows
		c.answers.keep(owed, c.flushLate)
		holding = true
	}
	more := c.out.feed(p, c.sent)
	// An update that ends a write of other frames (a PING's ack) is held only with an
	// answer already held, whose backstop is armed anyway: never on a timer of its own.
	if more && (holding || c.out.kind != frameWindowUpdate) && c.answers.size()+len(p) <= holdBytes {
		c.answers.keep(p, c.flushLate)
		return len(p), nil
	}
	n, err := c.writeThrough(p)
	if c.goAwayOwed && err == nil && c.out.atBoundary() {
		c.sendAway()
	}
	return n, err
}

// noteOwed publishes what the reading side needs to know of an owed update. Under mu.
func (c *policedConn) noteOwed() {
	if c.out.receive.unsent > 0 {
		c.owedTop.Store(defaultWindow + c.out.receive.granted)
	} else {
		c.owedTop.Store(0)
	}
}

// flushOwed writes the owed WINDOW_UPDATE (with whatever is held) now: the client has sent
// so much since it was owed that its room fell below windowHoldFloor.
func (c *policedConn) flushOwed() {
	c.mu.Lock()
	defer c.mu.Unlock()
	defer c.flushingOwed.Store(false)
	if c.goneAway || c.answers.err != nil {
		return
	}
	if owed := c.out.owedWindowUpdate(); owed != nil { // else a write in progress ends first
		c.out.feed(owed, c.sent)
		c.writeLate(owed)
	}
	c.noteOwed()
}

// writeThrough writes what is held and p, in one write when they fit the hold's buffer; n
// counts p's bytes written. Under mu.
func (c *policedConn) writeThrough(p []byte) (int, error) {
	defer c.out.written()
	held := c.answers.size()
	if held == 0 {
		return c.Conn.Write(p)
	}
	defer c.answers.release()
	buf := *c.answers.buf
	if held+len(p) > cap(buf) {
		if _, err := c.Conn.Write(buf); err != nil {
			return 0, err
		}
		return c.Conn.Write(p)
	}
	buf = append(buf, p...)
	*c.answers.buf = buf
	n, err := c.Conn.Write(buf)
	return max(0, n-held), err
}

// flushLate writes what is still held when the backstop fires.
func (c *policedConn) flushLate() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.answers.size() == 0 || c.goneAway {
		return
	}
	c.writeLate(nil)
}

// writeLate writes what is held and p outside any net/http write; a failure closes the
// connection (net/http took those bytes as written) and fails every later write. Under mu.
func (c *policedConn) writeLate(p []byte) {
	if _, err := c.writeThrough(p); err != nil {
		c.answers.err = err
		_ = c.Conn.Close()
	}
}

// sendAway writes GOAWAY (ENHANCE_YOUR_CALM, "too_many_pings") and closes; under mu, at an
// outbound frame boundary.
func (c *policedConn) sendAway() {
	const debug = tooManyPings
	frame := make([]byte, frameHeaderBytes+8+len(debug))
	length := 8 + len(debug)
	frame[0], frame[1], frame[2] = byte(length>>16), byte(length>>8), byte(length)
	frame[3] = frameGoAway
	binary.BigEndian.PutUint32(frame[9:13], c.lastStream)
	binary.BigEndian.PutUint32(frame[13:17], errEnhanceYourCalm)
	copy(frame[17:], debug)
	c.goneAway = true
	_ = c.Conn.SetWriteDeadline(time.Now().Add(time.Second))
	_, _ = c.writeThrough(frame)
	_ = c.Conn.Close()
}

// policedTLSConn keeps what net/http asks of a TLS connection (the handshake, the
// negotiated protocol, the client's certificate) while the policy reads the plaintext.
type policedTLSConn struct {
	*policedConn
	tls *tls.Conn
}

func (c policedTLSConn) ConnectionState() tls.ConnectionState { return c.tls.ConnectionState() }

func (c policedTLSConn) HandshakeContext(ctx context.Context) error {
	return c.tls.HandshakeContext(ctx)
}

// policedListener wraps each accepted connection; with a TLS config it also terminates TLS.
type policedListener struct {
	net.Listener
	policy pingPolicy
	tls    *tls.Config
}

func (l policedListener) Accept() (net.Conn, error) {
	raw, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	raw = newRawTCPConn(raw)
	if l.tls == nil {
		return &policedConn{Conn: raw, policy: l.policy}, nil
	}
	secured := tls.Server(raw, l.tls)
	return policedTLSConn{&policedConn{Conn: secured, policy: l.policy}, secured}, nil
}

package main

import (
	"bytes"
	"encoding/binary"
	"net"
	"sync"
	"testing"
	"time"
)

// grpcFrame is one gRPC message: the uncompressed flag, its length, its bytes.
func grpcFrame(message []byte) []byte {
	out := make([]byte, grpcPrefixBytes, grpcPrefixBytes+len(message))
	binary.BigEndian.PutUint32(out[1:], uint32(len(message)))
	return append(out, message...)
}

// dataFrames cuts a stream's bytes into DATA frames of at most size bytes.
func dataFrames(stream uint32, body []byte, size int, endStream bool) [][]byte {
	var frames [][]byte
	for len(body) > 0 {
		n := min(size, len(body))
		flags := byte(0)
		if endStream && n == len(body) {
			flags = flagEndStream
		}
		frames = append(frames, frame(frameData, flags, stream, body[:n]))
		body = body[n:]
	}
	return frames
}

// writeRecorder is the socket under a policed connection: it keeps each write apart.
type writeRecorder struct {
	net.Conn
	mu     sync.Mutex
	writes [][]byte
}

func (r *writeRecorder) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.writes = append(r.writes, bytes.Clone(p))
	return len(p), nil
}

func (r *writeRecorder) Close() error { return nil }

func (r *writeRecorder) taken() (count int, all []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.writes), bytes.Join(r.writes, nil)
}

// recorded is a connection to a client whose windows never run out (as gRPC clients that
// size them by the bandwidth-delay product, and h2load's), unless defaultWindows says
// HTTP/2's 64 KiB.
func recorded(defaultWindows ...bool) (*policedConn, *writeRecorder) {
	socket := &writeRecorder{}
	conn := &policedConn{Conn: socket}
	conn.prefaceSeen = len(clientPreface)
	// Writes are counted, never timed: on a busy machine the writing of one message's
	// frames can outlast holdFor, and the backstop would then count as a write of its own.
	conn.answers.backstop = time.Hour
	if len(defaultWindows) == 0 || !defaultWindows[0] {
		conn.out.flow = flowWindows{connGranted: 1 << 40, initialDelta: 1 << 40}
	}
	return conn, socket
}

// fromClient has the connection read frames the client sent.
func fromClient(t *testing.T, conn *policedConn, frames ...[]byte) {
	t.Helper()
	p := bytes.Join(frames, nil)
	if kept := conn.inspect(p); kept != len(p) {
		t.Fatalf("inspect kept %d of %d bytes", kept, len(p))
	}
}

func windowUpdate(stream uint32, increment uint32) []byte {
	return frame(frameWindowUpdate, 0, stream, binary.BigEndian.AppendUint32(nil, increment))
}

func TestNothingIsHeldThatWaitsForTheClientsWindow(t *testing.T) {
	// HTTP/2's default windows (64 KiB): net/http writes the headers and 65535 bytes of a
	// 256 KiB answer, then waits for a WINDOW_UPDATE that the client sends only for bytes it
	// has received. Held, they would leave by the backstop only, at every window's worth.
	conn, socket := recorded(true)
	fromClient(t, conn, frame(frameSettings, 0, 0, nil), frame(frameHeaders, 0x4, 1, []byte{0x83}))
	headers := frame(frameHeaders, 0x4, 1, []byte{0x88, 0x5f})
	message := grpcFrame(make([]byte, 256<<10))
	frames := dataFrames(1, message[:defaultWindow], 16<<10, false)
	_, _ = conn.Write(headers)
	sent := bytes.Clone(headers)
	for _, f := range frames {
		_, _ = conn.Write(f)
		sent = append(sent, f...)
	}
	if _, all := socket.taken(); !bytes.Equal(all, sent) || conn.answers.size() != 0 {
		t.Fatalf("%d of %d bytes written, %d held: the window is spent, the client must see them",
			len(all), len(sent), conn.answers.size())
	}
	// The client's WINDOW_UPDATEs (stream and connection) make room for the rest: it is
	// held until the message is whole, and leaves in one write.
	rest := len(message) - defaultWindow
	fromClient(t, conn, windowUpdate(0, uint32(rest)), windowUpdate(1, uint32(rest)))
	before, _ := socket.taken()
	for _, f := range dataFrames(1, message[defaultWindow:], 16<<10, false) {
		_, _ = conn.Write(f)
		sent = append(sent, f...)
	}
	if count, all := socket.taken(); count != before+1 || !bytes.Equal(all, sent) {
		t.Fatalf("%d writes for the rest (want 1), bytes equal: %v", count-before, bytes.Equal(all, sent))
	}
}

func TestTheClientsSettingsSizeTheStreamsWindow(t *testing.T) {
	conn, socket := recorded(true)
	initial := binary.BigEndian.AppendUint32([]byte{0, settingInitialWindow}, 1<<20)
	// A SETTINGS frame split across reads, and the connection's window grown.
	fromClient(t, conn, frame(frameSettings, 0, 0, initial)[:11])
	fromClient(t, conn, frame(frameSettings, 0, 0, initial)[11:], windowUpdate(0, 1<<20),
		frame(frameHeaders, 0x4, 1, []byte{0x83}))
	for _, f := range dataFrames(1, grpcFrame(make([]byte, 256<<10)), 16<<10, false) {
		_, _ = conn.Write(f)
	}
	if count, _ := socket.taken(); count != 1 {
		t.Fatalf("%d writes for one message within the client's windows (want 1)", count)
	}
	// A stream the client reset is forgotten.
	fromClient(t, conn, frame(frameRSTStream, 0, 1, []byte{0, 0, 0, 8}))
	if len(conn.out.flow.streams) != 0 {
		t.Fatalf("%d streams still followed after the reset", len(conn.out.flow.streams))
	}
}

func TestAMalformedWindowFrameIsNotCollectedAndEndsTheHold(t *testing.T) {
	// A SETTINGS frame claiming 16 MiB (net/http refuses it and ends the connection): its
	// payload is never gathered here, and with the windows unknown nothing is held.
	conn, socket := recorded(true)
	huge := []byte{0xff, 0xff, 0xfc, frameSettings, 0, 0, 0, 0, 0}
	fromClient(t, conn, append(huge, make([]byte, 4<<10)...))
	if conn.inFlow != nil || cap(conn.scratchFlow) > maxSettingsPayload {
		t.Fatalf("a malformed SETTINGS payload was collected (%d bytes kept)", cap(conn.scratchFlow))
	}
	headers := frame(frameHeaders, 0x4, 1, []byte{0x88, 0x5f})
	_, _ = conn.Write(headers)
	if _, all := socket.taken(); !bytes.Equal(all, headers) {
		t.Fatalf("headers held on a connection whose windows are unknown")
	}
}

func TestAnAnswerLeavesInOneWriteWhenItsMessageIsWhole(t *testing.T) {
	conn, socket := recorded()
	message := grpcFrame(bytes.Repeat([]byte{7}, 256<<10))
	var sent []byte
	for i, f := range dataFrames(1, message, 16<<10, false) {
		if _, err := conn.Write(f); err != nil {
			t.Fatal(err)
		}
		sent = append(sent, f...)
		if count, _ := socket.taken(); i < len(message)/(16<<10) && count != 0 {
			t.Fatalf("frame %d of an unfinished message was written at once", i)
		}
	}
	count, all := socket.taken()
	if count != 1 || !bytes.Equal(all, sent) {
		t.Fatalf("%d writes (want 1), bytes equal: %v", count, bytes.Equal(all, sent))
	}
	trailers := frame(frameHeaders, flagEndStream|0x4, 1, []byte{0x88})
	if _, err := conn.Write(trailers); err != nil {
		t.Fatal(err)
	}
	if count, all := socket.taken(); count != 2 || !bytes.Equal(all, append(sent, trailers...)) {
		t.Fatalf("after the trailers: %d writes", count)
	}
}

func TestEveryWholeStreamMessageLeavesAtOnce(t *testing.T) {
	// A stream's answers, each cut anywhere into frames and writes: the bytes reach the
	// socket in order, and nothing of a whole message stays held.
	conn, socket := recorded()
	var body []byte
	for i := range 4 {
		body = append(body, grpcFrame(bytes.Repeat([]byte{byte(i)}, 1000*i))...) // one empty
	}
	for cut := 1; cut < len(body); cut += 97 {
		conn, socket = recorded()
		for _, part := range [][]byte{body[:cut], body[cut:]} {
			for _, f := range dataFrames(3, part, 700, false) {
				for len(f) > 0 { // a frame can reach the socket in pieces too
					n := min(len(f), 5+cut%11)
					if _, err := conn.Write(f[:n]); err != nil {
						t.Fatal(err)
					}
					f = f[n:]
				}
			}
		}
		if conn.answers.size() != 0 {
			t.Fatalf("cut at %d: %d bytes still held after whole messages", cut, conn.answers.size())
		}
	}
	_ = socket
}

func TestInterleavedStreamsFlushWhenAnyMessageIsWhole(t *testing.T) {
	conn, socket := recorded()
	a := dataFrames(1, grpcFrame(make([]byte, 40<<10)), 16<<10, false) // 3 frames
	b := dataFrames(3, grpcFrame(make([]byte, 20<<10)), 16<<10, false) // 2 frames
	for _, f := range [][]byte{a[0], b[0], a[1]} {
		_, _ = conn.Write(f)
	}
	if count, _ := socket.taken(); count != 0 {
		t.Fatalf("%d writes before any message was whole", count)
	}
	_, _ = conn.Write(b[1]) // b is whole: everything held so far leaves with it
	if count, _ := socket.taken(); count != 1 || conn.answers.size() != 0 {
		t.Fatalf("%d writes, %d held after b ended", count, conn.answers.size())
	}
	_, _ = conn.Write(a[2])
	if count, _ := socket.taken(); count != 2 {
		t.Fatalf("%d writes after a ended", count)
	}
}

func TestOtherFramesAndStreamEndsAreNeverHeld(t *testing.T) {
	part := dataFrames(1, grpcFrame(make([]byte, 30<<10)), 16<<10, false)[0]
	for name, next := range map[string][]byte{
		"ping":       frame(framePing, 0, 0, make([]byte, 8)),
		"rst_stream": frame(frameRSTStream, 0, 1, []byte{0, 0, 0, 8}),
		"end_stream": frame(frameData, flagEndStream, 1, nil),
		"trailers":   frame(frameHeaders, flagEndStream|0x4, 1, []byte{0x88}),
		"continued":  frame(0x9, 0x4, 5, []byte{0x88}),
		"padded":     frame(frameData, flagPadded, 5, []byte{0, 0, 0, 0, 0, 9}),
	} {
		conn, socket := recorded()
		_, _ = conn.Write(part)
		_, _ = conn.Write(next)
		if count, all := socket.taken(); count != 1 || !bytes.Equal(all, append(bytes.Clone(part), next...)) {
			t.Fatalf("%s: %d writes (want 1, the held frame with it)", name, count)
		}
	}
}

func TestAnswerHeadersLeaveWithTheFirstWholeMessage(t *testing.T) {
	conn, socket := recorded()
	headers := frame(frameHeaders, 0x4, 1, []byte{0x88, 0x5f})
	message := dataFrames(1, grpcFrame(make([]byte, 20<<10)), 16<<10, false)
	_, _ = conn.Write(headers)
	_, _ = conn.Write(message[0])
	if count, _ := socket.taken(); count != 0 {
		t.Fatalf("%d writes before the message was whole", count)
	}
	_, _ = conn.Write(message[1])
	count, all := socket.taken()
	want := bytes.Join([][]byte{headers, message[0], message[1]}, nil)
	if count != 1 || !bytes.Equal(all, want) {
		t.Fatalf("%d writes (want 1: headers and message together)", count)
	}
}

func TestAHeldPartLeavesByTheBackstop(t *testing.T) {
	conn, socket := recorded()
	conn.answers.backstop = holdFor
	part := dataFrames(1, grpcFrame(make([]byte, 30<<10)), 16<<10, false)[0]
	_, _ = conn.Write(part)
	deadline := time.Now().Add(5 * time.Second)
	for {
		if count, all := socket.taken(); count == 1 {
			conn.mu.Lock() // the backstop released the hold on its own goroutine
			held := conn.answers.size()
			conn.mu.Unlock()
			if !bytes.Equal(all, part) || held != 0 {
				t.Fatal("the backstop wrote other bytes, or kept some")
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("held bytes never left")
		}
		time.Sleep(holdFor / 4)
	}
}

func TestHoldingStopsAtItsBound(t *testing.T) {
	conn, socket := recorded()
	for _, f := range dataFrames(1, grpcFrame(make([]byte, 4*holdBytes)), 16<<10, false) {
		_, _ = conn.Write(f)
		if conn.answers.size() > holdBytes {
			t.Fatalf("%d bytes held, bound %d", conn.answers.size(), holdBytes)
		}
	}
	if count, _ := socket.taken(); count < 4 || count > 8 {
		t.Fatalf("%d writes for 4 bounds' worth of one message", count)
	}
}

// granted is a connection whose client got the gateway's 8 MiB connection window, as
// net/http grants it once the connection starts (written at once: 64 KiB is all it had).
func granted(t *testing.T) (*policedConn, *writeRecorder) {
	t.Helper()
	conn, socket := recorded()
	grant := windowUpdate(0, 8<<20-defaultWindow)
	_, _ = conn.Write(grant)
	if count, all := socket.taken(); count != 1 || !bytes.Equal(all, grant) {
		t.Fatalf("the first grant: %d writes; a client with HTTP/2's first window must see it", count)
	}
	return conn, socket
}

// aRequest has the client send a request of size bytes on stream.
func aRequest(t *testing.T, conn *policedConn, stream uint32, size int) {
	t.Helper()
	frames := [][]byte{frame(frameHeaders, 0x4, stream, []byte{0x83})}
	frames = append(frames, dataFrames(stream, grpcFrame(make([]byte, size)), 16<<10, true)...)
	fromClient(t, conn, frames...)
}

func TestTheConnectionsWindowUpdateLeavesWithTheAnswer(t *testing.T) {
	// net/http grants the connection's window back for each request body it reads, in a
	// write of its own: held, it leaves with the answer's headers and message.
	conn, socket := granted(t)
	aRequest(t, conn, 1, 32<<10)
	update := windowUpdate(0, 32<<10+grpcPrefixBytes)
	headers := frame(frameHeaders, 0x4, 1, []byte{0x88, 0x5f})
	message := dataFrames(1, grpcFrame(make([]byte, 32<<10)), 16<<10, false)
	trailers := frame(frameHeaders, flagEndStream|0x4, 1, []byte{0x88})
	for _, f := range append([][]byte{update, headers}, message...) {
		_, _ = conn.Write(f)
	}
	count, all := socket.taken()
	want := bytes.Join(append([][]byte{windowUpdate(0, 8<<20-defaultWindow), update, headers}, message...), nil)
	if count != 2 || !bytes.Equal(all, want) {
		t.Fatalf("%d writes (want 2: the first grant, then the update with the answer)", count)
	}
	_, _ = conn.Write(trailers)
	if count, _ := socket.taken(); count != 3 {
		t.Fatalf("after the trailers: %d writes (want 3)", count)
	}
	if conn.out.receive.owed != 0 || conn.out.receive.granted != 8<<20-defaultWindow+32<<10+grpcPrefixBytes {
		t.Fatalf("increments on the socket %d, owed %d", conn.out.receive.granted, conn.out.receive.owed)
	}
}

func TestARefusalTakesOneWriteWithTheWindowUpdate(t *testing.T) {
	conn, socket := granted(t)
	aRequest(t, conn, 1, 128<<10)
	update := windowUpdate(0, 128<<10+grpcPrefixBytes)
	refusal := frame(frameHeaders, flagEndStream|0x4, 1, []byte{0x88, 0x40})
	_, _ = conn.Write(update)
	_, _ = conn.Write(refusal)
	if count, all := socket.taken(); count != 2 || !bytes.HasSuffix(all, append(bytes.Clone(update), refusal...)) {
		t.Fatalf("%d writes (want 2: the first grant, then the update with the refusal)", count)
	}
}

func TestAWindowUpdateIsWrittenAtOnceWhenTheClientRunsShort(t *testing.T) {
	// The client has sent all but under windowHoldFloor of its window: it may be waiting
	// for this update, so it is not held.
	conn, socket := granted(t)
	for stream := uint32(1); conn.out.receive.room() >= windowHoldFloor || conn.dataRead.Load() == 0; stream += 2 {
		aRequest(t, conn, stream, 512<<10)
		conn.out.receive.received = conn.dataRead.Load()
	}
	update := windowUpdate(0, 512<<10+grpcPrefixBytes)
	_, _ = conn.Write(update)
	if count, _ := socket.taken(); count != 2 || conn.answers.size() != 0 {
		t.Fatalf("%d writes, %d bytes held: an update the client may wait for was held", count, conn.answers.size())
	}
	// Written, it counts: the room is back above the floor, and the next one is held.
	if conn.out.receive.room() < windowHoldFloor {
		t.Fatalf("room %d after the update reached the socket", conn.out.receive.room())
	}
	_, _ = conn.Write(windowUpdate(0, 4<<10))
	if count, _ := socket.taken(); count != 2 {
		t.Fatalf("%d writes: an update with room to spare was not held", count)
	}
}

func TestAnOwedWindowUpdateLeavesWithTheNextWriteWhateverItIs(t *testing.T) {
	// No answer follows soon (a slow computation): the update waits, with no backstop to
	// wake this process for it, and leaves with the next frame written, a PING's ack here.
	conn, socket := granted(t)
	conn.answers.backstop = holdFor
	aRequest(t, conn, 1, 32<<10)
	update := windowUpdate(0, 32<<10+grpcPrefixBytes)
	_, _ = conn.Write(update)
	if conn.answers.size() != 0 || conn.answers.timer != nil {
		t.Fatal("a lone owed update took the hold's buffer or armed its backstop")
	}
	time.Sleep(3 * holdFor)
	if count, _ := socket.taken(); count != 1 {
		t.Fatalf("%d writes while nothing else was written (want only the first grant)", count)
	}
	ack := frame(framePing, flagAck, 0, make([]byte, 8))
	_, _ = conn.Write(ack)
	if count, all := socket.taken(); count != 2 || !bytes.HasSuffix(all, append(bytes.Clone(update), ack...)) {
		t.Fatalf("%d writes: the owed update did not leave with the next write", count)
	}
	if conn.out.receive.unsent != 0 || conn.out.receive.owed != 0 {
		t.Fatal("the increment is still counted as owed once written")
	}
}

func TestAnOwedUpdateLeavesOnceTheClientRunsShortThoughNothingIsWritten(t *testing.T) {
	// Streams whose handlers stopped reading take the rest of the window, and another
	// stream's handler waits for data: nothing will be written to carry the update, so the
	// reading side sends it as the room falls below the floor.
	conn, socket := granted(t)
	aRequest(t, conn, 1, 32<<10)
	increment := uint32(32<<10 + grpcPrefixBytes)
	_, _ = conn.Write(windowUpdate(0, increment))
	if count, _ := socket.taken(); count != 1 {
		t.Fatalf("%d writes: the update was not owed", count)
	}
	for stream := uint32(3); conn.dataRead.Load() < 8<<20-windowHoldFloor; stream += 2 {
		aRequest(t, conn, stream, 512<<10)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if count, all := socket.taken(); count == 2 {
			if !bytes.HasSuffix(all, windowUpdate(0, increment)) {
				t.Fatal("the second write is not the owed update")
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the owed update never left while the client ran short")
		}
		time.Sleep(time.Millisecond)
	}
	conn.mu.Lock()
	defer conn.mu.Unlock()
	if conn.out.receive.unsent != 0 || conn.owedTop.Load() != 0 {
		t.Fatal("still owed after it was written")
	}
}

func TestAnUpdateEndingAWriteOfOtherFramesIsNotHeldOnItsOwn(t *testing.T) {
	// A PING's ack and an update in one write: nothing is held to go with them, so they
	// leave at once (held, the ack would wait for the backstop and skew the client's RTT).
	conn, socket := granted(t)
	aRequest(t, conn, 1, 32<<10)
	both := append(frame(framePing, flagAck, 0, make([]byte, 8)), windowUpdate(0, 32<<10)...)
	_, _ = conn.Write(both)
	if count, all := socket.taken(); count != 2 || !bytes.HasSuffix(all, both) {
		t.Fatalf("%d writes: an ack with an update was held", count)
	}
}

func TestAStreamsWindowUpdateIsNeverHeld(t *testing.T) {
	conn, socket := granted(t)
	aRequest(t, conn, 1, 32<<10)
	_, _ = conn.Write(windowUpdate(1, 32<<10))
	if count, _ := socket.taken(); count != 2 {
		t.Fatalf("%d writes: a stream's WINDOW_UPDATE was held", count)
	}
}

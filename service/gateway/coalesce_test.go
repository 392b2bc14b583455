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

func recorded() (*policedConn, *writeRecorder) {
	socket := &writeRecorder{}
	conn := &policedConn{Conn: socket}
	conn.prefaceSeen = len(clientPreface)
	return conn, socket
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
	part := dataFrames(1, grpcFrame(make([]byte, 30<<10)), 16<<10, false)[0]
	_, _ = conn.Write(part)
	deadline := time.Now().Add(5 * time.Second)
	for {
		if count, all := socket.taken(); count == 1 {
			if !bytes.Equal(all, part) || conn.answers.size() != 0 {
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

package main

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

func frame(kind, flags byte, stream uint32, payload []byte) []byte {
	out := []byte{byte(len(payload) >> 16), byte(len(payload) >> 8), byte(len(payload)), kind, flags, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(out[5:], stream)
	return append(out, payload...)
}

// servePoliced serves h2c behind the ping policy and returns the client's raw connection,
// preface and SETTINGS sent.
func servePoliced(t *testing.T, policy pingPolicy) net.Conn {
	return servePolicedWith(t, policy, 0, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("answer"))
	}))
}

func servePolicedWith(t *testing.T, policy pingPolicy, maxStreams int, handler http.Handler) net.Conn {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	server := &http.Server{Handler: handler, Protocols: &protocols,
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: maxStreams}}
	go func() { _ = server.Serve(policedListener{Listener: listener, policy: policy}) }()
	t.Cleanup(func() { _ = server.Close() })
	conn, err := net.Dial("tcp", listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	_, _ = conn.Write(append([]byte(clientPreface), frame(0x4, 0, 0, nil)...))
	return conn
}

// frames reads frames until the connection ends or goAway is seen; it returns the GOAWAY's
// payload (nil if none came) and the count of PING acks.
func readUntilGoAway(t *testing.T, conn net.Conn, pings int) (goAway []byte, acks int) {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	reader := bufio.NewReader(conn)
	for {
		var header [frameHeaderBytes]byte
		if _, err := io.ReadFull(reader, header[:]); err != nil {
			return nil, acks
		}
		payload := make([]byte, int(header[0])<<16|int(header[1])<<8|int(header[2]))
		if _, err := io.ReadFull(reader, payload); err != nil {
			return nil, acks
		}
		switch {
		case header[3] == frameGoAway:
			return payload, acks
		case header[3] == framePing && header[4]&flagAck != 0:
			acks++
			if acks == pings {
				return nil, acks
			}
		}
	}
}

func TestPingsTooOftenEarnGoAwayTooManyPings(t *testing.T) {
	conn := servePoliced(t, pingPolicy{minInterval: time.Hour, maxStrikes: 2})
	for i := range 4 { // the first is free; then three strikes, one past the two allowed
		_, _ = conn.Write(frame(framePing, 0, 0, bytes.Repeat([]byte{byte(i)}, 8)))
	}
	goAway, acks := readUntilGoAway(t, conn, -1)
	if goAway == nil {
		t.Fatalf("no GOAWAY after 4 pings (%d acked)", acks)
	}
	if code := binary.BigEndian.Uint32(goAway[4:8]); code != errEnhanceYourCalm {
		t.Fatalf("GOAWAY code %#x", code)
	}
	if string(goAway[8:]) != "too_many_pings" {
		t.Fatalf("GOAWAY debug %q", goAway[8:])
	}
	if _, err := conn.Read(make([]byte, 1)); err == nil {
		t.Fatal("connection still open after GOAWAY")
	}
}

func TestStrikesWithinTheLimitAndPingsAfterAnAnswerAreServed(t *testing.T) {
	conn := servePoliced(t, pingPolicy{minInterval: time.Hour, maxStrikes: 2})
	for i := range 3 { // two strikes: allowed
		_, _ = conn.Write(frame(framePing, 0, 0, bytes.Repeat([]byte{byte(i)}, 8)))
	}
	if goAway, acks := readUntilGoAway(t, conn, 3); goAway != nil || acks != 3 {
		t.Fatalf("GOAWAY %q, %d acks", goAway, acks)
	}
	// A call answered (HEADERS and DATA sent) clears the strikes.
	headers := []byte{0x83, 0x84, 0x86, 0x41, 0x01, 'x'} // :method POST, :path /, :scheme http, :authority x
	_, _ = conn.Write(frame(frameHeaders, 0x5, 1, headers))
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	reader := bufio.NewReader(conn)
	for answered := false; !answered; {
		var header [frameHeaderBytes]byte
		if _, err := io.ReadFull(reader, header[:]); err != nil {
			t.Fatal(err)
		}
		if _, err := io.CopyN(io.Discard, reader, int64(int(header[0])<<16|int(header[1])<<8|int(header[2]))); err != nil {
			t.Fatal(err)
		}
		answered = header[3] == frameData
	}
	for i := range 3 {
		_, _ = conn.Write(frame(framePing, 0, 0, bytes.Repeat([]byte{byte(10 + i)}, 8)))
	}
	acks := 0
	for acks < 3 {
		var header [frameHeaderBytes]byte
		if _, err := io.ReadFull(reader, header[:]); err != nil {
			t.Fatalf("after %d acks: %v", acks, err)
		}
		if _, err := io.CopyN(io.Discard, reader, int64(int(header[0])<<16|int(header[1])<<8|int(header[2]))); err != nil {
			t.Fatal(err)
		}
		if header[3] == frameGoAway {
			t.Fatal("GOAWAY although an answer cleared the strikes")
		}
		if header[3] == framePing && header[4]&flagAck != 0 {
			acks++
		}
	}
}

func TestAnswerFramesFollowFramesSplitAnywhere(t *testing.T) {
	stream := append(frame(frameData, 0, 1, make([]byte, 300)), frame(framePing, 0, 0, make([]byte, 8))...)
	stream = append(stream, frame(frameHeaders, 0x4, 3, []byte{1, 2})...)
	for cut := 1; cut < len(stream); cut++ {
		var cursor answerFrames
		var kinds []byte
		seen := func(h []byte) { kinds = append(kinds, h[3]) }
		cursor.feed(stream[:cut], seen)
		cursor.feed(stream[cut:], seen)
		if !bytes.Equal(kinds, []byte{frameData, framePing, frameHeaders}) || !cursor.atBoundary() {
			t.Fatalf("cut at %d: kinds %v, boundary %v", cut, kinds, cursor.atBoundary())
		}
	}
}

func TestStreamsPastTheBoundAreRefused(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	conn := servePolicedWith(t, pingPolicy{}, 2, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		<-release
	}))
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	reader := bufio.NewReader(conn)
	next := func() ([frameHeaderBytes]byte, []byte) {
		var header [frameHeaderBytes]byte
		if _, err := io.ReadFull(reader, header[:]); err != nil {
			t.Fatal(err)
		}
		payload := make([]byte, int(header[0])<<16|int(header[1])<<8|int(header[2]))
		if _, err := io.ReadFull(reader, payload); err != nil {
			t.Fatal(err)
		}
		return header, payload
	}
	for header, _ := next(); header[3] != frameSettings || header[4]&flagAck != 0; header, _ = next() {
	}
	// The client acknowledges the server's SETTINGS in two pieces, then opens three calls.
	ack := frame(frameSettings, flagAck, 0, nil)
	_, _ = conn.Write(ack[:4])
	time.Sleep(10 * time.Millisecond) // two reads on the server's side (not a wait for anything)
	_, _ = conn.Write(ack[4:])
	headers := []byte{0x83, 0x84, 0x86, 0x41, 0x01, 'x'}
	for _, stream := range []uint32{1, 3, 5} {
		_, _ = conn.Write(frame(frameHeaders, 0x5, stream, headers))
	}
	for {
		header, payload := next()
		if header[3] == 0x3 /* RST_STREAM */ {
			stream := binary.BigEndian.Uint32(header[5:9])
			if code := binary.BigEndian.Uint32(payload); stream != 5 || code != 0x7 {
				t.Fatalf("stream %d reset with code %#x, want 5 refused (0x7)", stream, code)
			}
			return
		}
	}
}

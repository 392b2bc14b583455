package main

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net"
	"testing"
)

// TestReadAheadGivesEveryByteInOrder: reads of every size (a frame header's 9 bytes, small
// and large payloads, reads past the read-ahead buffer) through the read-ahead see exactly
// what the peer wrote, in the pieces it wrote them, then EOF.
func TestReadAheadGivesEveryByteInOrder(t *testing.T) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close()
	rng := rand.New(rand.NewPCG(5, 6))
	sent := make([]byte, 3*readAheadBytes+12345)
	for i := range sent {
		sent[i] = byte(rng.Uint32())
	}
	go func() {
		peer, err := net.Dial("tcp", listener.Addr().String())
		if err != nil {
			return
		}
		defer peer.Close()
		for rest := sent; len(rest) > 0; {
			n := min(len(rest), 1+rng.IntN(40000))
			peer.Write(rest[:n])
			rest = rest[n:]
		}
	}()
	accepted, err := listener.Accept()
	if err != nil {
		t.Fatal(err)
	}
	conn := newRawTCPConn(accepted)
	defer conn.Close()
	if _, ok := conn.(*rawTCPConn); !ok {
		t.Fatal("a TCP connection was not given raw reads")
	}
	var got bytes.Buffer
	sizes := []int{9, 1, 16384, 40, readAheadBytes, 2 * readAheadBytes, 3}
	for i := 0; ; i++ {
		p := make([]byte, sizes[i%len(sizes)])
		n, err := conn.Read(p)
		got.Write(p[:n])
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(got.Bytes(), sent) {
		t.Fatalf("read %d bytes, not the %d sent in order", got.Len(), len(sent))
	}
}

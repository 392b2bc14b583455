package main

// Socket reads and writes that do not enter the Go scheduler's syscall state.
//
// Every blocking-capable system call made through net.Conn marks its thread as in a syscall
// (entersyscall), which wakes the runtime's monitor thread (sysmon) when it was parked, and
// lets it hand the processor to another thread when the call takes more than 20 µs — as it
// does whenever the kernel switches to the worker or the client sharing this core. Measured
// with one caller, one core: 8.1 context switches per call in the gateway, 3.5 of them the
// monitor's. These sockets are non-blocking, so a read or write never blocks: made as raw
// calls inside syscall.RawConn's callbacks (which wait on the poller, deadlines included,
// when there is nothing to read or no room to write), they leave the scheduler alone.

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"unsafe"
)

// rawIO reads and writes one non-blocking socket with raw system calls.
type rawIO struct{ raw syscall.RawConn }

func newRawIO(conn syscall.Conn) (rawIO, error) {
	raw, err := conn.SyscallConn()
	return rawIO{raw}, err
}

func (r rawIO) read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	var n int
	var errno syscall.Errno
	err := r.raw.Read(func(fd uintptr) bool {
		for {
			got, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
			switch e {
			case syscall.EINTR:
				continue
			case syscall.EAGAIN:
				return false // wait until readable (or the deadline)
			}
			n, errno = int(got), e
			return true
		}
	})
	switch {
	case err != nil:
		return 0, err
	case errno != 0:
		return 0, os.NewSyscallError("read", errno)
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

func (r rawIO) write(p []byte) (int, error) {
	written := 0
	var errno syscall.Errno
	err := r.raw.Write(func(fd uintptr) bool {
		for written < len(p) {
			rest := p[written:]
			n, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&rest[0])), uintptr(len(rest)))
			switch e {
			case 0:
				written += int(n)
			case syscall.EINTR:
			case syscall.EAGAIN:
				return false // wait until writable (or the deadline)
			default:
				errno = e
				return true
			}
		}
		return true
	})
	if err != nil {
		return written, err
	}
	if errno != 0 {
		return written, os.NewSyscallError("write", errno)
	}
	return written, nil
}

// rawTCPConn is an accepted connection whose Read and Write are raw calls; everything else
// (deadlines, close, addresses) is the TCP connection's own.
//
// Reads go through a read-ahead buffer: net/http's HTTP/2 framer reads each frame's 9-byte
// header and then its payload, two system calls a frame (strace, one caller at seq 16: 8
// reads a call), where one read takes everything that has arrived. The buffer is pooled,
// taken only once the socket is readable and held only while it has unread bytes, so an idle
// connection holds none (2000 idle connections: the gateway's memory as without it).
type rawTCPConn struct {
	*net.TCPConn
	io    rawIO
	held  *[]byte // the pooled buffer that ahead is part of; nil when drained
	ahead []byte  // read from the socket, not yet by the caller
}

// readAheadBytes: a read this large or larger goes straight into the caller's buffer.
const readAheadBytes = 64 << 10

var readAheadBuffers = sync.Pool{New: func() any { b := make([]byte, readAheadBytes); return &b }}

func (c *rawTCPConn) Read(p []byte) (int, error) {
	if len(c.ahead) == 0 {
		if len(p) >= readAheadBytes {
			return c.io.read(p)
		}
		held, n, err := c.io.readPooled()
		if n == 0 {
			return 0, err
		}
		c.held, c.ahead = held, (*held)[:n]
	}
	n := copy(p, c.ahead)
	c.ahead = c.ahead[n:]
	if len(c.ahead) == 0 {
		readAheadBuffers.Put(c.held)
		c.held, c.ahead = nil, nil
	}
	return n, nil
}

func newRawTCPConn(conn net.Conn) net.Conn {
	tcp, ok := conn.(*net.TCPConn)
	if !ok {
		return conn
	}
	raw, err := newRawIO(tcp)
	if err != nil {
		return conn
	}
	return &rawTCPConn{TCPConn: tcp, io: raw}
}

func (c *rawTCPConn) Write(p []byte) (int, error) { return c.io.write(p) }

// readPooled reads into a pooled read-ahead buffer, taken only while the socket has bytes to
// read and given back when it has none: a connection waiting for its next frame (net/http
// keeps a read waiting on every connection) holds no buffer.
func (r rawIO) readPooled() (*[]byte, int, error) {
	var held *[]byte
	var n int
	var errno syscall.Errno
	err := r.raw.Read(func(fd uintptr) bool {
		for {
			buf := readAheadBuffers.Get().(*[]byte)
			got, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&(*buf)[0])), uintptr(len(*buf)))
			switch e {
			case syscall.EINTR:
				readAheadBuffers.Put(buf)
				continue
			case syscall.EAGAIN:
				readAheadBuffers.Put(buf)
				return false
			}
			if e != 0 || got == 0 {
				readAheadBuffers.Put(buf)
			} else {
				held = buf
			}
			n, errno = int(got), e
			return true
		}
	})
	switch {
	case err != nil:
		return nil, 0, err
	case errno != 0:
		return nil, 0, os.NewSyscallError("read", errno)
	case n == 0:
		return nil, 0, io.EOF
	}
	return held, n, nil
}

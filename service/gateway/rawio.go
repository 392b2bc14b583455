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
type rawTCPConn struct {
	*net.TCPConn
	io rawIO
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

func (c *rawTCPConn) Read(p []byte) (int, error)  { return c.io.read(p) }
func (c *rawTCPConn) Write(p []byte) (int, error) { return c.io.write(p) }

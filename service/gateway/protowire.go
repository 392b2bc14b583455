package main

// Just enough of the protobuf wire format to read a ModelInferRequest and write a
// ModelInferResponse without a generated parser: the tensor bytes are never copied to
// be parsed, only once into shared memory.

import (
	"encoding/binary"
	"errors"
	"math"
)

const (
	wireVarint  = 0
	wireFixed64 = 1
	wireBytes   = 2
	wireFixed32 = 5
)

var errMalformed = errors.New("malformed protobuf message")

const maxFieldNumber = 1<<29 - 1

// field is one field of a message: its number, wire type, and value (varint, or the
// bytes of a length-delimited field, a view into the message).
type field struct {
	num   int
	wire  int
	value uint64
	bytes []byte
}

func readVarint(b []byte) (uint64, int) {
	var x uint64
	for i := 0; i < len(b) && i < 10; i++ {
		x |= uint64(b[i]&0x7f) << (7 * uint(i))
		if b[i] < 0x80 {
			return x, i + 1
		}
	}
	return 0, 0
}

// eachField calls visit for every field of msg in order; errMalformed on a bad encoding.
func eachField(msg []byte, visit func(f field) error) error {
	for len(msg) > 0 {
		tag, n := readVarint(msg)
		// As upb reads a tag: at most 5 bytes, a field number in 1..2^29-1.
		if n == 0 || n > 5 || tag>>3 == 0 || tag>>3 > maxFieldNumber || tag > math.MaxUint32 {
			return errMalformed
		}
		msg = msg[n:]
		f := field{num: int(tag >> 3), wire: int(tag & 7)}
		switch f.wire {
		case wireVarint:
			f.value, n = readVarint(msg)
			if n == 0 {
				return errMalformed
			}
			msg = msg[n:]
		case wireFixed64:
			if len(msg) < 8 {
				return errMalformed
			}
			f.value = binary.LittleEndian.Uint64(msg)
			msg = msg[8:]
		case wireFixed32:
			if len(msg) < 4 {
				return errMalformed
			}
			f.value = uint64(binary.LittleEndian.Uint32(msg))
			msg = msg[4:]
		case wireBytes:
			length, n := readVarint(msg)
			if n == 0 || length > uint64(len(msg)-n) {
				return errMalformed
			}
			f.bytes = msg[n : n+int(length)]
			msg = msg[n+int(length):]
		default:
			return errMalformed // groups (3, 4) are not in these messages
		}
		if err := visit(f); err != nil {
			return err
		}
	}
	return nil
}

func appendVarint(b []byte, x uint64) []byte {
	for x >= 0x80 {
		b = append(b, byte(x)|0x80)
		x >>= 7
	}
	return append(b, byte(x))
}

func appendTag(b []byte, num, wire int) []byte {
	return appendVarint(b, uint64(num)<<3|uint64(wire))
}

func appendBytesField(b []byte, num int, value []byte) []byte {
	b = appendTag(b, num, wireBytes)
	b = appendVarint(b, uint64(len(value)))
	return append(b, value...)
}

func appendStringField(b []byte, num int, value string) []byte {
	b = appendTag(b, num, wireBytes)
	b = appendVarint(b, uint64(len(value)))
	return append(b, value...)
}

// appendPackedInt64s writes a packed repeated int64 field (as protoc does for proto3): none
// when empty, as protobuf leaves an empty repeated field out.
func appendPackedInt64s(b []byte, num int, values []int64) []byte {
	if len(values) == 0 {
		return b
	}
	size := 0
	for _, v := range values {
		size += varintSize(uint64(v))
	}
	b = appendTag(b, num, wireBytes)
	b = appendVarint(b, uint64(size))
	for _, v := range values {
		b = appendVarint(b, uint64(v))
	}
	return b
}

func varintSize(x uint64) int {
	n := 1
	for x >= 0x80 {
		x >>= 7
		n++
	}
	return n
}

// readInt64s reads a repeated int64 field's value, packed or one element.
func readInt64s(f field, into []int64) ([]int64, error) {
	if f.wire == wireVarint {
		return append(into, int64(f.value)), nil
	}
	if f.wire != wireBytes {
		return nil, errMalformed
	}
	for b := f.bytes; len(b) > 0; {
		v, n := readVarint(b)
		if n == 0 {
			return nil, errMalformed
		}
		into = append(into, int64(v))
		b = b[n:]
	}
	return into, nil
}

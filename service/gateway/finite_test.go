package main

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"
)

// finiteByValue is the definition finite must agree with: every value, one at a time.
func finiteByValue(raw []byte, size int64) bool {
	for i := 0; i+int(size) <= len(raw); i += int(size) {
		if size == 4 && math.IsInf(float64(math.Float32frombits(binary.LittleEndian.Uint32(raw[i:]))), 0) ||
			size == 4 && math.IsNaN(float64(math.Float32frombits(binary.LittleEndian.Uint32(raw[i:])))) ||
			size == 2 && binary.LittleEndian.Uint16(raw[i:])&0x7c00 == 0x7c00 {
			return false
		}
	}
	return true
}

func TestFiniteFindsEveryNonFiniteValueAtEveryPlace(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	// Largest finite values (every exponent bit but one set), NaN, both infinities.
	large32 := []uint32{0x7f7fffff, 0xff7fffff, 0x00000000, 0x80000000}
	bad32 := []uint32{0x7fc00000, 0x7f800001, 0x7f800000, 0xff800000, 0xffffffff}
	large16 := []uint16{0x7bff, 0xfbff, 0x0000, 0x8000}
	bad16 := []uint16{0x7e00, 0x7c01, 0x7c00, 0xfc00, 0xffff}
	for _, size := range []int64{2, 4} {
		for count := 0; count <= 70; count++ { // past two 64-byte turns and a tail, in both sizes
			raw := make([]byte, int64(count)*size)
			for i := 0; i < count; i++ {
				if size == 4 {
					binary.LittleEndian.PutUint32(raw[4*i:], large32[rng.IntN(len(large32))])
				} else {
					binary.LittleEndian.PutUint16(raw[2*i:], large16[rng.IntN(len(large16))])
				}
			}
			if !finite(raw, size) || !finiteByValue(raw, size) {
				t.Fatalf("size %d, %d finite values: read as not finite", size, count)
			}
			for at := 0; at < count; at++ {
				spoiled := append([]byte(nil), raw...)
				if size == 4 {
					binary.LittleEndian.PutUint32(spoiled[4*at:], bad32[rng.IntN(len(bad32))])
				} else {
					binary.LittleEndian.PutUint16(spoiled[2*at:], bad16[rng.IntN(len(bad16))])
				}
				if finite(spoiled, size) || finiteByValue(spoiled, size) {
					t.Fatalf("size %d, %d values, non-finite at %d: read as finite", size, count, at)
				}
			}
		}
	}
}

func TestFiniteAgreesWithTheDefinitionOnRandomBits(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for round := 0; round < 2000; round++ {
		raw := make([]byte, 4*rng.IntN(80))
		for i := range raw {
			raw[i] = byte(rng.Uint32())
		}
		for _, size := range []int64{2, 4} {
			if finite(raw, size) != finiteByValue(raw, size) {
				t.Fatalf("size %d, %x: finite says %v", size, raw, finite(raw, size))
			}
		}
	}
}

func BenchmarkFiniteSeq128(b *testing.B) {
	raw := make([]byte, 128*512*4)
	b.SetBytes(int64(len(raw)))
	for b.Loop() {
		if !finite(raw, 4) {
			b.Fatal("zeros read as not finite")
		}
	}
}

package main

// Client shared memory on the fast path (Triton's system shared-memory extension): a plain
// call may name a registered region for its input and for each output instead of carrying
// bytes. The worker holds the regions (registered through the Python front end), checks each
// reference against its region and reads and writes the bytes; this front end only reads
// the references from the request and names them in the INFER. A reference this front end
// cannot read exactly as the Python front end would makes the call not plain, and Python
// answers it with its error.

import (
	"encoding/json"
	"math"
	"unicode/utf8"
)

// maxRegionNameChars is the longest region name a client may register (Python's
// MAX_REGION_NAME_CHARS).
const maxRegionNameChars = 255

// The V2 tensor parameters that name a region, as Triton spells them.
const (
	paramRegion   = "shared_memory_region"
	paramOffset   = "shared_memory_offset"
	paramByteSize = "shared_memory_byte_size"
)

// Parameters the Python front end accepts and ignores (clients send them as a matter of
// course); any other makes a call not plain.
var toleratedInputParams = map[string]bool{"binary_data_size": true}
var toleratedOutputParams = map[string]bool{"binary_data": true}

// shmRef is byteSize bytes at offset in a registered client region; where names the tensor
// in the worker's error messages, as the Python front end names it.
type shmRef struct {
	region           string
	offset, byteSize int64
	where            string
}

// refParams gathers one tensor's parameters (V2's map<string, InferParameter>).
type refParams struct {
	region                   string
	offset, byteSize         int64
	named, sized, anyShm, ok bool
}

func newRefParams() refParams { return refParams{ok: true} }

// add reads one map entry (key 1, value 2); tolerated names are ignored, others make the
// tensor not plain. The last entry of a name wins, as when protobuf parses a map.
func (rp *refParams) add(f field, tolerated map[string]bool) {
	if f.wire != wireBytes {
		rp.ok = false
		return
	}
	var key string
	var kind int
	var value field
	err := eachField(f.bytes, func(g field) error {
		switch g.num {
		case 1:
			if !stringField(g, &key) {
				rp.ok = false
			}
		case 2:
			// Every value given is parsed (and merged) by protobuf: each must be valid.
			valid := false
			if g.wire == wireBytes {
				kind, value, valid = parameterValue(g.bytes)
			}
			rp.ok = rp.ok && valid
		default: // protobuf keeps such an entry out of the map
			rp.ok = false
		}
		return nil
	})
	if err != nil {
		rp.ok = false
		return
	}
	switch key {
	case paramRegion:
		rp.anyShm = true
		rp.named = kind == paramString
		rp.region = string(value.bytes)
	case paramOffset, paramByteSize:
		rp.anyShm = true
		count, valid := byteCount(kind, value)
		if key == paramOffset {
			rp.offset = count
			rp.ok = rp.ok && valid
		} else {
			rp.byteSize, rp.sized = count, valid
		}
	default:
		rp.ok = rp.ok && tolerated[key]
	}
}

// ref is the tensor's region reference (nil: none), and whether the parameters are plain.
func (rp *refParams) ref(where string) (*shmRef, bool) {
	if !rp.ok {
		return nil, false
	}
	if !rp.anyShm {
		return nil, true
	}
	if !rp.named || !rp.sized || !registrable(rp.region) {
		return nil, false
	}
	return &shmRef{region: rp.region, offset: rp.offset, byteSize: rp.byteSize, where: where}, true
}

// InferParameter's oneof: bool 1, int64 2, string 3, double 4, uint64 5.
const (
	paramInt64  = 2
	paramString = 3
	paramUint64 = 5
)

// parameterWires are the wire types of InferParameter's oneof fields; a field of another
// wire type is an unknown field to protobuf, skipped.
var parameterWires = map[int]int{1: wireVarint, paramInt64: wireVarint, paramString: wireBytes,
	4: wireFixed64, paramUint64: wireVarint}

// parameterValue is an InferParameter's choice: the last of its oneof fields, as protobuf
// reads a oneof; valid is whether protobuf would parse it at all (well formed, every string
// field valid UTF-8: one that is not fails the whole request).
func parameterValue(msg []byte) (kind int, value field, valid bool) {
	valid = true
	err := eachField(msg, func(f field) error {
		if wire, known := parameterWires[f.num]; known && f.wire == wire {
			kind, value = f.num, f
			valid = valid && (f.num != paramString || utf8.Valid(f.bytes))
		}
		return nil
	})
	return kind, value, err == nil && valid
}

// byteCount reads a byte count as the Python front end does: an int64 or uint64 choice, not
// negative (and, here, within int64).
func byteCount(kind int, v field) (int64, bool) {
	if (kind != paramInt64 && kind != paramUint64) || v.value > math.MaxInt64 {
		return 0, false
	}
	return int64(v.value), true
}

// attendRef reads an attention.v1 SharedMemoryRef (region 1, offset 2, byte_size 3).
func attendRef(f field, where string) (*shmRef, bool) {
	if f.wire != wireBytes {
		return nil, false
	}
	ref, plain := &shmRef{where: where}, true
	err := eachField(f.bytes, func(g field) error {
		switch g.num {
		case 1:
			plain = stringField(g, &ref.region) && plain
		case 2, 3:
			plain = plain && g.wire == wireVarint && g.value <= math.MaxInt64
			if g.num == 2 {
				ref.offset = int64(g.value)
			} else {
				ref.byteSize = int64(g.value)
			}
		}
		return nil
	})
	return ref, err == nil && plain && registrable(ref.region)
}

// registrable is whether a region of this name can exist: a longer name is refused by
// Python (its INFER would carry a name no region has, however long).
func registrable(name string) bool { return utf8.RuneCountInString(name) <= maxRegionNameChars }

// refJSON is a reference as the INFER carries it: region, offset, byte size, where, dtype.
func (r *shmRef) refJSON(dtype string) []any {
	return []any{r.region, r.offset, r.byteSize, r.where, dtype}
}

// inferRefsMessage is the INFER of a call with a tensor in a client's region: JSON, as the
// Python front end sends it (the packed layout has no room for references).
func inferRefsMessage(id uint64, p *plan, at [3]int64, deadline float64, trace *callTrace) []byte {
	message := map[string]any{
		"t": "infer", "id": id, "model": p.model.Key, "w": p.weights,
		"shape": p.shape[:], "dtype": p.dtype.numpy,
	}
	for i, key := range [3]string{"in", "out", "wout"} {
		if at[i] >= 0 {
			message[key] = at[i]
		}
	}
	if !math.IsNaN(deadline) {
		message["deadline"] = deadline
	}
	if p.inRef != nil {
		message["iref"] = p.inRef.refJSON(p.dtype.numpy)
	}
	if p.outRef != nil {
		message["oref"] = p.outRef.refJSON(p.dtype.numpy)
	}
	if p.wRef != nil {
		message["wref"] = p.wRef.refJSON("<f4")
	}
	if trace != nil {
		message["tag"] = trace.tagJSON()
	}
	body, _ := json.Marshal(message) // strings are valid UTF-8, numbers finite
	return body
}

// appendRefParameters writes an output's parameters naming its region, as Triton answers
// (map entries: key 1, InferParameter 2).
func appendRefParameters(b []byte, num int, r *shmRef) []byte {
	entry := func(key string, value []byte) {
		var e []byte
		e = appendStringField(e, 1, key)
		e = appendBytesField(e, 2, value)
		b = appendBytesField(b, num, e)
	}
	entry(paramRegion, appendStringField(nil, paramString, r.region))
	// A oneof's choice is written even when zero.
	entry(paramOffset, appendVarint(appendTag(nil, paramInt64, wireVarint), uint64(r.offset)))
	entry(paramByteSize, appendVarint(appendTag(nil, paramInt64, wireVarint), uint64(r.byteSize)))
	return b
}

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

// add reads one map entry; tolerated names are ignored, others make the tensor not plain. The last entry of a name wins, as when protobuf parses a map.
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
		case fieldParametersEntryKey:
			if !stringField(g, &key) {
				rp.ok = false
			}
		case fieldParametersEntryValue:
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
		rp.named = kind == fieldInferParameterStringParam
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

// parameterWires are the wire types of InferParameter's oneof fields (bool, int64, string,
// double, uint64); a field of another wire type is an unknown field to protobuf, skipped.
var parameterWires = map[int]int{
	fieldInferParameterBoolParam:   wireVarint,
	fieldInferParameterInt64Param:  wireVarint,
	fieldInferParameterStringParam: wireBytes,
	fieldInferParameterDoubleParam: wireFixed64,
	fieldInferParameterUint64Param: wireVarint,
}

// parameterValue is an InferParameter's choice: the last of its oneof fields, as protobuf
// reads a oneof; valid is whether protobuf would parse it at all (well formed, every string
// field valid UTF-8: one that is not fails the whole request).
func parameterValue(msg []byte) (kind int, value field, valid bool) {
	valid = true
	err := eachField(msg, func(f field) error {
		if wire, known := parameterWires[f.num]; known && f.wire == wire {
			kind, value = f.num, f
			valid = valid && (f.num != fieldInferParameterStringParam || utf8.Valid(f.bytes))
		}
		return nil
	})
	return kind, value, err == nil && valid
}

// byteCount reads a byte count as the Python front end does: an int64 or uint64 choice, not
// negative (and, here, within int64).
func byteCount(kind int, v field) (int64, bool) {
	if (kind != fieldInferParameterInt64Param && kind != fieldInferParameterUint64Param) || v.value > math.MaxInt64 {
		return 0, false
	}
	return int64(v.value), true
}

// attendRef reads an attention.v1 SharedMemoryRef.
func attendRef(f field, where string) (*shmRef, bool) {
	if f.wire != wireBytes {
		return nil, false
	}
	ref, plain := &shmRef{where: where}, true
	err := eachField(f.bytes, func(g field) error {
		switch g.num {
		case fieldSharedMemoryRefRegion:
			plain = stringField(g, &ref.region) && plain
		case fieldSharedMemoryRefOffset, fieldSharedMemoryRefByteSize:
			plain = plain && g.wire == wireVarint && g.value <= math.MaxInt64
			if g.num == fieldSharedMemoryRefOffset {
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
		keyType: messageInfer, keyID: id, keyModel: p.model.Key, keyWithWeights: p.weights,
		keyShape: p.shape[:], keyDtype: p.dtype.numpy,
	}
	for i, key := range [3]string{keyInputOffset, keyOutputOffset, keyWeightsOffset} {
		if at[i] >= 0 {
			message[key] = at[i]
		}
	}
	if !math.IsNaN(deadline) {
		message[keyDeadline] = deadline
	}
	if p.inRef != nil {
		message[keyInputRef] = p.inRef.refJSON(p.dtype.numpy)
	}
	if p.outRef != nil {
		message[keyOutputRef] = p.outRef.refJSON(p.dtype.numpy)
	}
	if p.wRef != nil {
		message[keyWeightsRef] = p.wRef.refJSON(weightsNumpy)
	}
	if trace != nil {
		message[keyTag] = trace.tagJSON()
	}
	body, _ := json.Marshal(message) // strings are valid UTF-8, numbers finite
	return body
}

// appendRefParameters writes an output's parameters naming its region, as Triton answers.
func appendRefParameters(b []byte, num int, r *shmRef) []byte {
	entry := func(key string, value []byte) {
		var e []byte
		e = appendStringField(e, fieldParametersEntryKey, key)
		e = appendBytesField(e, fieldParametersEntryValue, value)
		b = appendBytesField(b, num, e)
	}
	// A oneof's choice is written even when zero.
	int64Param := func(v int64) []byte {
		return appendVarint(appendTag(nil, fieldInferParameterInt64Param, wireVarint), uint64(v))
	}
	// In the order of their names, as protobuf writes a map deterministically (and as the
	// Python front end writes these).
	entry(paramByteSize, int64Param(r.byteSize))
	entry(paramOffset, int64Param(r.offset))
	entry(paramRegion, appendStringField(nil, fieldInferParameterStringParam, r.region))
	return b
}

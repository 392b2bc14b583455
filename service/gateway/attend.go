package main

// attention.v1 Attend on the fast path: a plain AttendRequest (a served model, the
// embeddings' bytes in the message or in a client's shared-memory region, in the model's
// dtype, [seq, d] or [n, seq, d], finite) goes through the same plan and worker call as a plain V2
// ModelInfer, and its AttendResponse is framed here from shared memory. Anything else goes
// to the Python front end, which answers it as always.

import (
	"math"
	"strconv"
)

// regionOutputs are the outputs AttendRequest's output region fields are for.
var regionOutputs = map[int]string{
	fieldAttendRequestOutputRegion:           outputName,
	fieldAttendRequestAttentionWeightsRegion: weightsName,
}

// parseAttend reads an AttendRequest into the plan's terms; nil when it is not plain.
func parseAttend(msg []byte) *inferRequest {
	req := &inferRequest{api: apiAttention, datatype: attentionDatatype(dataTypeUnspecified)}
	plain, embeddings := true, 0
	err := eachField(msg, func(f field) error {
		switch f.num {
		case fieldAttendRequestModel:
			plain = stringField(f, &req.modelName) && plain
		case fieldAttendRequestModelVersion:
			plain = stringField(f, &req.modelVersion) && plain
		case fieldAttendRequestRequestID:
			plain = stringField(f, &req.id) && plain
		case fieldAttendRequestEmbeddings:
			embeddings++
			plain = plain && f.wire == wireBytes && req.parseTensor(f.bytes)
		case fieldAttendRequestReturnAttentionWeights:
			plain = plain && f.wire == wireVarint
			req.weights = f.value != 0
		case fieldAttendRequestEmbeddingsRegion, fieldAttendRequestOutputRegion,
			fieldAttendRequestAttentionWeightsRegion: // client shared memory
			ref, ok := attendRef(f, regionFields[f.num])
			plain = plain && ok
			if f.num == fieldAttendRequestEmbeddingsRegion {
				plain = plain && req.inRef == nil // given twice: protobuf merges, Python answers
				req.inRef = ref
			} else {
				if req.outRefs == nil {
					req.outRefs = map[string]*shmRef{}
				}
				plain = plain && req.outRefs[regionOutputs[f.num]] == nil // likewise
				req.outRefs[regionOutputs[f.num]] = ref
			}
		}
		return nil
	})
	// The embeddings' bytes in the message or in a region, not both (Python says so).
	if err != nil || !plain || embeddings != 1 || (req.inRef != nil && len(req.raw) > 0) {
		return nil
	}
	switch len(req.shape) {
	case 2: // [seq, d], answered as [seq, d]
		req.shape = append([]int64{1}, req.shape...)
		req.flat = true
	case 3:
	default:
		return nil
	}
	req.outputs = []string{outputName}
	if req.weights {
		req.outputs = append(req.outputs, weightsName)
	}
	return req
}

func (req *inferRequest) parseTensor(msg []byte) bool {
	plain := true
	err := eachField(msg, func(f field) error {
		var err error
		switch f.num {
		case fieldTensorShape:
			req.shape, err = readInt64s(f, req.shape)
		case fieldTensorDtype: // a DataType; unspecified reads as FLOAT32
			req.datatype = attentionDatatype(f.value)
			plain = plain && f.wire == wireVarint && req.datatype != ""
		case fieldTensorData:
			plain = plain && f.wire == wireBytes
			req.raw = f.bytes
		}
		return err
	})
	return err == nil && plain
}

// attendResponse is the AttendResponse, its tensors' bytes referenced in shared memory: the
// tensors, then the other fields, in field-number order as protobuf writes the whole message
// (and as the Python front end writes it: tests/golden/grpc/).
func attendResponse(req *inferRequest, p *plan, answers answerTensors, a answer) [][]byte {
	m := newMessage()
	n, seq, d := p.shape[0], p.shape[1], p.shape[2]
	outShape, wShape := []int64{n, seq, d}, []int64{n, p.model.NumHeads, seq, seq}
	if req.flat {
		outShape, wShape = outShape[1:], wShape[1:]
	}
	outType := uint64(dataTypeFloat32)
	if p.dtype.size == 2 {
		outType = dataTypeFloat16
	}
	tensor(m, fieldAttendResponseOutput, outShape, outType, answers.out)
	if p.weights {
		tensor(m, fieldAttendResponseAttentionWeights, wShape, dataTypeFloat32, answers.weights)
	}
	m.built = appendStringField(m.built, fieldAttendResponseModel, p.model.Name)
	m.built = appendStringField(m.built, fieldAttendResponseModelVersion, strconv.FormatInt(p.model.Version, 10))
	m.built = appendNonEmpty(m.built, fieldAttendResponseRequestID, req.id)
	var timing []byte
	timing = appendVarintField(timing, fieldServerTimingQueueUs, uint64(int64(math.RoundToEven(a.queueS*1e6))))
	timing = appendVarintField(timing, fieldServerTimingComputeUs, uint64(int64(math.RoundToEven(a.computeS*1e6))))
	timing = appendVarintField(timing, fieldServerTimingBatchSize, uint64(a.batch))
	m.built = appendBytesField(m.built, fieldAttendResponseTiming, timing)
	return m.finish()
}

// tensor adds an attention.v1 Tensor as field num: shape, dtype, then data referenced;
// no data (nil) for one written into a client's region.
func tensor(m *message, num int, shape []int64, dtype uint64, data []byte) {
	var head []byte
	head = appendPackedInt64s(head, fieldTensorShape, shape)
	head = appendVarintField(head, fieldTensorDtype, dtype)
	if data == nil {
		m.built = appendBytesField(m.built, num, head)
		return
	}
	m.built = appendTag(m.built, num, wireBytes)
	dataTag := varintSize(fieldTensorData<<3 | wireBytes)
	m.built = appendVarint(m.built, uint64(len(head)+dataTag+varintSize(uint64(len(data)))+len(data)))
	m.built = append(m.built, head...)
	m.bytesField(fieldTensorData, data)
}

// appendVarintField writes a varint field, left out when zero (proto3's default).
func appendVarintField(b []byte, num int, value uint64) []byte {
	if value == 0 {
		return b
	}
	return appendVarint(appendTag(b, num, wireVarint), value)
}

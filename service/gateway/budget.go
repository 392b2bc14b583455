package main

// The undelivered-answers bound: answers computed but not yet read by their clients hold
// memory here until written, so their bytes are reserved before computing, per server and
// per connection (--max-undelivered-bytes, --max-undelivered-bytes-per-connection, this
// front end's share), as the Python front end does.

import "sync"

type answerBudget struct {
	maxBytes, maxPerConnection int64
	metrics                    *metrics // nil: not reported
	mu                         sync.Mutex
	total                      int64
	byConnection               map[string]int64
}

type reservation struct {
	budget *answerBudget
	peer   string
	bytes  int64
}

func newAnswerBudget(maxBytes, maxPerConnection int64, m *metrics) *answerBudget {
	return &answerBudget{maxBytes: maxBytes, maxPerConnection: maxPerConnection,
		byConnection: map[string]int64{}, metrics: m}
}

// reserve holds nbytes for peer's answer, or returns why not (RESOURCE_EXHAUSTED).
func (b *answerBudget) reserve(peer string, nbytes int64) (*reservation, string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.total > 0 && b.total+nbytes > b.maxBytes {
		b.metrics.refused(scopeServer)
		return nil, answersBackloggedByServer(b.total, nbytes, b.maxBytes)
	}
	held := b.byConnection[peer]
	if held > 0 && held+nbytes > b.maxPerConnection {
		b.metrics.refused(scopeConnection)
		return nil, answersBackloggedByConnection(held, nbytes, b.maxPerConnection)
	}
	b.total += nbytes
	b.byConnection[peer] = held + nbytes
	b.metrics.undelivered(float64(nbytes))
	return &reservation{budget: b, peer: peer, bytes: nbytes}, ""
}

func (r *reservation) release() {
	b := r.budget
	b.mu.Lock()
	defer b.mu.Unlock()
	b.total -= r.bytes
	b.metrics.undelivered(-float64(r.bytes))
	if left := b.byConnection[r.peer] - r.bytes; left > 0 {
		b.byConnection[r.peer] = left
	} else {
		delete(b.byConnection, r.peer)
	}
}

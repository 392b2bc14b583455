package main

// The gateway's series in prometheus-client's multiprocess files (mmap_dict.py's layout),
// so the supervisor's /metrics sums them with every Python process's: a 4-byte used size,
// 4 bytes of padding, then entries of a 4-byte key length, the JSON key padded to 8 bytes,
// a float64 value and a float64 timestamp, in files named by their kind (frontend_gen.go)
// and process; tests/golden/metrics/ holds prometheus-client's own files, which
// metrics_golden_test.go writes byte for byte. Names, help texts and buckets come from the
// Python front end (service/observability/metrics.py is their one definition).

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sync"
	"syscall"
)

type mmapFile struct {
	file      *os.File
	mem       []byte
	used      int
	positions map[string]int
}

func openMmapFile(path string) (*mmapFile, error) {
	file, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, err
	}
	m := &mmapFile{file: file, used: 8, positions: map[string]int{}}
	if err := m.resize(1 << 16); err != nil {
		file.Close()
		return nil, err
	}
	binary.LittleEndian.PutUint32(m.mem, uint32(m.used))
	return m, nil
}

func (m *mmapFile) resize(size int) error {
	if err := m.file.Truncate(int64(size)); err != nil {
		return err
	}
	if m.mem != nil {
		syscall.Munmap(m.mem)
	}
	mem, err := syscall.Mmap(int(m.file.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return err
	}
	m.mem = mem
	return nil
}

// add adds delta to key's value, writing the entry first when it is new; readers see an
// entry only once the used size covers it.
func (m *mmapFile) add(key string, delta float64) {
	pos, ok := m.positions[key]
	if !ok {
		padded := len(key) + (8 - (len(key)+4)%8)
		size := 4 + padded + 16
		for m.used+size > len(m.mem) {
			if err := m.resize(2 * len(m.mem)); err != nil {
				return // metrics are best effort; serving goes on
			}
		}
		entry := m.mem[m.used : m.used+size]
		binary.LittleEndian.PutUint32(entry, uint32(len(key)))
		copy(entry[4:], key)
		for i := 4 + len(key); i < 4+padded; i++ {
			entry[i] = ' '
		}
		pos = m.used + 4 + padded
		m.used += size
		binary.LittleEndian.PutUint32(m.mem, uint32(m.used))
		m.positions[key] = pos
	}
	value := math.Float64frombits(binary.LittleEndian.Uint64(m.mem[pos:]))
	binary.LittleEndian.PutUint64(m.mem[pos:], math.Float64bits(value+delta))
}

type metrics struct {
	spec                       metricsSpec
	mu                         sync.Mutex
	counters, histograms, live *mmapFile
	keys                       map[string]string // built once: JSON encoding is costly per call
}

// cached is the key named by id, built by make the first time.
func (m *metrics) cached(id string, make func() string) string {
	k, ok := m.keys[id]
	if !ok {
		k = make()
		m.keys[id] = k
	}
	return k
}

func openMetrics(dir string, spec metricsSpec) (*metrics, error) {
	m := &metrics{spec: spec, keys: map[string]string{}}
	if dir == "" {
		return m, nil // not in a supervised server: nothing to report to
	}
	pid := os.Getpid()
	var err error
	for _, f := range []struct {
		into   **mmapFile
		prefix string
	}{{&m.counters, counterFile}, {&m.histograms, histogramFile}, {&m.live, liveGaugeFile}} {
		if *f.into, err = openMmapFile(filepath.Join(dir, fmt.Sprintf("%s_%d.db", f.prefix, pid))); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func key(family, sample string, labels map[string]string, help string) string {
	encoded, _ := json.Marshal([]any{family, sample, labels, help})
	return string(encoded)
}

// finished counts one RPC of model on api (apiV2, apiAttention, ...) with its status code
// and server time.
func (m *metrics) finished(model, api string, code int, seconds float64) {
	if m.counters == nil {
		return
	}
	s, d := m.spec, m.spec.Duration
	bucket := len(d.Bounds) - 1
	for i, bound := range d.Bounds {
		if seconds <= bound {
			bucket = i
			break
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.counters.add(m.cached("r\x00"+api+"\x00"+model+"\x00"+codeNames[code], func() string {
		return key(s.Requests.Family, s.Requests.Sample,
			map[string]string{labelModel: model, labelAPI: api, labelCode: codeNames[code]}, s.Requests.Help)
	}), 1)
	sum := "s\x00" + api + "\x00" + model
	if _, seen := m.keys[sum]; !seen {
		// Every bucket of a new series, +Inf included, as prometheus-client writes them: the
		// merged exposition has only the buckets some process wrote, and a histogram whose
		// +Inf bucket is missing has no quantiles.
		for i := range d.Labels {
			m.histograms.add(m.bucketKey(model, api, i), 0)
		}
	}
	m.histograms.add(m.cached(sum, func() string {
		return key(d.Family, d.Family+"_sum", map[string]string{labelModel: model, labelAPI: api}, d.Help)
	}), seconds)
	m.histograms.add(m.bucketKey(model, api, bucket), 1)
}

// bucketKey is the request-duration bucket i of (model, api).
func (m *metrics) bucketKey(model, api string, i int) string {
	d := m.spec.Duration
	return m.cached("b\x00"+api+"\x00"+model+"\x00"+d.Labels[i], func() string {
		return key(d.Family, d.Family+"_bucket",
			map[string]string{labelModel: model, labelAPI: api, labelLe: d.Labels[i]}, d.Help)
	})
}

func (m *metrics) inFlight(api string, delta float64) {
	m.addLive("f\x00"+api, m.spec.InFlight, map[string]string{labelAPI: api}, delta)
}

// undelivered adds to the bytes of answers held for clients that have not read them.
func (m *metrics) undelivered(delta float64) {
	m.addLive("u", m.spec.Undelivered, map[string]string{}, delta)
}

// refused counts a call refused for the undelivered answers' bound (scope: server |
// connection).
func (m *metrics) refused(scope string) {
	if m == nil || m.counters == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	r := m.spec.UndeliveredRefusals
	m.counters.add(m.cached("x\x00"+scope, func() string {
		return key(r.Family, r.Sample, map[string]string{labelScope: scope}, r.Help)
	}), 1)
}

// addLive adds delta to a gauge summed over live processes.
func (m *metrics) addLive(id string, g metricSpec, labels map[string]string, delta float64) {
	if m == nil || m.live == nil || delta == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.live.add(m.cached(id, func() string { return key(g.Family, g.Sample, labels, g.Help) }), delta)
}

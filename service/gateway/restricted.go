package main

// --restricted-api for the calls answered here: a call of a restricted API group needs its
// header with the key, as the Python front end's check (service/frontend/restricted.py)
// asks; the calls handed to Python it checks itself. What is restricted, the keys and the
// refusals' words come from the Python front end through an inherited file descriptor
// (never the command line, never the environment): restrictedFDVariable names it.
//
// The check is Python's, byte for byte: the header's last value counts (gRPC Python keeps
// the last of several); a value that is not UTF-8 is read as Latin-1, as gRPC Python
// decodes it; the comparison takes constant time; a refusal is PERMISSION_DENIED with
// Python's message (the header named, never the value) and counted in Python's series.

import (
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/textproto"
	"os"
	"unicode/utf8"
)

// restrictions is what Restrictions.for_gateway writes (restrictionsJSON, generated), read
// from the descriptor restrictedFDVariable names (unset: nothing is restricted).
type restrictions struct {
	restrictionsJSON
	metrics *metrics // counts refusals; nil: not counted
}

// loadRestrictions reads and closes the descriptor restrictedFDVariable names (nil, nil
// when it names none), and checks that every method answered here has its key.
func loadRestrictions() (*restrictions, error) {
	fd, named, err := inheritedFD(restrictedFDVariable)
	if !named {
		return nil, err
	}
	file := os.NewFile(uintptr(fd), "restrictions")
	data, err := io.ReadAll(file)
	file.Close()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", restrictedFDVariable, err)
	}
	return parseRestrictions(data, answeredHere())
}

// answeredHere are the methods the fast path answers (when a call is plain).
func answeredHere() []string {
	var paths []string
	for path := range fastMethods {
		paths = append(paths, path)
	}
	for path := range streamMethods {
		paths = append(paths, path)
	}
	for path := range healthMethods {
		paths = append(paths, path)
	}
	return paths
}

func parseRestrictions(data []byte, answeredHere []string) (*restrictions, error) {
	var rs restrictions
	if err := json.Unmarshal(data, &rs); err != nil {
		// Never the content in the error: it holds keys.
		return nil, fmt.Errorf("the restrictions are not the JSON expected (%d bytes)", len(data))
	}
	for _, path := range answeredHere {
		if group, restricted := rs.Methods[path]; restricted && rs.Keys[group] == nil {
			return nil, fmt.Errorf("%s is in the restricted group %q, but no key for it came", path, group)
		}
	}
	for group, key := range rs.Keys {
		if key == nil || key.Header == "" || key.Value == "" || key.Without == "" || key.Wrong == "" {
			return nil, fmt.Errorf("the key of the restricted group %q is incomplete", group)
		}
	}
	return &rs, nil
}

// admit reports whether a call to be answered here may be: its group is not restricted, or
// it carries the key. When not, it has answered the call PERMISSION_DENIED and counted it.
func (rs *restrictions) admit(w http.ResponseWriter, r *http.Request) bool {
	if rs == nil {
		return true
	}
	group, restricted := rs.Methods[r.RequestURI]
	key := rs.Keys[group] // present for every method answered here (parseRestrictions)
	if !restricted || key == nil {
		return true // not restricted, or not answered here: Python checks it
	}
	values := r.Header.Values(textproto.CanonicalMIMEHeaderKey(key.Header))
	if len(values) > 0 && keyMatches(values[len(values)-1], key.Value) {
		return true
	}
	message := key.Without
	if len(values) > 0 {
		message = key.Wrong
	}
	rs.metrics.restrictedDenial(group)
	writeStatus(w, codePermissionDenied, message)
	return false
}

// keyMatches compares a header's value with a key in constant time (how much of a guess
// matched must not show in the answer's timing), reading the value as gRPC Python does:
// UTF-8, or Latin-1 when it is not UTF-8.
func keyMatches(sent, key string) bool {
	if !utf8.ValidString(sent) {
		latin1 := make([]byte, 0, 2*len(sent))
		for i := 0; i < len(sent); i++ {
			latin1 = utf8.AppendRune(latin1, rune(sent[i]))
		}
		sent = string(latin1)
	}
	return subtle.ConstantTimeCompare([]byte(sent), []byte(key)) == 1
}

// restrictedDenial counts a call refused for its group's key, in the series the Python
// front end counts its refusals in.
func (m *metrics) restrictedDenial(group string) {
	if m == nil || m.counters == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	d := m.spec.RestrictedDenials
	m.counters.add(m.cached("p\x00"+group, func() string {
		return key(d.Family, d.Sample, map[string]string{labelGroup: group}, d.Help)
	}), 1)
}

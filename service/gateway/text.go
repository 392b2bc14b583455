package main

// A client's string made safe to echo in a status message or a log line, as the Python front
// end shows it (service/text.py): quoted, characters that are not printable escaped, cut short.

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"unicode"
	"unicode/utf8"
)

// shown is text (valid UTF-8) as service/text.py's shown() writes it: quoted; a quote, a
// backslash and every character Python does not print (Go's unicode.IsPrint is Python's
// str.isprintable) escaped as Python's unicode_escape writes them; cut after shownChars
// characters, the rest counted.
func shown(text string) string {
	var b strings.Builder
	b.WriteByte('\'')
	kept := 0
	for _, r := range text {
		if kept == shownChars {
			break
		}
		kept++
		switch {
		case r == '\'':
			b.WriteString(`\'`)
		case r == '\\':
			b.WriteString(`\\`)
		case unicode.IsPrint(r):
			b.WriteRune(r)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r < 0x100:
			fmt.Fprintf(&b, `\x%02x`, r)
		case r < 0x10000:
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			fmt.Fprintf(&b, `\U%08x`, r)
		}
	}
	b.WriteByte('\'')
	if more := utf8.RuneCountInString(text) - kept; more > 0 {
		b.WriteString(shownMore(more))
	}
	return b.String()
}

// internalFailure is the status message of a call that failed unexpectedly (the worker's
// error of a kind no status maps), as the Python front end words it: a request id, which
// the log line has too, and nothing of what went wrong.
func internalFailure(req *inferRequest, what string) string {
	id := req.id
	if id == "" { // a new one, as Python's uuid4().hex[:12]
		id = fmt.Sprintf("%012x", rand.Uint64()>>16)
	}
	logged := shown(id)
	slog.Error(fmt.Sprintf("internal error in %s request_id=%s: %s", req.api, logged, shown(what)))
	return internalError(logged)
}

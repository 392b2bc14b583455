package main

// Everything the fast path does not answer goes, as it came, to this front end's Python
// process over a Unix socket (HTTP/2 without TLS): the other RPCs, both streaming calls,
// health, reflection, and ModelInfer calls that are not plain.

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
)

const (
	proxyStreamWindow     = 64 << 10
	proxyConnectionWindow = 64 << 20
)

// grpcPeer writes a client address as gRPC does: "ipv4:10.0.0.7:51234", "ipv6:[::1]:51234".
func grpcPeer(remote string) string {
	host, _, err := net.SplitHostPort(remote)
	if err != nil {
		return remote
	}
	if strings.Contains(host, ":") {
		return "ipv6:" + remote
	}
	return "ipv4:" + remote
}

// newBackend is the HTTP/2 transport to this front end's Python process.
func newBackend(socketPath string, maxResponseHeaderBytes int64) *http.Transport {
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	return &http.Transport{
		Protocols: &protocols,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var dialer net.Dialer
			return dialer.DialContext(ctx, "unix", socketPath)
		},
		DisableCompression:     true,
		MaxResponseHeaderBytes: maxResponseHeaderBytes,
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams: 1 << 16,
			// What an answer may leave here when its client does not read: the Python front
			// end holds the rest, counted in its undelivered-answers budget. Without this bound,
			// HTTP/2's default windows would buffer megabytes per stalled call here.
			MaxReceiveBufferPerStream:     proxyStreamWindow,
			MaxReceiveBufferPerConnection: proxyConnectionWindow,
			// No HPACK dynamic table towards Python: every call shares this connection,
			// and a header that gRPC core's decoder refuses without indexing it would
			// leave the two tables out of step, failing every later call (seen with a
			// malformed grpc-timeout). Headers on a local socket need no compression.
			MaxEncoderHeaderTableSize: 1,
		},
	}
}

var backendURL = &url.URL{Scheme: "http", Host: "frontend"}

// tellCaller sets who called on a request to the Python front end, for its per-connection
// bounds and its logs (service/frontend/caller.py); never what a client claims.
func tellCaller(out http.Header, in *http.Request) {
	out.Del(peerHeader)
	out.Del(subjectHeader)
	out.Del(streamPartHeader)
	out.Set(peerHeader, grpcPeer(in.RemoteAddr))
	if in.TLS != nil && len(in.TLS.PeerCertificates) > 0 {
		out.Set(subjectHeader, in.TLS.PeerCertificates[0].Subject.String())
	}
}

func newProxy(transport *http.Transport) *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(backendURL)
			r.Out.Host = r.In.Host
			tellCaller(r.Out.Header, r.In)
		},
		Transport:      transport,
		ModifyResponse: trailersOnlyToTrailers,
		FlushInterval:  -1, // streams: every message at once
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				return // the client went away; nothing to answer
			}
			var dial *net.OpError
			if errors.As(err, &dial) && dial.Op == "dial" {
				writeStatus(w, codeUnavailable, backendGone) // Python is restarting
				return
			}
			// Python reset the call (or refused it): reset the client's call as Python
			// would have, rather than ask it to retry what will fail again.
			panic(http.ErrAbortHandler)
		},
	}
}

// trailersOnlyToTrailers turns a trailers-only answer (the status in the one HEADERS frame
// that ends the stream, as an error usually comes) into headers plus trailers: forwarded
// as it was, its headers could leave before the handler ends, and the stream would then
// end with an empty DATA frame and no status at all. The status becomes the answer's
// trailers once its (empty) body has been read: known before, ReverseProxy would announce
// them in a "Trailer" header, which gRPC's servers never send (clients see it as metadata).
func trailersOnlyToTrailers(r *http.Response) error {
	status := r.Header.Values("Grpc-Status")
	if len(status) == 0 {
		return nil
	}
	trailer := http.Header{}
	for _, name := range []string{"Grpc-Status", "Grpc-Message", "Grpc-Status-Details-Bin"} {
		if values := r.Header.Values(name); len(values) > 0 {
			trailer[name] = values
			r.Header.Del(name)
		}
	}
	r.Body = &trailersAtEnd{ReadCloser: r.Body, response: r, trailer: trailer}
	return nil
}

// trailersAtEnd is a body that gives its response trailers when it ends.
type trailersAtEnd struct {
	io.ReadCloser
	response *http.Response
	trailer  http.Header // nil once given
}

func (b *trailersAtEnd) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if errors.Is(err, io.EOF) && b.trailer != nil {
		if b.response.Trailer == nil {
			b.response.Trailer = http.Header{}
		}
		for name, values := range b.trailer {
			b.response.Trailer[name] = values
		}
		b.trailer = nil
	}
	return n, err
}

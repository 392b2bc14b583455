package main

// Everything the fast path does not answer goes, as it came, to this front end's Python
// process over a Unix socket (HTTP/2 without TLS): the other RPCs, both streaming calls,
// health, reflection, and ModelInfer calls that are not plain.

import (
	"context"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
)

const backendGone = "this front end's protocol process is restarting; retry"

func newProxy(socketPath string, maxResponseHeaderBytes int64) *httputil.ReverseProxy {
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	transport := &http.Transport{
		Protocols: &protocols,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var dialer net.Dialer
			return dialer.DialContext(ctx, "unix", socketPath)
		},
		DisableCompression:     true,
		MaxResponseHeaderBytes: maxResponseHeaderBytes,
		HTTP2:                  &http.HTTP2Config{MaxConcurrentStreams: 1 << 16},
	}
	target := &url.URL{Scheme: "http", Host: "frontend"}
	return &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(target)
			r.Out.Host = r.In.Host
		},
		Transport:     transport,
		FlushInterval: -1, // streams: every message at once
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				return // the client went away; nothing to answer
			}
			writeStatus(w, codeUnavailable, backendGone)
		},
	}
}

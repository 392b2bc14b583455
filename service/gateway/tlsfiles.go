package main

// TLS from files that may be replaced under the server (a Kubernetes Secret rotated, a
// certificate renewed): each new connection is served the certificate, key and client CA
// the files hold then, as Python's front end serves them (service/transport/tls.py), so the
// two ports never disagree. A change is seen by the files' modification time, size and
// inode, not by a newer time alone (a copy that keeps an older time is a change too).

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log"
	"os"
	"sync"
	"syscall"
)

type tlsFiles struct {
	cert, key, clientCA string // clientCA "": no client certificates asked for
	mu                  sync.Mutex
	config              *tls.Config // in force; nil until the first good load
	stamp               string      // of the files last looked at, loaded or refused
	reloads             int
}

// tlsConfig is the listener's configuration: each handshake takes the files' current one.
func tlsConfig(o options) (*tls.Config, error) {
	files := &tlsFiles{cert: o.tlsCert, key: o.tlsKey, clientCA: o.tlsClientCA}
	if _, err := files.forConnection(nil); err != nil {
		return nil, err
	}
	return &tls.Config{
		GetConfigForClient: files.forConnection,
		MinVersion:         tls.VersionTLS12,
		NextProtos:         []string{"h2"},
	}, nil
}

func (f *tlsFiles) forConnection(*tls.ClientHelloInfo) (*tls.Config, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	stamp := f.stampNow()
	if f.config != nil && stamp == f.stamp {
		return f.config, nil
	}
	config, err := f.load()
	if err != nil {
		if f.config != nil { // mid-renewal, or a broken pair: the last good one stays
			if stamp != f.stamp {
				log.Printf("TLS files changed but cannot be used (%v); keeping the current "+
					"certificate until they are fixed", err)
			}
			f.stamp = stamp
			return f.config, nil
		}
		return nil, err
	}
	if f.config != nil {
		f.reloads++
		log.Printf("TLS certificate reloaded from %s (reload %d)", f.cert, f.reloads)
	}
	f.config, f.stamp = config, stamp
	return config, nil
}

func (f *tlsFiles) load() (*tls.Config, error) {
	pair, err := tls.LoadX509KeyPair(f.cert, f.key)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate %s / key %s: %w", f.cert, f.key, err)
	}
	config := &tls.Config{
		Certificates: []tls.Certificate{pair},
		MinVersion:   tls.VersionTLS12,
		NextProtos:   []string{"h2"},
	}
	if f.clientCA != "" {
		pem, err := os.ReadFile(f.clientCA)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s holds no PEM certificate", f.clientCA)
		}
		config.ClientCAs = pool
		config.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return config, nil
}

// stampNow identifies the files' current contents: modification time, size and inode of
// each (following the symlink a Secret volume swaps); a file missing for a moment
// mid-rotation stamps as missing, and is looked at again on the next connection.
func (f *tlsFiles) stampNow() string {
	stamp := ""
	for _, path := range []string{f.cert, f.key, f.clientCA} {
		if path == "" {
			continue
		}
		info, err := os.Stat(path)
		if err != nil {
			stamp += "missing;"
			continue
		}
		inode := uint64(0)
		if st, ok := info.Sys().(*syscall.Stat_t); ok {
			inode = st.Ino
		}
		stamp += fmt.Sprintf("%d/%d/%d;", info.ModTime().UnixNano(), info.Size(), inode)
	}
	return stamp
}

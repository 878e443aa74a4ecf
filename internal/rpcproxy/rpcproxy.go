// Package rpcproxy holds what the apiserver's and the edge's agent proxies
// share: copy buffers and the buffering of unary request bodies.
package rpcproxy

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// BufferPool lends a ReverseProxy its 32 KiB copy buffers.
type BufferPool struct{ p sync.Pool }

// Get returns a buffer from the pool or a new one.
func (b *BufferPool) Get() []byte {
	if v := b.p.Get(); v != nil {
		return *v.(*[]byte)
	}
	return make([]byte, 32*1024)
}

// Put returns buf to the pool.
func (b *BufferPool) Put(buf []byte) { b.p.Put(&buf) }

// IsUnary reports whether a request is a unary Connect call: its body is one
// whole message, not a stream of enveloped ones (gRPC, gRPC-Web and Connect
// streaming content types all start with application/grpc or
// application/connect+).
func IsUnary(r *http.Request) bool {
	ct := r.Header.Get("Content-Type")
	return strings.HasPrefix(ct, "application/") &&
		!strings.HasPrefix(ct, "application/grpc") &&
		!strings.HasPrefix(ct, "application/connect+")
}

// BufferUnary reads the body of a unary call into memory before it is
// forwarded, so the hop behind the proxy never answers while the body is
// still in flight. Go's HTTP/2 client stops sending a request body when a
// response with a status over 299 arrives (Connect's unary errors), and a
// proxy still copying that body would then wait forever for the rest of it.
// Streaming calls always answer 200 and are left alone. A body over limit
// bytes is an error of class ResourceExhausted.
func BufferUnary(r *http.Request, limit int64) error {
	if r.Body == nil || r.Body == http.NoBody || !IsUnary(r) {
		return nil
	}
	if r.ContentLength > limit {
		return errdefs.ResourceExhausted("request body: %d bytes, over the %d allowed", r.ContentLength, limit)
	}
	size := r.ContentLength
	if size < 0 {
		size = 0
	}
	buf := bytes.NewBuffer(make([]byte, 0, size))
	_, err := buf.ReadFrom(io.LimitReader(r.Body, limit+1))
	r.Body.Close() //nolint:errcheck // fully read or abandoned
	switch {
	case err != nil && !errors.Is(err, io.EOF):
		return errdefs.InvalidArgument("request body: %v", err)
	case int64(buf.Len()) > limit:
		return errdefs.ResourceExhausted("request body: over the %d bytes allowed", limit)
	}
	r.Body = io.NopCloser(bytes.NewReader(buf.Bytes()))
	r.ContentLength = int64(buf.Len())
	body := buf.Bytes()
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	return nil
}

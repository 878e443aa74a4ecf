package rpcproxy

import (
	"errors"
	"io"
	"net/http"
	"strconv"

	"connectrpc.com/connect"
)

// BoundBody limits r's body to limit bytes and makes a failed read of it
// the client's error: a broken chunked encoding or a client that stops
// halfway answers invalid-argument, and a body over limit
// resource-exhausted, where Connect would call a read error unknown (an
// HTTP 500). Call it before anything reads the body.
func BoundBody(w http.ResponseWriter, r *http.Request, limit int64) {
	if r.Body == nil || r.Body == http.NoBody {
		return
	}
	r.Body = &clientBody{ReadCloser: http.MaxBytesReader(w, r.Body, limit), limit: limit}
}

type clientBody struct {
	io.ReadCloser
	limit int64
}

func (b *clientBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == nil || errors.Is(err, io.EOF) {
		return n, err
	}
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		return n, connect.NewError(connect.CodeResourceExhausted, errors.New("request body: over the "+strconv.FormatInt(b.limit, 10)+" bytes this route allows"))
	}
	return n, connect.NewError(connect.CodeInvalidArgument, errors.New("request body: "+err.Error()))
}

package rpcproxy

import "net/http"

// FullDuplex lets a proxy's handler stream a request's body while the
// response is already flowing. Without it, once the response's headers go
// out, an HTTP/1.x server reads what is left of the request body and
// closes it; the proxy's transport, which reads the body once more to see
// its end, then fails with "invalid Read on closed Body" and drops its
// connection to the backend, cutting the response mid-stream. That raced
// whenever a backend answered as soon as it had the body (E2B's Code
// Interpreter /execute under load). HTTP/2 is full duplex already.
func FullDuplex(w http.ResponseWriter) {
	_ = http.NewResponseController(w).EnableFullDuplex() //nolint:errcheck // HTTP/2: not needed
}

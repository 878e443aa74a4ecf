package errdefs

import (
	"encoding/json"
	"fmt"
	"net/http"

	"connectrpc.com/connect"
)

// HTTPStatus is the HTTP status Connect's protocol gives a code; plain HTTP
// endpoints (image upload, the E2B gateway) answer with it, so one error
// has one status wherever it surfaces.
func HTTPStatus(c connect.Code) int {
	switch c {
	case 0:
		return http.StatusOK
	case connect.CodeInvalidArgument, connect.CodeFailedPrecondition, connect.CodeOutOfRange:
		return http.StatusBadRequest
	case connect.CodeUnauthenticated:
		return http.StatusUnauthorized
	case connect.CodePermissionDenied:
		return http.StatusForbidden
	case connect.CodeNotFound:
		return http.StatusNotFound
	case connect.CodeAlreadyExists, connect.CodeAborted:
		return http.StatusConflict
	case connect.CodeResourceExhausted:
		return http.StatusTooManyRequests
	case connect.CodeUnimplemented:
		return http.StatusNotImplemented
	case connect.CodeUnavailable:
		return http.StatusServiceUnavailable
	case connect.CodeDeadlineExceeded:
		return http.StatusGatewayTimeout
	case connect.CodeCanceled:
		return 499 // the client went away (no standard status)
	}
	return http.StatusInternalServerError
}

// OnNode says which node an error came from, keeping its class. Edges do
// not name themselves in their errors; the caller that routed the request
// to a node does, once.
func OnNode(node string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("node %s: %w", node, err)
}

// ErrorHeader marks a plain HTTP answer as OpenDsec's own error (its
// value is the code), so a proxy in front (the E2B gateway) can tell it
// from an error of the sandbox's server on a port route.
const ErrorHeader = "Dsec-Error"

// WriteHTTP answers a plain HTTP route's error in Connect's JSON error
// shape ({"code": "not_found", "message": "..."}) with its status.
func WriteHTTP(w http.ResponseWriter, err error) {
	ce := ToConnect(err).(*connect.Error)
	w.Header().Set(ErrorHeader, ce.Code().String())
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(HTTPStatus(ce.Code()))
	json.NewEncoder(w).Encode(map[string]string{"code": ce.Code().String(), "message": ce.Message()}) //nolint:errcheck // the client went away
}

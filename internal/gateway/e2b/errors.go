package e2b

import (
	"encoding/json"
	"errors"
	"net/http"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// apiError is E2B's error body.
type apiError struct {
	SandboxID string `json:"sandboxId,omitempty"` // in the answers of a sandbox's host
	Code      int    `json:"code"`
	Message   string `json:"message"`
}

// statusOf is errdefs.HTTPStatus but for one code: E2B answers a failed
// precondition ("already paused", "not running") with 409 Conflict, and its
// SDKs decode that, where Connect's mapping gives 400.
func statusOf(c connect.Code) int {
	if c == connect.CodeFailedPrecondition {
		return http.StatusConflict
	}
	return errdefs.HTTPStatus(c)
}

// messageOf keeps the user-visible text of an error.
func messageOf(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Message()
	}
	return err.Error()
}

// writeError answers with E2B's {code, message} body, and the pause a
// refusal for room asked for as HTTP's Retry-After.
func writeError(w http.ResponseWriter, err error) {
	var ce *connect.Error
	if errors.As(err, &ce) && ce.Meta().Get(errdefs.RetryAfterHeader) != "" {
		w.Header().Set("Retry-After", ce.Meta().Get(errdefs.RetryAfterHeader))
	}
	code := statusOf(errdefs.Code(err))
	writeJSON(w, code, apiError{Code: code, Message: messageOf(err)})
}

// writeStatus answers an error of the gateway's own making.
func writeStatus(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, apiError{Code: code, Message: msg})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v) //nolint:errcheck // the client went away
}

// notSupported answers calls for E2B features OpenDsec does not have.
func notSupported(what string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		writeStatus(w, http.StatusNotImplemented, what+" is not supported by the OpenDsec gateway (see docs/e2b.md)")
	}
}

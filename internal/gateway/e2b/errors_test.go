package e2b

import (
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// A create every node refused for room reaches an E2B SDK as 429 with
// the apiserver's Retry-After; other errors carry none.
func TestWriteErrorPassesRetryAfterOn(t *testing.T) {
	t.Parallel()
	w := httptest.NewRecorder()
	writeError(w, errdefs.ToConnect(errdefs.RetryAfter(errdefs.ResourceExhausted("node full"), time.Second)))
	if w.Code != 429 || w.Header().Get("Retry-After") != "1" || !strings.Contains(w.Body.String(), `"message":"node full"`) {
		t.Fatalf("refusal for room: %d %v %s", w.Code, w.Header(), w.Body)
	}
	w = httptest.NewRecorder()
	writeError(w, errdefs.ToConnect(errdefs.ResourceExhausted("quota of project root/a: 2 of 2 sandboxes")))
	if w.Code != 429 || w.Header().Get("Retry-After") != "" {
		t.Fatalf("quota refusal: %d %v", w.Code, w.Header())
	}
}

package inbound

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"

	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/logging"
)

// TestAPortRequestIsCheckedBeforeItsSandboxIsLookedUp: a port outside 1 to
// 65535 is the caller's error, named; a sandbox the caller may not see is
// not found, in the caller's scope (lookup) unless the request is public
// (lookupAny).
func TestAPortRequestIsCheckedBeforeItsSandboxIsLookedUp(t *testing.T) {
	var scoped, unscoped []string
	h := Ports(func(id, scope string) (*sandbox.Sandbox, error) {
		scoped = append(scoped, id+"@"+scope)
		return nil, errdefs.NotFound("sandbox %s: no such sandbox", id)
	}, func(id string) (*sandbox.Sandbox, error) {
		unscoped = append(unscoped, id)
		return nil, errdefs.NotFound("sandbox %s: no such sandbox", id)
	}, logging.OrDiscard(nil))
	for _, tc := range []struct {
		port, public string
		code         int
		says         string
	}{
		{"0", "", http.StatusBadRequest, `port "0": want 1 to 65535`},
		{"65536", "", http.StatusBadRequest, `port "65536"`},
		{"http", "1", http.StatusBadRequest, `port "http"`},
		{"8080", "", http.StatusNotFound, "no such sandbox"},
		{"8080", "1", http.StatusNotFound, "no such sandbox"},
	} {
		r := httptest.NewRequest("GET", "http://edge/", nil)
		r.Header.Set(headers.SandboxID, "n1-abc")
		r.Header.Set(headers.SandboxPort, tc.port)
		r.Header.Set(headers.Scope, "root/team")
		if tc.public != "" {
			r.Header.Set(headers.Public, tc.public)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		var answer struct{ Message string }
		if err := json.Unmarshal(w.Body.Bytes(), &answer); err != nil {
			t.Fatalf("port %q: the answer is not an error's JSON: %v: %s", tc.port, err, w.Body)
		}
		if w.Code != tc.code || !strings.Contains(answer.Message, tc.says) {
			t.Errorf("port %q public %q: %d %s, want %d saying %q", tc.port, tc.public, w.Code, w.Body, tc.code, tc.says)
		}
	}
	if fmt.Sprint(scoped) != "[n1-abc@root/team]" || fmt.Sprint(unscoped) != "[n1-abc]" {
		t.Errorf("lookups in scope %v, by id alone %v; want one each, for the valid ports only", scoped, unscoped)
	}
}

// TestARefusedPortSaysWhereToListen: nothing listening is the commonest
// mistake (a server bound to 127.0.0.1); the answer says so.
func TestARefusedPortSaysWhereToListen(t *testing.T) {
	call := portCall{sandbox: "n1-abc", port: "8080", target: "10.64.0.2:8080"}
	err := portError(call, fmt.Errorf("dial: %w", syscall.ECONNREFUSED))
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "listen on 0.0.0.0") {
		t.Errorf("refused: %v", err)
	}
	if err := portError(call, errors.New("i/o timeout")); !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "10.64.0.2:8080: i/o timeout") {
		t.Errorf("timeout: %v", err)
	}
}

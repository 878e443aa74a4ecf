package apiserver

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edgeclient"
)

// refusingEdge refuses the first refusals connections, as an edge being
// restarted does, then answers with the request's body.
type refusingEdge struct {
	refusals, calls int
	readFirst       bool // read the body before refusing (the request went out)
}

func (e *refusingEdge) RoundTrip(r *http.Request) (*http.Response, error) {
	e.calls++
	if e.calls <= e.refusals {
		if e.readFirst {
			io.ReadAll(r.Body) //nolint:errcheck // a test
		}
		r.Body.Close()
		return nil, fmt.Errorf("dial tcp: %w", syscall.ECONNREFUSED)
	}
	body, err := io.ReadAll(r.Body)
	r.Body.Close()
	if err != nil {
		return nil, err
	}
	return &http.Response{StatusCode: 200, Body: io.NopCloser(strings.NewReader(string(body)))}, nil
}

// closeCounter counts closes of a request body.
type closeCounter struct {
	io.Reader
	closes int
}

func (c *closeCounter) Close() error { c.closes++; return nil }

// A call into a sandbox whose edge refuses connections for a moment (a
// restart) is sent again, body intact, and the body is closed once; one
// whose body went out before the refusal is not sent again.
func TestCallsIntoASandboxWaitForItsEdgeToRestart(t *testing.T) {
	send := func(e *refusingEdge) (string, *closeCounter, error) {
		body := &closeCounter{Reader: strings.NewReader("request")}
		req, _ := http.NewRequest("POST", "https://edge/x", body)
		ctx := context.WithValue(context.Background(), routeKey{}, route{edge: &edgeclient.Conn{HTTP: &http.Client{Transport: e}}, waitUntil: time.Now().Add(edgeRestartWait)})
		resp, err := viaEdge{}.RoundTrip(req.WithContext(ctx))
		if err != nil {
			return "", body, err
		}
		got, _ := io.ReadAll(resp.Body)
		return string(got), body, nil
	}
	e := &refusingEdge{refusals: 3}
	got, body, err := send(e)
	if err != nil || got != "request" || e.calls != 4 || body.closes != 1 {
		t.Fatalf("a restarting edge: %q %v after %d calls, body closed %d times", got, err, e.calls, body.closes)
	}
	e = &refusingEdge{refusals: 3, readFirst: true}
	if _, body, err = send(e); err == nil || e.calls != 1 || body.closes != 1 {
		t.Fatalf("a refusal after the body went out: %v after %d calls, body closed %d times", err, e.calls, body.closes)
	}
}

// A buffered unary call (rpcproxy.BufferUnary sets GetBody) is sent again
// even if the transport read its body first: it read it for a pooled
// connection the restarting edge had dropped, which delivered nothing,
// as the refused dial after it did (the rollout test's exec that failed
// while an edge was replaced).
func TestABufferedCallIsResentAfterADroppedConnection(t *testing.T) {
	e := &refusingEdge{refusals: 2, readFirst: true}
	req, _ := http.NewRequest("POST", "https://edge/x", strings.NewReader("request"))
	if req.GetBody == nil {
		t.Fatal("http.NewRequest gave a strings.Reader body no GetBody")
	}
	ctx := context.WithValue(context.Background(), routeKey{}, route{edge: &edgeclient.Conn{HTTP: &http.Client{Transport: e}}, waitUntil: time.Now().Add(edgeRestartWait)})
	resp, err := viaEdge{}.RoundTrip(req.WithContext(ctx))
	if err != nil {
		t.Fatalf("after %d calls: %v", e.calls, err)
	}
	got, _ := io.ReadAll(resp.Body)
	if string(got) != "request" || e.calls != 3 {
		t.Fatalf("answered %q after %d calls, want the whole body after 3", got, e.calls)
	}
}

package client

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/iam/v1/iamv1connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1/sandboxv1connect"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// apiserverStub answers WhoAmI, CreateSandbox and StopSandbox and
// remembers the idempotency keys of the creates it saw.
type apiserverStub struct {
	iamv1connect.UnimplementedIAMServiceHandler
	sandboxv1connect.UnimplementedSandboxServiceHandler
	mu    sync.Mutex
	keys  []string
	stops int
	// busy answers this many creates Unavailable, marked retryable, first;
	// unready answers every create Unavailable, unmarked.
	busy    int
	unready bool
	// full answers this many creates as a fleet without room does
	// (ResourceExhausted, marked to be sent again after a second).
	full int
}

func (s *apiserverStub) WhoAmI(context.Context, *connect.Request[iamv1.WhoAmIRequest]) (*connect.Response[iamv1.WhoAmIResponse], error) {
	return connect.NewResponse(&iamv1.WhoAmIResponse{Key: &iamv1.APIKey{Project: "root"}}), nil
}

func (s *apiserverStub) CreateSandbox(_ context.Context, r *connect.Request[sandboxv1.CreateSandboxRequest]) (*connect.Response[sandboxv1.CreateSandboxResponse], error) {
	s.mu.Lock()
	s.keys = append(s.keys, r.Header().Get(IdempotencyHeader))
	busy := len(s.keys) <= s.busy
	full := len(s.keys) <= s.full
	s.mu.Unlock()
	if full {
		return nil, errdefs.ToConnect(errdefs.RetryAfter(errdefs.ResourceExhausted("node n1: node full: 4 sandboxes, its limit is 4"), time.Second))
	}
	if busy {
		ce := connect.NewError(connect.CodeUnavailable, errors.New("its sandbox is still being made; retry"))
		ce.Meta().Set("Dsec-Retry", "1")
		return nil, ce
	}
	if s.unready {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("service did not become ready within 1s"))
	}
	return connect.NewResponse(&sandboxv1.CreateSandboxResponse{Sandbox: &sandboxv1.Sandbox{Id: "n1-sb"}}), nil
}

func (s *apiserverStub) StopSandbox(context.Context, *connect.Request[sandboxv1.StopSandboxRequest]) (*connect.Response[sandboxv1.StopSandboxResponse], error) {
	s.mu.Lock()
	s.stops++
	s.mu.Unlock()
	return connect.NewResponse(&sandboxv1.StopSandboxResponse{}), nil
}

func serveStub(t *testing.T, stub *apiserverStub) string {
	mux := http.NewServeMux()
	mux.Handle(iamv1connect.NewIAMServiceHandler(stub))
	mux.Handle(sandboxv1connect.NewSandboxServiceHandler(stub))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

// deadAddr is a loopback address where nothing listens.
func deadAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	return "http://" + ln.Addr().String()
}

// brokenAddr accepts connections, reads a little and closes them: a request
// that was sent, with no answer.
func brokenAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				io.ReadAtLeast(c, make([]byte, 64), 64) //nolint:errcheck // any amount
				c.Close()
			}()
		}
	}()
	return "http://" + ln.Addr().String()
}

func TestFailoverToTheNextAPIServer(t *testing.T) {
	ctx := context.Background()
	stub := &apiserverStub{}
	good := serveStub(t, stub)

	// Refused: any call moves on, and later calls start at the one that answered.
	c, err := New(deadAddr(t)+","+good, "key")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.IAM.WhoAmI(ctx, connect.NewRequest(&iamv1.WhoAmIRequest{})); err != nil {
		t.Fatalf("WhoAmI with the first apiserver down: %v", err)
	}
	if _, err := c.Sandbox("n1-sb").c.Sandboxes.StopSandbox(ctx, connect.NewRequest(&sandboxv1.StopSandboxRequest{SandboxId: "n1-sb"})); err != nil {
		t.Fatalf("a stop after failing over: %v", err)
	}

	// Sent, then the connection broke: a create (idempotency key) is
	// repeated elsewhere with the same key; a stop is not repeated.
	c, err = New(brokenAddr(t)+","+good, "key")
	if err != nil {
		t.Fatal(err)
	}
	sb, err := c.Create(ctx, &sandboxv1.SandboxSpec{})
	if err != nil || sb.ID != "n1-sb" {
		t.Fatalf("create with the first apiserver breaking connections: %v, %v", sb, err)
	}
	stub.mu.Lock()
	keys, stops := append([]string(nil), stub.keys...), stub.stops
	stub.mu.Unlock()
	if len(keys) != 1 || len(keys[0]) != 32 {
		t.Fatalf("idempotency keys the second apiserver saw: %q", keys)
	}
	c, _ = New(brokenAddr(t)+","+good, "key")
	if err := c.Sandbox("n1-sb").Stop(ctx); err == nil {
		t.Fatal("a stop whose connection broke was repeated on another apiserver")
	}
	stub.mu.Lock()
	defer stub.mu.Unlock()
	if stub.stops != stops {
		t.Fatalf("stops: %d, want %d", stub.stops, stops)
	}
}

func TestEndpointList(t *testing.T) {
	for _, bad := range []string{"", ",", "ftp://a", "http://a,https://b", "http://a/x,http://b/y", "http://a, nohost"} {
		if _, err := New(bad, "k"); err == nil {
			t.Errorf("New(%q) accepted", bad)
		}
	}
	c, err := New(" http://a:1/ , http://b:2 ", "k")
	if err != nil || c.URL != "http://a:1" {
		t.Fatalf("New with two URLs: %v, %v", c, err)
	}
}

// TestCreateRetriesUnavailableWithItsKey: an apiserver that answers a
// create Unavailable (one taking over a dead apiserver's create) gets it
// again, with the same key, until it answers.
func TestCreateRetriesUnavailableWithItsKey(t *testing.T) {
	stub := &apiserverStub{busy: 2}
	c, err := New(serveStub(t, stub), "key")
	if err != nil {
		t.Fatal(err)
	}
	sb, err := c.Create(context.Background(), &sandboxv1.SandboxSpec{})
	if err != nil || sb.ID != "n1-sb" {
		t.Fatalf("create: %v, %v", sb, err)
	}
	if len(stub.keys) != 3 || stub.keys[0] == "" || stub.keys[0] != stub.keys[1] || stub.keys[1] != stub.keys[2] {
		t.Fatalf("keys sent: %q, want the same key 3 times", stub.keys)
	}
}

// TestCreateDoesNotRetryWhatTheServerDidNotMark: Unavailable for a create
// that failed for good (a service that never got ready) is answered once.
func TestCreateDoesNotRetryWhatTheServerDidNotMark(t *testing.T) {
	stub := &apiserverStub{unready: true}
	c, err := New(serveStub(t, stub), "key")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Create(context.Background(), &sandboxv1.SandboxSpec{}); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("create: %v", err)
	}
	if len(stub.keys) != 1 {
		t.Fatalf("%d attempts, want 1", len(stub.keys))
	}
}

// TestCreateBacksOffWhileTheFleetIsFull: a create every node refused for
// room is sent again, with its key, after the pause the server asked for
// (spread ±25 %), until it is made; the hook hears each pause.
func TestCreateBacksOffWhileTheFleetIsFull(t *testing.T) {
	stub := &apiserverStub{full: 2}
	c, err := New(serveStub(t, stub), "key")
	if err != nil {
		t.Fatal(err)
	}
	var pauses []time.Duration
	c.OnCreateRetry = func(err error, pause time.Duration) {
		if connect.CodeOf(err) != connect.CodeResourceExhausted {
			t.Errorf("hook heard %v", err)
		}
		pauses = append(pauses, pause)
	}
	sb, err := c.Create(context.Background(), &sandboxv1.SandboxSpec{})
	if err != nil || sb.ID != "n1-sb" {
		t.Fatalf("create: %v, %v", sb, err)
	}
	if len(stub.keys) != 3 || stub.keys[0] != stub.keys[1] || stub.keys[1] != stub.keys[2] {
		t.Fatalf("keys sent: %q, want the same key 3 times", stub.keys)
	}
	if len(pauses) != 2 {
		t.Fatalf("pauses %v, want 2", pauses)
	}
	for _, p := range pauses {
		if p < 750*time.Millisecond || p > 1250*time.Millisecond {
			t.Fatalf("pause %v: not the server's second within ±25 %%", p)
		}
	}
}

// TestCreateGivesUpOnAFullFleetAfterCreateWait: the refusal comes back
// once the next pause would pass CreateWait.
func TestCreateGivesUpOnAFullFleetAfterCreateWait(t *testing.T) {
	stub := &apiserverStub{full: 100}
	c, err := New(serveStub(t, stub), "key")
	if err != nil {
		t.Fatal(err)
	}
	c.CreateWait = 500 * time.Millisecond
	_, err = c.Create(context.Background(), &sandboxv1.SandboxSpec{})
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "node full") {
		t.Fatalf("create on a full fleet: %v", err)
	}
	if len(stub.keys) != 1 {
		t.Fatalf("%d attempts within 500 ms of a 1 s pause, want 1", len(stub.keys))
	}
}

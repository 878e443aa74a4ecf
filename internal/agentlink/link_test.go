package agentlink

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"testing"
	"time"
)

func get(t *testing.T, rt http.RoundTripper, timeout time.Duration) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://agent/hello", nil)
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func TestLinkSurvivesDetachAndEdgeRestart(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "edge.sock")
	link, err := Listen(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := &Dialer{Path: path, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hi %s", r.URL.Path)
	})}
	go d.Run(ctx)

	if err := link.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if got, err := get(t, link, 5*time.Second); err != nil || got != "hi /hello" {
		t.Fatalf("first request = %q, %v", got, err)
	}

	// Detached: no socket, requests wait and fail at their deadline.
	if err := link.Detach(ctx); err != nil {
		t.Fatalf("detach: %v", err)
	}
	if _, err := get(t, link, 100*time.Millisecond); err == nil {
		t.Fatal("request succeeded while detached")
	}
	if err := link.Reattach(); err != nil {
		t.Fatal(err)
	}
	if got, err := get(t, link, 5*time.Second); err != nil || got != "hi /hello" {
		t.Fatalf("after reattach = %q, %v", got, err)
	}

	// Edge restart: a new Link on the same path is found by the agent.
	link.Close()
	link2, err := Listen(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer link2.Close()
	if got, err := get(t, link2, 5*time.Second); err != nil || got != "hi /hello" {
		t.Fatalf("after edge restart = %q, %v", got, err)
	}
	if n := d.Connects(); n != 3 {
		t.Fatalf("agent connected %d times, want 3", n)
	}
}

// An agent stopped right after it connected closes its connection: the
// edge must see it gone rather than a live agent that never answers.
func TestServeConnClosesTheConnectionWhenStoppedAtOnce(t *testing.T) {
	for i := 0; i < 50; i++ {
		agentEnd, edgeEnd := net.Pipe()
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		serveConn(ctx, agentEnd, http.NotFoundHandler())
		edgeEnd.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err := io.ReadAll(edgeEnd)
		if err != nil {
			t.Fatalf("round %d: the agent's end stayed open: %v", i, err)
		}
		edgeEnd.Close()
	}
}

// TestWaitServingWaitsForTheAgentNotTheConnection: a VM's hypervisor
// connects the link at start; the agent serves on that connection only
// once the guest has booted. WaitReady returns at the connection,
// WaitServing at the agent's first answer; every request carries the
// node's clock.
func TestWaitServingWaitsForTheAgentNotTheConnection(t *testing.T) {
	path := filepath.Join(t.TempDir(), "edge.sock")
	link, err := Listen(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer link.Close()
	conn, err := net.Dial("unix", path) // the hypervisor
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := link.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	const boot = 300 * time.Millisecond
	hostTime := make(chan string, 1)
	go func() {
		time.Sleep(boot) // the guest boots
		serveConn(ctx, conn, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			select {
			case hostTime <- r.Header.Get("Dsec-Host-Time"):
			default:
			}
		}))
	}()
	began := time.Now()
	if err := link.WaitServing(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(began); took < boot-50*time.Millisecond {
		t.Fatalf("WaitServing returned after %v, before the agent served (%v)", took, boot)
	}
	if v := <-hostTime; v == "" {
		t.Fatal("no Dsec-Host-Time on a request through the link")
	}
}

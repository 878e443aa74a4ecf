package watcher

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/edge/v1/edgev1connect"
	"github.com/opendsec/opendsec/internal/edgeclient"
)

// fakeEdge answers GetNodeStatus with a status or an error the test sets.
type fakeEdge struct {
	edgev1connect.UnimplementedEdgeServiceHandler
	mu     sync.Mutex
	status *edgev1.NodeStatus
	err    error
	delay  time.Duration // before it answers
}

func (f *fakeEdge) set(st *edgev1.NodeStatus, err error) {
	f.mu.Lock()
	f.status, f.err = st, err
	f.mu.Unlock()
}

func (f *fakeEdge) GetNodeStatus(ctx context.Context, _ *connect.Request[edgev1.GetNodeStatusRequest]) (*connect.Response[edgev1.GetNodeStatusResponse], error) {
	f.mu.Lock()
	delay := f.delay
	f.mu.Unlock()
	select {
	case <-time.After(delay):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return nil, f.err
	}
	return connect.NewResponse(&edgev1.GetNodeStatusResponse{Status: f.status}), nil
}

// startEdge serves a fake edge over TLS with HTTP/2 and returns its address
// and a pool that trusts it.
func startEdge(t *testing.T, f *fakeEdge) (string, *edgeclient.Pool) {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(edgev1connect.NewEdgeServiceHandler(f))
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	tlsConfig := srv.Client().Transport.(*http.Transport).TLSClientConfig.Clone()
	return strings.TrimPrefix(srv.URL, "https://"), edgeclient.NewPool(tlsConfig)
}

func status(node string, groups ...*edgev1.GroupUsage) *edgev1.NodeStatus {
	return &edgev1.NodeStatus{
		NodeId:    node,
		Capacity:  &edgev1.Usage{Sandboxes: 100, CpuCores: 8, MemoryMb: 16384},
		Allocated: &edgev1.Usage{Sandboxes: 3, CpuCores: 3, MemoryMb: 1536},
		Host:      &edgev1.Usage{CpuCores: 2, MemoryMb: 24576},
		Backends:  []*edgev1.BackendStatus{{Name: "container"}, {Name: "microvm", UnavailableReason: "no /dev/kvm"}},
		Groups:    groups,
	}
}

func group(project string, sandboxes int64) *edgev1.GroupUsage {
	return &edgev1.GroupUsage{Project: project, Usage: &edgev1.Usage{Sandboxes: sandboxes, CpuCores: float64(sandboxes), MemoryMb: 512 * sandboxes}}
}

func TestPollBuildsTheViewAndKeepsAnUnreachableEdge(t *testing.T) {
	f := &fakeEdge{}
	f.set(status("nodeaaaa", group("root/a", 1), group("root/a/x", 2), group("root/ab", 4)), nil)
	addr, pool := startEdge(t, f)
	w := New(Config{Edges: []string{addr}}, pool, nil)
	ctx := context.Background()

	w.Poll(ctx)
	v := w.View()
	n, ok := v.Node("nodeaaaa")
	if !ok || !n.Healthy || n.Addr != addr || n.Err != "" {
		t.Fatalf("node after a good poll: %+v (found %v)", n, ok)
	}
	if got := len(v.Healthy()); got != 1 {
		t.Fatalf("healthy nodes = %d, want 1", got)
	}
	if len(n.Status.GetGroups()) != 3 {
		t.Fatalf("groups after a good poll: %v", n.Status.GetGroups())
	}
	pn := v.Placement()
	if len(pn) != 1 || pn[0].ID != "nodeaaaa" || pn[0].Capacity.Sandboxes != 100 || pn[0].Allocated.MemoryMB != 1536 || pn[0].Host.CPUCores != 2 {
		t.Fatalf("placement view = %+v", pn)
	}
	if reason, ok := pn[0].Backends["microvm"]; !ok || reason != "no /dev/kvm" {
		t.Fatalf("backends = %v, want microvm with its reason", pn[0].Backends)
	}

	// The edge fails: the node stays, unhealthy, with its last status (what
	// it held when last heard).
	f.set(nil, connect.NewError(connect.CodeUnavailable, errors.New("draining")))
	w.Poll(ctx)
	v = w.View()
	n, ok = v.Node("nodeaaaa")
	if !ok || n.Healthy || !strings.Contains(n.Err, "draining") || n.Status == nil {
		t.Fatalf("node after a failed poll: %+v (found %v)", n, ok)
	}
	if len(v.Healthy()) != 0 {
		t.Fatal("a failing edge is still listed healthy")
	}
	if len(n.Status.GetGroups()) != 3 {
		t.Fatalf("groups of an unreachable edge: %v, want the last known 3", n.Status.GetGroups())
	}
	if pn := v.Placement(); len(pn) != 1 || pn[0].Healthy {
		t.Fatalf("placement must see the node unhealthy: %+v", pn)
	}

	// It comes back.
	f.set(status("nodeaaaa"), nil)
	w.Poll(ctx)
	if n, _ := w.View().Node("nodeaaaa"); !n.Healthy {
		t.Fatalf("node did not recover: %+v", n)
	}
}

func TestAnEdgeNeverReachedIsNotInTheView(t *testing.T) {
	f := &fakeEdge{}
	f.set(status("nodebbbb"), nil)
	addr, pool := startEdge(t, f)
	w := New(Config{Edges: []string{addr}}, pool, nil)
	w.AddEdge("127.0.0.1:1") // nothing listens there
	w.AddEdge(addr)          // already polled: not added twice
	w.Poll(context.Background())
	v := w.View()
	if len(v.Nodes) != 1 || v.Nodes[0].ID != "nodebbbb" {
		t.Fatalf("view = %+v, want only nodebbbb", v.Nodes)
	}
	w.mu.Lock()
	edges := len(w.edges)
	w.mu.Unlock()
	if edges != 2 {
		t.Fatalf("edges polled = %d, want 2", edges)
	}
}

// An edge that answers too late is slow, not gone: it stays healthy (with
// the error) for the polls a busy node may miss, then is unreachable; one
// answer in time makes it healthy again and starts the count afresh.
func TestASlowEdgeStaysHealthyForAFewPolls(t *testing.T) {
	f := &fakeEdge{}
	f.set(status("nodecccc"), nil)
	addr, pool := startEdge(t, f)
	w := New(Config{Edges: []string{addr}, Timeout: 100 * time.Millisecond}, pool, nil)
	ctx := context.Background()
	healthy := func(what string, want bool) {
		t.Helper()
		w.Poll(ctx)
		n, ok := w.View().Node("nodecccc")
		if !ok || n.Healthy != want {
			t.Fatalf("%s: %+v (found %v), want healthy %v", what, n, ok, want)
		}
		if !want || n.Err != "" {
			if n.Status == nil || !strings.Contains(n.Err, "deadline") {
				t.Fatalf("%s: error %q, status %v; want the deadline named and the last status kept", what, n.Err, n.Status)
			}
		}
	}
	healthy("answered", true)
	f.mu.Lock()
	f.delay = time.Second
	f.mu.Unlock()
	for i := 1; i < slowPollsTolerated; i++ {
		healthy(fmt.Sprintf("slow poll %d", i), true)
	}
	healthy("one slow poll too many", false)
	healthy("still slow", false)
	f.mu.Lock()
	f.delay = 0
	f.mu.Unlock()
	healthy("answered again", true)
	f.mu.Lock()
	f.delay = time.Second
	f.mu.Unlock()
	healthy("slow again: the count starts afresh", true)
}

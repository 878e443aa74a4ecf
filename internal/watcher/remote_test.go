package watcher

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
)

// TestRemoteReadsTheWatcherAndFallsBackToTheEdges: an apiserver's Remote
// takes the view a watcher daemon serves; when the watcher stops
// answering, it polls the edges itself after 3 intervals; when a watcher
// answers again, its view is used again.
func TestRemoteReadsTheWatcherAndFallsBackToTheEdges(t *testing.T) {
	f := &fakeEdge{}
	f.set(status("nodeaaaa", group("root/a", 1)), nil)
	edgeAddr, pool := startEdge(t, f)
	daemon := New(Config{Edges: []string{edgeAddr}}, pool, nil)
	ctx := context.Background()
	daemon.Poll(ctx)
	srv := httptest.NewUnstartedServer(Handler(daemon))
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	tlsConfig := srv.Client().Transport.(*http.Transport).TLSClientConfig.Clone()

	// The apiserver's own watcher, not yet polled: a view from the daemon
	// must come from the daemon.
	local := New(Config{Edges: []string{edgeAddr}}, pool, nil)
	r := NewRemote(RemoteConfig{Watchers: []string{"127.0.0.1:1", strings.TrimPrefix(srv.URL, "https://")}, TLS: tlsConfig, Local: local, Interval: 50 * time.Millisecond}, nil)
	if !r.Fetch(ctx) || !r.FromWatcher() {
		t.Fatal("no view from the second watcher after the first refused")
	}
	n, ok := r.View().Node("nodeaaaa")
	want := daemon.View().Nodes[0]
	if !ok || !n.Healthy || n.Addr != edgeAddr || !proto.Equal(n.Status, want.Status) || !n.PolledAt.Equal(want.PolledAt) {
		t.Fatalf("view from the watcher: %+v, want %+v", n, want)
	}

	// The watcher dies: the Remote polls the edge itself and sees a change
	// there.
	srv.Close()
	f.set(status("nodeaaaa", group("root/a", 5)), nil)
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go r.Run(runCtx)
	deadline := time.Now().Add(10 * time.Second)
	for r.FromWatcher() || groupsOf(r.View()) != 5 {
		if time.Now().After(deadline) {
			t.Fatalf("no fallback to the edges: from watcher %v, view %+v", r.FromWatcher(), r.View().Nodes)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func groupsOf(v *View) int64 {
	var n int64
	for _, nv := range v.Nodes {
		for _, g := range nv.Status.GetGroups() {
			n += g.Usage.Sandboxes
		}
	}
	return n
}

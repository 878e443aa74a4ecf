package watcher

import (
	"context"
	"crypto/tls"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	watcherv1 "github.com/opendsec/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/watcher/v1/watcherv1connect"
	"github.com/opendsec/opendsec/internal/logging"
)

// Source is what placement and routing read: the latest view.
type Source interface {
	View() *View
}

var (
	_ Source = (*Watcher)(nil)
	_ Source = (*Remote)(nil)
)

// Remote reads the view from watcher daemons [paper: the watcher
// aggregates, so N apiservers do not each poll M edges]. When no watcher
// has answered for a while (it died or is being upgraded) it polls the
// edges itself through local, until a watcher answers again: placement
// never stops for want of a watcher [ours].
type Remote struct {
	clients  []watcherv1connect.WatcherServiceClient
	addrs    []string
	local    *Watcher
	interval time.Duration
	log      *slog.Logger

	view     atomic.Pointer[View]
	fromPeer atomic.Bool // the view came from a watcher daemon
}

// RemoteConfig configures a Remote.
type RemoteConfig struct {
	// Watchers are the watcher daemons' addresses, tried in turn.
	Watchers []string
	TLS      *tls.Config
	// Local polls the edges when no watcher answers.
	Local    *Watcher
	Interval time.Duration
}

// staleAfter is how many intervals without an answer from a watcher make
// the apiserver poll the edges itself.
const staleAfter = 3

// NewRemote returns a Remote; Run fetches.
func NewRemote(cfg RemoteConfig, log *slog.Logger) *Remote {
	if cfg.Interval == 0 {
		cfg.Interval = time.Second
	}
	var protos http.Protocols
	protos.SetHTTP2(true)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: cfg.TLS.Clone(), Protocols: &protos, TLSHandshakeTimeout: 5 * time.Second}}
	r := &Remote{addrs: cfg.Watchers, local: cfg.Local, interval: cfg.Interval, log: logging.OrDiscard(log).With(logging.Component, "watcher-client")}
	for _, a := range cfg.Watchers {
		r.clients = append(r.clients, watcherv1connect.NewWatcherServiceClient(hc, "https://"+a, connect.WithGRPC()))
	}
	r.view.Store(cfg.Local.View())
	return r
}

// View is the latest view: a watcher's, or the local poll's.
func (r *Remote) View() *View { return r.view.Load() }

// FromWatcher reports whether the view came from a watcher daemon.
func (r *Remote) FromWatcher() bool { return r.fromPeer.Load() }

// Fetch asks the watchers in turn and keeps the first answer.
func (r *Remote) Fetch(ctx context.Context) bool {
	for i, c := range r.clients {
		cctx, cancel := context.WithTimeout(ctx, r.interval)
		resp, err := c.GetView(cctx, connect.NewRequest(&watcherv1.GetViewRequest{}))
		cancel()
		if err != nil {
			r.log.Debug("watcher did not answer", "addr", r.addrs[i], logging.Error, err)
			continue
		}
		r.view.Store(ViewFromProto(resp.Msg.Nodes))
		if !r.fromPeer.Swap(true) {
			r.log.Info("reading the view from a watcher", "addr", r.addrs[i])
		}
		return true
	}
	return false
}

// Run fetches every interval until ctx ends, polling the edges itself
// after staleAfter intervals without a watcher's answer.
func (r *Remote) Run(ctx context.Context) {
	tick := time.NewTicker(r.interval)
	defer tick.Stop()
	last := time.Now()
	for {
		if r.Fetch(ctx) {
			last = time.Now()
		} else if time.Since(last) >= staleAfter*r.interval {
			if r.fromPeer.Swap(false) {
				r.log.Warn("no watcher answers; polling the edges directly", "watchers", r.addrs)
			}
			r.local.Poll(ctx)
			r.view.Store(r.local.View())
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
